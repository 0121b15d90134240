"""Host-side classification scores (scikit-learn) and the TF-IDF + logistic-regression baseline
that every sentiment result is reported beside."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, f1_score, precision_recall_fscore_support

PER_CLASS_LIMIT = 10


def classification_scores(truth: Sequence[int], predicted: Sequence[int], classes: Sequence[str]) -> dict[str, float]:
    """Accuracy, macro-F1 and, for up to PER_CLASS_LIMIT classes, per-class precision and recall
    (beyond that, a table of them would bury the rest)."""
    labels = list(range(len(classes)))
    truth, predicted = np.asarray(truth), np.asarray(predicted)
    precision, recall, _, _ = precision_recall_fscore_support(truth, predicted, labels=labels, zero_division=0)
    scores = {
        "accuracy": float(accuracy_score(truth, predicted)),
        "macro_f1": float(f1_score(truth, predicted, labels=labels, average="macro", zero_division=0)),
    }
    for name, p, r in zip(classes if len(classes) <= PER_CLASS_LIMIT else (), precision, recall):
        scores[f"precision_{name}"] = float(p)
        scores[f"recall_{name}"] = float(r)
    return scores


def tfidf_baseline(train: Sequence[dict], test: Sequence[dict], classes: Sequence[str]) -> dict[str, float]:
    """Word 1-2-gram TF-IDF (sublinear tf) and L2 logistic regression, fitted on `train`."""
    index = {name: i for i, name in enumerate(classes)}
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    features = vectorizer.fit_transform([e["text"] for e in train])
    model = LogisticRegression(C=10.0, max_iter=2000)
    model.fit(features, [index[str(e["label"])] for e in train])
    predicted = model.predict(vectorizer.transform([e["text"] for e in test]))
    return classification_scores([index[str(e["label"])] for e in test], predicted, classes)
