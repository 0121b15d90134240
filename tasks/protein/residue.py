"""protein-residue: one label per residue, such as secondary structure (Q3: H, E, C; Q8: the
eight DSSP states), in the form NetSurfP and TAPE use: each sequence paired with a label string
of the same length.

Default data: the DSSP states of the PDB chains in ProMod3's structure database (Debian's
`promod3-data`, /usr/share/promod3/loop_data/structure_db.dat, read by `structure_db.py`):
20,661 chains of 30 residues or more, Q3 by default (H, G, I -> H; E, B -> E; T, S, coil -> C),
`--preset q8` for the eight states.

Your data: `--data` a table (CSV/TSV/JSONL/parquet) with `data.sequence_column` and
`data.label_column` (the label strings), split 80/10/10 by the CRC-32 of the sequence
(identical sequences once). The label letters are the classes.

Metrics: per-residue accuracy (Q3 or Q8 for secondary structure) and per-class recall, beside
the baseline that gives each residue type its most frequent label in the training split.
Sequences longer than model.max_len are read in windows that overlap by half, and each
residue's class probabilities are averaged over the windows that cover it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import jax
import numpy as np
from flax import nnx

from core import metrics as metric_lib
from core.config import Config
from core.errors import UserError
from core.model.heads import TokenClassifier
from core.task import final, scored_positions
from core.training import losses
from tasks.common.splits import hash_split
from tasks.protein import data as protein_data
from tasks.protein import sequences
from tasks.protein.base import LabelledProteinData, ProteinTask, ResidueFeaturizer, encoder, protein_config, tiny_config

# Percent of the records in each split, by the CRC-32 of their key.
SHARES = {"train": 80, "valid": 10, "test": 10}


@dataclass(frozen=True, kw_only=True)
class ProteinResidueData(LabelledProteinData):
    """`states`: the embedded DSSP states, eight or reduced to three."""

    states: Literal["q3", "q8"] = "q3"


def tiny() -> Config:
    return tiny_config("protein-residue", ProteinResidueData)


def base() -> Config:
    # Chains average 215 residues; crops of 128, 64 a step: about 10 minutes on two CPU cores.
    # The sizes of the protein-mlm base, so that a run can start from it (`--init-from`).
    return protein_config(
        "protein-residue",
        "base",
        encoder(128, 4, 128),
        steps=1000,
        batch_size=64,
        lr=1e-3,
        data=ProteinResidueData(),
        eval_every=250,
    )


def q8() -> Config:
    """The eight DSSP states."""
    config = base()
    return dataclasses.replace(config, preset="q8", data=dataclasses.replace(config.data, states="q8"))


@final
@dataclass(frozen=True, kw_only=True)
class ProteinResidueTask(ProteinTask):
    name: ClassVar[str] = "protein-residue"
    summary: ClassVar[str] = "One label per residue (secondary structure)"
    default_data: ClassVar[str] = protein_data.SECONDARY_STRUCTURE_SUMMARY
    model_summary: ClassVar[str] = "encoder + per-residue classifier"
    metric_names: ClassVar[tuple[str, ...]] = ("accuracy",)
    best_metric: ClassVar[str] = "accuracy"
    presets: ClassVar[dict] = {"tiny": tiny, "base": base, "q8": q8}
    default_preset: ClassVar[str] = "base"
    data_type: ClassVar[type] = ProteinResidueData
    level: ClassVar[str] = "residue"
    trim: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("inputs", "targets", "target_mask")}

    def examples(self, split: str) -> list[dict]:
        if self.data is None:
            records = protein_data.secondary_structure(self.config.data.states)
        else:
            records = self.records(self.config.data.label_column)
        return [r for r in sequences.unique(records) if hash_split(r["sequence"], SHARES) == split]

    def protocol(self) -> dict[str, str]:
        return {
            "dataset": self.data or self.default_data,
            "protocol": "identical sequences once, split 80/10/10 by the CRC-32 of the sequence; windows of "
            "model.max_len overlapping by half, probabilities averaged per residue",
        }

    def fit_featurizer(self, train: Sequence[dict]) -> ResidueFeaturizer:
        letters = sorted({c for e in train for c in e["label"]})
        if len(letters) < 2:
            raise UserError(
                f"The training split's label strings use {len(letters)} letter(s): at least two are needed."
            )
        return self.new_featurizer(tuple(letters))

    def head(self, featurizer: ResidueFeaturizer, embedder: nnx.Module, rngs: nnx.Rngs) -> nnx.Module:
        return TokenClassifier(self.config.model.d_model, len(featurizer.classes), rngs=rngs)

    def loss(self, logits: jax.Array, batch: dict):
        weights = scored_positions(batch)
        return losses.cross_entropy(logits, batch["targets"], weights, self.config.optim.label_smoothing)

    def metrics(self, logits: jax.Array, batch: dict):
        weights = scored_positions(batch)
        return {"window_accuracy": metric_lib.accuracy(logits, batch["targets"], weights)}

    def decode(self, logits: jax.Array, batch: dict) -> dict[str, jax.Array]:
        return {"probabilities": jax.nn.softmax(logits), "sequence": batch["sequence"], "offset": batch["offset"]}

    def score(self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer: ResidueFeaturizer):
        truth = np.concatenate(featurizer.per_sequence(examples)["targets"])
        predicted = np.concatenate([p.argmax(-1) for p in self.merged(predictions, examples, featurizer)])
        return residue_scores(truth, predicted, featurizer.classes)

    def baselines(self, train: Sequence[dict], test: Sequence[dict], featurizer: ResidueFeaturizer):
        """Each residue type's most frequent label in the training split."""
        fitted = featurizer.per_sequence(train)
        counts = np.zeros((len(sequences.VOCAB), len(featurizer.classes)), np.int64)
        np.add.at(counts, (np.concatenate(fitted["inputs"]), np.concatenate(fitted["targets"])), 1)
        majority = counts.argmax(1)
        scored = featurizer.per_sequence(test)
        predicted = majority[np.concatenate(scored["inputs"])]
        return {
            "majority_per_residue": residue_scores(np.concatenate(scored["targets"]), predicted, featurizer.classes)
        }

    def render(self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer: ResidueFeaturizer):
        return [
            {"id": e["id"], "sequence": e["sequence"], "labels": "".join(featurizer.classes[i] for i in p.argmax(-1))}
            for e, p in zip(examples, self.merged(predictions, examples, featurizer))
        ]


def residue_scores(truth: np.ndarray, predicted: np.ndarray, classes: Sequence[str]) -> dict[str, float]:
    """Per-residue accuracy and each class's recall."""
    result = {"accuracy": float((truth == predicted).mean())}
    for index, name in enumerate(classes):
        hit = truth == index
        result[f"recall_{name}"] = float((predicted[hit] == index).mean()) if hit.any() else float("nan")
    return result
