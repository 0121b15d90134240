"""Task families built once: what every task of one shape shares.

`SequenceClassification`: one label per example (sentiment, protein-class). The featurizer
names the `classes`; the head pools the body's states into class logits; the loss is
cross-entropy with `optim.label_smoothing`; accuracy is streamed on the device; decoding gives
each row's class probabilities, which `example_probabilities` turns into one row per example
(identity, or the mean over a long sequence's windows). `class_ids` is the one place that maps
labels to class ids and refuses a label the training split never had.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

import jax
import numpy as np
from flax import nnx

from core import metrics as metric_lib
from core.errors import UserError
from core.model.heads import PooledClassifier
from core.task import Task
from core.training import losses


def class_ids(labels: Iterable, classes: Sequence[str], what: str = "Labels") -> np.ndarray:
    """The index among `classes` of each label (None, an input to predict: 0); a label that the
    training split did not have is an error naming it (and at most ten of the classes)."""
    index = {name: i for i, name in enumerate(classes)}
    labels = list(labels)
    unknown = sorted({str(label) for label in labels if label is not None} - index.keys())
    if unknown:
        shown = list(classes)[:10] + (["..."] if len(classes) > 10 else [])
        raise UserError(f"{what} {unknown[:10]} did not occur in the training split (classes: {shown}).")
    return np.array([0 if label is None else index[str(label)] for label in labels], np.int32)


class SequenceClassification(Task):
    """One label per example over mean-pooled states; see the module docstring."""

    # The streamed accuracy's name: "accuracy", or "window_accuracy" where a row is a window.
    accuracy_metric: ClassVar[str] = "accuracy"
    # Batch keys that decoding passes through per row (a window's sequence index).
    row_keys: ClassVar[tuple[str, ...]] = ()

    def head(self, featurizer, embedder: nnx.Module, rngs: nnx.Rngs) -> nnx.Module:
        return PooledClassifier(self.config.model.d_model, len(featurizer.classes), rngs=rngs)

    def loss(self, logits: jax.Array, batch: dict):
        return losses.cross_entropy(logits, batch["targets"], batch["weights"], self.config.optim.label_smoothing)

    def metrics(self, logits: jax.Array, batch: dict):
        return {self.accuracy_metric: metric_lib.accuracy(logits, batch["targets"], batch["weights"])}

    def decode(self, logits: jax.Array, batch: dict) -> dict[str, jax.Array]:
        return {"probabilities": jax.nn.softmax(logits), **{key: batch[key] for key in self.row_keys}}

    def example_probabilities(self, predictions: dict[str, np.ndarray], count: int) -> np.ndarray:
        """[count, C]: the class probabilities of each example, from the decoded rows."""
        return predictions["probabilities"]

    def predicted(self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer) -> list[dict]:
        """Each example's predicted class and its probability (a float), as `render` gives them."""
        probabilities = self.example_probabilities(predictions, len(examples))
        return [{"label": featurizer.classes[int(p.argmax())], "probability": float(p.max())} for p in probabilities]
