"""protein-mlm: masked-residue pretraining (BERT's 15% with 80/10/10) on UniProt sequences.

Default data: the 20,000 UniProt sequences of Debian's mmseqs2-examples, identical sequences
kept once, each placed by the CRC-32 of its sequence in train, valid or test (90/5/5), so that
no sequence is in two splits. The metric is the perplexity over the masked residues (each
sequence masked the same way in every evaluation, seeded by the sequence), beside the
perplexity of the residue frequencies of the training split (unigram) on the same residues.

`apps predict protein-mlm` fills the residues written as `?` in a sequence; `embed` returns
per-sequence (or per-residue) embeddings of the body, for other models to use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import jax
import numpy as np
from flax import nnx

from core import metrics as metric_lib
from core.config import Config, require
from core.model.heads import Projection, TiedOutput
from core.task import final, scored_positions
from core.training import losses
from tasks.common.splits import hash_split
from tasks.protein import data as protein_data
from tasks.protein import sequences
from tasks.protein.base import (
    FIRST_RESIDUE,
    ProteinData,
    ProteinTask,
    ResidueFeaturizer,
    corrupt,
    encoder,
    protein_config,
    tiny_config,
)

# In `apps predict protein-mlm` input, the residues to fill.
FILL = "?"


# Percent of the records in each split, by the CRC-32 of their key.
SHARES = {"train": 90, "valid": 5, "test": 5}


@dataclass(frozen=True, kw_only=True)
class ProteinMLMData(ProteinData):
    """`mask_rate`: the share of residues masked (BERT's 80/10/10 corruption)."""

    mask_rate: float = 0.15

    def __post_init__(self):
        super().__post_init__()
        require(0 < self.mask_rate < 1, "data.mask_rate", self.mask_rate, "must be in (0, 1)")


def tiny() -> Config:
    return tiny_config("protein-mlm", ProteinMLMData)


def base() -> Config:
    # A step of 64 crops of 128 residues takes 0.7-0.9 s on two CPU cores: 800 steps (6.6M
    # residues, most of one pass over the crops) and four validations keep training under 15 minutes.
    return protein_config(
        "protein-mlm",
        "base",
        encoder(128, 4, 128),
        steps=800,
        batch_size=64,
        lr=2e-3,
        data=ProteinMLMData(),
        eval_every=200,
    )


@final
@dataclass(frozen=True, kw_only=True)
class ProteinMLMTask(ProteinTask):
    name: ClassVar[str] = "protein-mlm"
    summary: ClassVar[str] = "Masked-residue pretraining on protein sequences"
    default_data: ClassVar[str] = "20,000 UniProt sequences (Debian mmseqs2-examples)"
    model_summary: ClassVar[str] = "encoder + tied residue output"
    metric_names: ClassVar[tuple[str, ...]] = ("perplexity", "masked_accuracy")
    best_metric: ClassVar[str] = "perplexity"
    lower_is_better: ClassVar[bool] = True
    presets: ClassVar[dict] = {"tiny": tiny, "base": base}
    default_preset: ClassVar[str] = "base"
    data_type: ClassVar[type] = ProteinMLMData
    level: ClassVar[str] = "masked"
    trim: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("inputs", "targets", "target_mask")}

    def examples(self, split: str) -> list[dict]:
        records = protein_data.uniprot() if self.data is None else self.records(None)
        return [r for r in sequences.unique(records) if hash_split(r["sequence"], SHARES) == split]

    def protocol(self) -> dict[str, str]:
        return {
            "dataset": self.data or self.default_data,
            "protocol": (
                "identical sequences once, split 90/5/5 by the CRC-32 of the sequence; "
                f"{self.config.data.mask_rate:.0%} of standard residues masked (80% mask token, 10% random, "
                "10% kept), fixed per sequence in evaluation; windows of model.max_len overlapping by half, "
                "probabilities averaged per residue"
            ),
        }

    def mask_rate(self) -> float:
        return self.config.data.mask_rate

    def fit_featurizer(self, train: Sequence[dict]) -> ResidueFeaturizer:
        return self.new_featurizer(())

    def head(self, featurizer: ResidueFeaturizer, embedder: nnx.Module, rngs: nnx.Rngs) -> nnx.Module:
        return TiedOutput(embedder)

    def augment(self, batch: dict, rng: np.random.Generator, featurizer) -> dict:
        """A random crop, then masking drawn afresh at every step."""
        batch = super().augment(batch, rng, featurizer)
        inputs, chosen = corrupt(batch["inputs"], self.config.data.mask_rate, rng)
        return {**batch, "inputs": inputs, "targets": batch["inputs"], "target_mask": chosen}

    def loss(self, projection: Projection, batch: dict):
        weights = scored_positions(batch)
        return losses.linear_cross_entropy(projection.hidden, projection.weight, batch["targets"], weights)

    def metrics(self, projection: Projection, batch: dict):
        weights = scored_positions(batch)
        return {"masked_accuracy": metric_lib.hits(projection.predictions(), batch["targets"], weights)}

    def decode(self, projection: Projection, batch: dict) -> dict[str, jax.Array]:
        # Probabilities of the 20 standard residues (of the softmax over the whole vocabulary).
        probabilities = jax.nn.softmax(projection.logits())[..., FIRST_RESIDUE:]
        return {"probabilities": probabilities, "sequence": batch["sequence"], "offset": batch["offset"]}

    def score(self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer: ResidueFeaturizer):
        rows = featurizer.per_sequence(examples)
        merged = self.merged(predictions, examples, featurizer)
        picked = np.concatenate(
            [
                np.take_along_axis(p[m], (t[m] - FIRST_RESIDUE)[:, None].astype(np.int64), axis=1)[:, 0]
                for p, t, m in zip(merged, rows["targets"], rows["target_mask"])
            ]
        )
        return {"perplexity": math.exp(-np.log(np.maximum(picked, 1e-12)).mean())}

    def baselines(self, train: Sequence[dict], test: Sequence[dict], featurizer: ResidueFeaturizer):
        """The residue frequencies of the training split (add-one smoothed) on the masked residues."""
        counts = np.ones(len(sequences.VOCAB))
        for e in train:
            counts += np.bincount(sequences.encode(e["sequence"], e["id"]), minlength=len(counts))
        counts[:FIRST_RESIDUE] = 0
        frequencies = counts / counts.sum()
        rows = featurizer.per_sequence(test)
        picked = np.concatenate([t[m] for t, m in zip(rows["targets"], rows["target_mask"])])
        return {"unigram": {"perplexity": math.exp(-np.log(frequencies[picked]).mean())}}

    def input_records(self, lines: Sequence[str], files: bool) -> list[dict]:
        """Sequences as for every protein task; each `?` is a residue to fill."""
        records = super().input_records(lines, files)
        return [
            {
                **r,
                "sequence": r["sequence"].replace(FILL, "X"),
                "fill": [i for i, c in enumerate(r["sequence"]) if c == FILL],
            }
            for r in records
        ]

    def render(self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer: ResidueFeaturizer):
        rows = []
        for e, p in zip(examples, self.merged(predictions, examples, featurizer)):
            fill = e.get("fill") or []
            letters = list(e["sequence"])
            for i in fill:
                letters[i] = sequences.AMINO_ACIDS[int(p[i].argmax())]
            # Positions count from 1, as a sequence's residues are numbered.
            positions, probabilities = [i + 1 for i in fill], [float(p[i].max()) for i in fill]
            rows.append(
                {"id": e["id"], "sequence": "".join(letters), "filled": positions, "probabilities": probabilities}
            )
        return rows
