"""protein-class: one label per sequence.

Default (`--preset base`): antimicrobial peptides vs UniProt fragments, the 5,200 of modlamp's
AMPvsUniProt.csv; identical sequences once (the first label kept), split 80/10/10 by the CRC-32
of the sequence. Accuracy, MCC and AUROC.
`--preset family`: the protein family (the UniProt name shared by at least 20 of the mmseqs2
example sequences; uncharacterized, putative, predicted and similar names left out), split
80/10/10 by the CRC-32 of the species (`OS=`), so that no species is in two splits. Macro-F1.

Your own data: `--data` a table with `data.sequence_column` and `data.label_column`, or a FASTA
file whose headers end in `label=NAME`; split like AMP.

Beside the model: a k-mer TF-IDF (1-3-mers of residues) + logistic-regression baseline fitted on
the same training split. Sequences longer than model.max_len are read in windows that overlap by
half, and the class probabilities are averaged over a sequence's windows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import matthews_corrcoef, roc_auc_score

from core.config import Config
from core.errors import UserError
from core.task import final
from tasks.common.families import SequenceClassification, class_ids
from tasks.common.scoring import classification_scores
from tasks.common.splits import hash_split
from tasks.protein import data as protein_data
from tasks.protein import sequences
from tasks.protein.base import LabelledProteinData, ProteinTask, ResidueFeaturizer, encoder, protein_config, tiny_config

# Percent of the records in each split, by the CRC-32 of their key.
SHARES = {"train": 80, "valid": 10, "test": 10}


@dataclass(frozen=True, kw_only=True)
class ProteinClassData(LabelledProteinData):
    """`labels`: the embedded labels, AMP vs UniProt or the protein family."""

    labels: Literal["amp", "family"] = "amp"


def tiny() -> Config:
    return tiny_config("protein-class", ProteinClassData)


def base() -> Config:
    # Peptides are 7-174 residues long (half under 32): windows of 64 hold nearly all whole.
    return protein_config(
        "protein-class",
        "base",
        encoder(128, 4, 64),
        steps=1500,
        batch_size=32,
        lr=1e-3,
        data=ProteinClassData(),
        eval_every=250,
    )


def family() -> Config:
    """Protein families, with the protein-mlm base body's sizes, so that a run can start from it
    (`--init-from`)."""
    return protein_config(
        "protein-class",
        "family",
        encoder(128, 4, 128),
        steps=600,
        batch_size=32,
        lr=1e-3,
        data=ProteinClassData(labels="family"),
        eval_every=100,
    )


@final
@dataclass(frozen=True, kw_only=True)
class ProteinClassTask(ProteinTask, SequenceClassification):
    name: ClassVar[str] = "protein-class"
    summary: ClassVar[str] = "One label per protein sequence (AMP vs UniProt; protein family)"
    default_data: ClassVar[str] = "AMP vs UniProt peptides (modlamp 4.3.3)"
    model_summary: ClassVar[str] = "encoder + mean pool"
    metric_names: ClassVar[tuple[str, ...]] = ("macro_f1", "accuracy", "mcc")
    best_metric: ClassVar[str] = "macro_f1"
    presets: ClassVar[dict] = {"tiny": tiny, "base": base, "family": family}
    default_preset: ClassVar[str] = "base"
    data_type: ClassVar[type] = ProteinClassData
    level: ClassVar[str] = "sequence"
    accuracy_metric: ClassVar[str] = "window_accuracy"
    row_keys: ClassVar[tuple[str, ...]] = ("sequence",)

    def _records(self) -> tuple[list[dict], str]:
        """All labelled records and what places each in a split ("sequence" or "species")."""
        if self.data is not None:
            if sequences.is_sequence_file(self.data):
                records = [{**r, "label": header_label(r)} for r in self.records(None)]
            else:
                records = self.records(self.config.data.label_column)
            return sequences.unique(records), "sequence"
        if self.config.data.labels == "family":
            return protein_data.families(protein_data.uniprot()), "species"
        return sequences.unique(protein_data.amp()), "sequence"

    def examples(self, split: str) -> list[dict]:
        records, key = self._records()
        examples = [r for r in records if hash_split(r[key], SHARES) == split]
        if split == "train" and len({e["label"] for e in examples}) < 2:
            raise UserError(f"The training split of {self.data or self.default_data} has fewer than two classes.")
        return examples

    def protocol(self) -> dict[str, str]:
        family = self.data is None and self.config.data.labels == "family"
        dataset = self.data or ("UniProt families (Debian mmseqs2-examples)" if family else self.default_data)
        split = "the species (OS=)" if family else "the sequence (identical sequences once)"
        return {
            "dataset": dataset,
            "protocol": f"split 80/10/10 by the CRC-32 of {split}; windows of model.max_len overlapping by half, "
            "class probabilities averaged per sequence",
        }

    def fit_featurizer(self, train: Sequence[dict]) -> ResidueFeaturizer:
        return self.new_featurizer(tuple(sorted({str(e["label"]) for e in train})))

    def example_probabilities(self, predictions: dict[str, np.ndarray], count: int) -> np.ndarray:
        return sequences.merge_rows(predictions["probabilities"], predictions["sequence"], count)

    def score(self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer: ResidueFeaturizer):
        probabilities = self.example_probabilities(predictions, len(examples))
        return scores(class_ids([e["label"] for e in examples], featurizer.classes), probabilities, featurizer.classes)

    def baselines(self, train: Sequence[dict], test: Sequence[dict], featurizer: ResidueFeaturizer):
        return {"kmer_tfidf_logreg": kmer_baseline(train, test, featurizer.classes)}

    def render(self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer: ResidueFeaturizer):
        return [{"id": e["id"], **row} for e, row in zip(examples, self.predicted(predictions, examples, featurizer))]


def header_label(record: dict) -> str:
    """The `label=NAME` at the end of a FASTA header (after the id), for a user's labelled FASTA."""
    match = re.search(r"(?:^|\s)label=(\S+)\s*$", record.get("description", ""))
    if match is None:
        raise UserError(f"Record {record['id']!r}: a labelled FASTA header ends in label=NAME (`>id label=amp`).")
    return match.group(1)


def scores(truth: Sequence[int], probabilities: np.ndarray, classes: Sequence[str]) -> dict[str, float]:
    """Accuracy, macro-F1, per-class precision and recall, MCC; AUROC for two classes."""
    predicted = probabilities.argmax(-1)
    result = classification_scores(truth, predicted, classes)
    result["mcc"] = float(matthews_corrcoef(truth, predicted))
    if len(classes) == 2 and len(set(truth)) == 2:
        result["auroc"] = float(roc_auc_score(truth, probabilities[:, 1]))
    return result


def kmer_baseline(train: Sequence[dict], test: Sequence[dict], classes: Sequence[str]) -> dict[str, float]:
    """TF-IDF of residue 1-3-mers (sublinear tf) and L2 logistic regression, fitted on `train`."""
    index = {name: i for i, name in enumerate(classes)}
    vectorizer = TfidfVectorizer(analyzer="char", ngram_range=(1, 3), sublinear_tf=True, lowercase=False)
    features = vectorizer.fit_transform([e["sequence"] for e in train])
    model = LogisticRegression(C=10.0, max_iter=3000)
    model.fit(features, [index[str(e["label"])] for e in train])
    probabilities = model.predict_proba(vectorizer.transform([e["sequence"] for e in test]))
    # predict_proba's columns are the classes seen in training, in order.
    full = np.zeros((len(test), len(classes)))
    full[:, model.classes_] = probabilities
    return scores([index.get(str(e["label"]), -1) for e in test], full, classes)
