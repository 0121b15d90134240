"""What the three protein tasks share: the residue featurizer, the model composition (residue
embeddings -> encoder -> the task's head), random crops for training, sliding windows for
evaluation, reading users' sequence files, and `apps predict` / `embed` over sequences.

The featurizer turns records into rows of at most `model.max_len` residues:
- for evaluation and prediction, windows that overlap by half (`sequences.windows`), whose
  outputs `score` and `render` average back per sequence;
- for training (`featurize_train`), each sequence whole (pieces of `data.piece_len` when
  longer), which the augment hook crops at random to `model.max_len` at every step.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from flax import nnx

from core.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, require
from core.errors import UserError
from core.model.heads import TokenEmbedder
from core.model.states import last_states
from core.options import RequestLimits
from core.presets import modern_blocks, tiny_preset
from core.task import Task
from tasks.common.families import class_ids
from tasks.protein import data as protein_data
from tasks.protein import sequences

Level = Literal["masked", "sequence", "residue"]


@dataclass(frozen=True, kw_only=True)
class ProteinData(DataConfig):
    """The options every protein task shares (each task's data config adds its own). Columns name
    a table's fields (FASTA and flat files carry ids and sequences themselves). `piece_len`:
    training rows hold sequences up to this many residues (longer ones in consecutive pieces),
    cropped at random to model.max_len."""

    sequence_column: str = "sequence"
    id_column: str = "id"
    piece_len: int = 1024

    def __post_init__(self):
        require(self.piece_len > 0, "data.piece_len", self.piece_len, "must be positive")


@dataclass(frozen=True, kw_only=True)
class LabelledProteinData(ProteinData):
    """The data of a task that learns labels: a table's label column."""

    label_column: str = "label"


def protein_config(
    task: str,
    preset: str,
    model: ModelConfig,
    steps: int,
    batch_size: int,
    lr: float,
    data: ProteinData,
    eval_every: int = 200,
) -> Config:
    return Config(
        task=task,
        preset=preset,
        model=model,
        optim=OptimConfig(learning_rate=lr, warmup_steps=min(200, steps // 10), weight_decay=0.01),
        train=TrainConfig(
            batch_size=batch_size,
            eval_batch_size=128,
            steps=steps,
            eval_every=eval_every,
            checkpoint_every=eval_every,
            log_every=max(1, min(50, steps // 10)),
        ),
        data=data,
    )


def tiny_config(task: str, data_type: type[ProteinData]) -> Config:
    """A one-layer model and a few steps, for tests."""
    data = data_type(piece_len=128)
    return tiny_preset(task, encoder(32, 1, 64, 0.0), data, eval_batch_size=128, warmup_steps=2, log_every=2)


def encoder(d_model: int, num_layers: int, max_len: int, dropout: float = 0.1) -> ModelConfig:
    """A bidirectional body of today's blocks; rotary positions, so that runs of one size share
    their weights whatever their max_len (`--init-from`)."""
    return modern_blocks(d_model, num_layers, max(1, d_model // 32), 4 * d_model, max_len, dropout)


# --- Masking ---------------------------------------------------------------------------------

FIRST_RESIDUE = sequences.VOCAB.index(sequences.AMINO_ACIDS[0])


def corrupt(ids: np.ndarray, rate: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking: each standard residue is chosen with probability `rate` (padding, the mask
    token and X never are); a chosen one becomes the mask token (80%), a random residue (10%) or
    stays (10%). -> (the corrupted ids, the chosen positions)."""
    chosen = (rng.random(ids.shape) < rate) & (ids >= FIRST_RESIDUE)
    roll = rng.random(ids.shape)
    random_residues = rng.integers(FIRST_RESIDUE, len(sequences.VOCAB), ids.shape)
    corrupted = np.where(chosen & (roll < 0.8), sequences.MASK, np.where(chosen & (roll < 0.9), random_residues, ids))
    return corrupted.astype(ids.dtype), chosen


def fixed_corruption(codes: np.ndarray, rate: float) -> tuple[np.ndarray, np.ndarray]:
    """`corrupt` seeded by the sequence itself: the same masks for a sequence in every evaluation."""
    return corrupt(codes, rate, np.random.default_rng(list(codes.astype(np.uint32)[:64]) + [len(codes)]))


def filled(codes: np.ndarray, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The mask token at `positions` (the residues a user asks to fill), as `corrupt` returns it."""
    chosen = np.zeros(len(codes), bool)
    chosen[list(positions)] = True
    return np.where(chosen, sequences.MASK, codes).astype(codes.dtype), chosen


# --- Featurizer ------------------------------------------------------------------------------


@dataclass
class ResidueFeaturizer:
    """Records -> rows of residue ids. `level`: what the targets are: the residues themselves
    under masking (`masked`), one class per sequence (`sequence`) or one per residue (`residue`),
    `classes` naming them (label letters for `residue`)."""

    level: Level
    classes: tuple[str, ...]
    max_len: int
    piece_len: int
    mask_rate: float

    def save(self, directory: Path) -> None:
        (directory / "residues.json").write_text(json.dumps({"level": self.level, "classes": list(self.classes)}))

    @classmethod
    def load(cls, directory: Path, max_len: int, piece_len: int, mask_rate: float) -> ResidueFeaturizer:
        saved = json.loads((directory / "residues.json").read_text())
        return cls(saved["level"], tuple(saved["classes"]), max_len, piece_len, mask_rate)

    @staticmethod
    def lengths(examples: Sequence[dict]) -> list[int]:
        """Residues per record, as `sequences.encode` counts them."""
        return [len(sequences.clean(e["sequence"])) for e in examples]

    def per_sequence(self, examples: Sequence[dict]) -> dict[str, list[np.ndarray]]:
        """Each record's arrays of its own length: ids (and targets, target_mask), uncut."""
        codes = [sequences.encode(e["sequence"], e["id"]) for e in examples]
        if self.level == "masked":
            corrupted = [
                fixed_corruption(c, self.mask_rate) if e.get("fill") is None else filled(c, e["fill"])
                for e, c in zip(examples, codes)
            ]
            return {"inputs": [c for c, _ in corrupted], "targets": codes, "target_mask": [m for _, m in corrupted]}
        if self.level == "residue":
            labels = [self._residue_labels(e, len(c)) for e, c in zip(examples, codes)]
            return {"inputs": codes, "targets": [t for t, _ in labels], "target_mask": [m for _, m in labels]}
        return {"inputs": codes}

    def _residue_labels(self, example: dict, length: int) -> tuple[np.ndarray, np.ndarray]:
        label = example.get("label")
        if label is None:
            return np.zeros(length, np.int32), np.zeros(length, bool)
        if len(label) != length:
            raise UserError(
                f"Record {example['id']!r}: its label string has {len(label)} letters, its sequence "
                f"{len(sequences.clean(example['sequence']))} residues; they must pair one to one."
            )
        index = {name: i for i, name in enumerate(self.classes)}
        unknown = sorted(set(label) - index.keys())
        if unknown:
            raise UserError(
                f"Record {example['id']!r}: residue labels {unknown} did not occur in the training split "
                f"(labels: {''.join(self.classes)})."
            )
        return np.array([index[c] for c in label], np.int32), np.ones(length, bool)

    def _finish(self, rows: dict[str, np.ndarray], examples: Sequence[dict]) -> dict[str, np.ndarray]:
        rows["mask"] = rows["inputs"] != sequences.PAD
        rows["inputs"] = rows["inputs"].astype(np.int32)
        if self.level == "sequence":
            rows["targets"] = class_ids([e["label"] for e in examples], self.classes)[rows["sequence"]]
        else:
            rows["targets"] = rows["targets"].astype(np.int32)
            rows["target_mask"] = rows["target_mask"].astype(bool)
        rows["weights"] = np.ones(len(rows["inputs"]), np.float32)
        return rows

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        """Evaluation and prediction rows: windows of `max_len`."""
        return self._finish(sequences.windows(self.per_sequence(examples), self.max_len), examples)

    def training(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        """Training rows: whole sequences (pieces of `piece_len`), cropped later by `augment`;
        for masking, uncorrupted, nothing chosen yet (augment masks afresh at every step)."""
        if self.level == "masked":
            codes = [sequences.encode(e["sequence"], e["id"]) for e in examples]
            per_sequence = {"inputs": codes, "targets": codes, "target_mask": [np.zeros(len(c), bool) for c in codes]}
        else:
            per_sequence = self.per_sequence(examples)
        rows = self._finish(sequences.pieces(per_sequence, max(self.piece_len, self.max_len)), examples)
        del rows["sequence"], rows["offset"]
        return rows


# --- The tasks' shared part ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ProteinTask(Task):
    """The shared part of protein-mlm, protein-class and protein-residue."""

    level: ClassVar[Level]
    trim: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("inputs",)}

    config: Config
    data: str | None = None

    def records(self, label_column: str | None) -> list[dict]:
        """The records of --data (each task reads its default itself), labelled from
        `label_column`; "synthetic": `protein_data.synthetic()`, labelled for this task's level."""
        if self.data == "synthetic":
            label = {"masked": None, "sequence": "label", "residue": "structure"}[self.level]
            return [{**r, "label": r[label] if label else None} for r in protein_data.synthetic()]
        o = self.config.data
        return sequences.read_sequences(self.data, o.sequence_column, label_column, o.id_column)

    def mask_rate(self) -> float:
        """The share of residues that the featurizer masks in evaluation rows (protein-mlm's)."""
        return 0.0

    def load_featurizer(self, directory: Path) -> ResidueFeaturizer:
        return ResidueFeaturizer.load(
            directory, self.config.model.max_len, self.config.data.piece_len, self.mask_rate()
        )

    def new_featurizer(self, classes: tuple[str, ...]) -> ResidueFeaturizer:
        piece_len = self.config.data.piece_len
        return ResidueFeaturizer(self.level, classes, self.config.model.max_len, piece_len, self.mask_rate())

    def featurize_train(self, featurizer: ResidueFeaturizer, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        return featurizer.training(examples)

    def augment(self, batch: dict, rng: np.random.Generator, featurizer) -> dict:
        """A random crop of `model.max_len` residues of each longer row, the same for its labels."""
        keys = [k for k in ("inputs", "mask", "targets", "target_mask") if k in batch and np.ndim(batch[k]) == 2]
        return sequences.crop(batch, keys, self.config.model.max_len, rng)

    def embedder(self, featurizer: ResidueFeaturizer, rngs: nnx.Rngs) -> nnx.Module:
        return TokenEmbedder(len(sequences.VOCAB), self.config.model.d_model, rngs=rngs)

    def merged(self, predictions: dict[str, np.ndarray], examples: Sequence[dict], featurizer) -> list[np.ndarray]:
        """Each example's per-residue probabilities [L, C]: the mean over the windows covering each residue."""
        return sequences.merge_windows(
            predictions["probabilities"], predictions["sequence"], predictions["offset"], featurizer.lengths(examples)
        )

    def parse_inputs(self, lines: Sequence[str], options: dict) -> list[dict]:
        """Sequences given as text (one per argument or line), as FASTA on stdin, or as the paths
        of sequence files."""
        return self.input_records(lines, files=True)

    def parse_request(
        self, inputs: Sequence[str], options: dict, limits: RequestLimits = RequestLimits()
    ) -> list[dict]:
        """Sequences as text or FASTA text: a server never opens a path a request names."""
        return self.input_records(inputs, files=False)

    def input_records(self, lines: Sequence[str], files: bool) -> list[dict]:
        """The examples of `parse_inputs` (with `files`, a line naming a file reads it)."""
        lines = [line.strip() for line in lines if line.strip()]
        if not lines:
            raise UserError(f"apps predict {self.name} needs sequences (as arguments, FASTA on stdin, or files).")
        records, fasta = [], []
        for number, line in enumerate(lines, start=1):
            if line.startswith(">") or fasta:
                fasta.append(line)
            elif files and Path(line).is_file():
                records += sequences.read_sequences(line)
            else:
                records.append({"id": f"input {number}", "sequence": line.upper(), "label": None})
        if fasta:
            records += sequences.parse_text("\n".join(fasta), "fasta", "input")
        return [{**r, "label": None} for r in records]

    def embed(
        self, model: nnx.Module, featurizer: ResidueFeaturizer, examples: Sequence[dict], per_position: bool = False
    ) -> list[np.ndarray]:
        """Per-sequence mean embeddings [D] (or per-residue [L, D]) of the body's last states over
        the sequences as they are (never masked), averaged over the windows covering each residue."""
        codes = [sequences.encode(e["sequence"], e["id"]) for e in examples]
        rows = sequences.windows({"inputs": codes}, featurizer.max_len)
        ids = rows["inputs"].astype(np.int32)
        hidden = last_states(model, ids, ids != sequences.PAD, self.config.train.eval_batch_size)
        residues = sequences.merge_windows(hidden, rows["sequence"], rows["offset"], [len(c) for c in codes])
        return residues if per_position else [r.mean(0) for r in residues]
