"""Recommendation data as arrays: the item map and the featurizer of sequential recommendation.

Item indices: 0 padding, 1 the cloze mask token, 2..V+1 the items in natural order. Training
rows (`training`) are windows of each user's history, read from its end; ranking rows (a
featurizer call) are one per user: the last items, the position to read, the target, the seen
items and, for sampled ranking, the candidates.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from core.config import DataConfig
from core.errors import UserError

PAD, MASK = 0, 1  # item i of the vocabulary has index i + 2


@dataclass(frozen=True, kw_only=True)
class RecsysData(DataConfig):
    """Data, model variant, loss and evaluation protocol of a recommendation run."""

    model_type: Literal["sasrec", "bert4rec"] = "sasrec"
    loss: Literal["softmax", "bce"] = "softmax"
    negatives: int = 1
    mask_ratio: float = 0.2
    tie_embeddings: bool = True
    ranking: Literal["full", "sampled"] = "full"
    candidates: int = 100
    sampling: Literal["uniform", "popularity"] = "uniform"
    exclude_seen: bool = True
    min_rating: float | None = None
    k_core: int = 0
    top_k: int = 20
    user_column: str = "user_id"
    item_column: str = "item_id"
    time_column: str = "timestamp"
    rating_column: str = "rating"


@dataclass
class ItemFeaturizer:
    """Item ids <-> indices (0 padding, 1 the cloze mask, 2..V+1 items), titles, popularity,
    every user's full sequence (for `--user` predictions), and the arrays of a split."""

    items: tuple[str, ...]
    titles: dict[str, str]
    popularity: np.ndarray  # [V + 2] training-split counts
    sequences: dict[str, list[str]]
    max_len: int
    options: RecsysData

    def __post_init__(self):
        self.index = {item: i + 2 for i, item in enumerate(self.items)}

    @property
    def vocab_size(self) -> int:
        return len(self.items) + 2

    def item(self, index: int) -> str:
        return self.items[index - 2]

    def history(self, example: dict) -> list[str]:
        """The example's history, or for a `--user` prediction that user's whole sequence."""
        if example["history"] is not None:
            return example["history"]
        if example["user"] not in self.sequences:
            raise UserError(f"Unknown user {example['user']!r}: not in the training log; give --history instead.")
        return self.sequences[example["user"]]

    def save(self, directory: Path) -> None:
        state = {
            "items": list(self.items),
            "titles": self.titles,
            "popularity": self.popularity.tolist(),
            "sequences": self.sequences,
        }
        (directory / "items.json").write_text(json.dumps(state))

    @classmethod
    def load(cls, directory: Path, max_len: int, options: RecsysData) -> ItemFeaturizer:
        path = directory / "items.json"
        if not path.exists():
            raise UserError(f"{path} is missing: the workdir has no item map.")
        state = json.loads(path.read_text())
        return cls(
            tuple(state["items"]),
            state["titles"],
            np.asarray(state["popularity"]),
            state["sequences"],
            max_len,
            options,
        )

    def ids(self, items: Sequence[str]) -> list[int]:
        return [self.index[i] for i in items if i in self.index]

    def training(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        """Every user's history in windows from its end: SASRec reads max_len inputs and predicts
        the next item at each; BERT4Rec reads max_len items, masked later by `augment`."""
        shift = 1 if self.options.model_type == "sasrec" else 0
        span = self.max_len + shift
        windows = []
        for example in examples:
            ids = self.ids(example["history"])
            for end in range(len(ids), shift, -self.max_len):
                window = ids[max(0, end - span) : end]
                if len(window) > shift:
                    windows.append(window)
        if not windows:
            raise UserError("No training sequence is long enough to learn from.")
        inputs = np.zeros((len(windows), self.max_len), np.int32)
        targets = np.zeros_like(inputs)
        for row, window in enumerate(windows):
            source, target = (window[:-1], window[1:]) if shift else (window, window)
            inputs[row, : len(source)], targets[row, : len(target)] = source, target
        mask = inputs != PAD
        return {
            "inputs": inputs,
            "mask": mask,
            "targets": targets,
            "target_mask": mask.copy(),
            "weights": np.ones(len(windows), np.float32),
        }

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        """One row per user: the last max_len history items (BERT4Rec: then the mask token),
        the position to read, the target, every seen item, and sampled candidates if asked."""
        histories = [self.ids(self.history(e)) for e in examples]
        keep = self.max_len - (self.options.model_type == "bert4rec")
        inputs = np.zeros((len(examples), self.max_len), np.int32)
        last = np.zeros(len(examples), np.int32)
        for row, ids in enumerate(histories):
            window = ids[-keep:] + ([MASK] if self.options.model_type == "bert4rec" else [])
            if not window:
                raise UserError(f"User {examples[row]['user']!r} has no known item in their history.")
            inputs[row, : len(window)] = window
            last[row] = len(window) - 1
        seen = np.zeros((len(examples), max(map(len, histories)) or 1), np.int32)
        for row, ids in enumerate(histories):
            seen[row, : len(ids)] = ids
        targets = np.array([self.index.get(e["target"], PAD) if e.get("target") else PAD for e in examples], np.int32)
        arrays = {
            "inputs": inputs,
            "mask": inputs != PAD,
            "last": last,
            "seen": seen,
            "targets": targets,
            "weights": np.ones(len(examples), np.float32),
        }
        if self.options.ranking == "sampled":
            arrays["candidates"] = self._candidates(targets, histories)
        return arrays

    def _candidates(self, targets: np.ndarray, histories: list[list[int]]) -> np.ndarray:
        """Target first, then `candidates` negatives the user has not seen (seed 0)."""
        rng = np.random.default_rng(0)
        weights = self.popularity[2:] + 1.0 if self.options.sampling == "popularity" else np.ones(len(self.items))
        weights = weights / weights.sum()
        rows = np.zeros((len(targets), 1 + self.options.candidates), np.int32)
        unseen = [len(self.items) - len(set(ids) | {int(target)}) for target, ids in zip(targets, histories)]
        if min(unseen) < self.options.candidates:
            raise UserError(
                f"data.candidates={self.options.candidates}, but a user has only {min(unseen)} unseen items to "
                f"sample from: lower data.candidates to at most {min(unseen)}, or use data.ranking=full."
            )
        for row, (target, ids) in enumerate(zip(targets, histories)):
            excluded, chosen = set(ids) | {int(target)}, []
            while len(chosen) < self.options.candidates:
                for item in rng.choice(len(self.items), 2 * self.options.candidates, p=weights) + 2:
                    if item not in excluded and len(chosen) < self.options.candidates:
                        excluded.add(int(item))
                        chosen.append(int(item))
            rows[row] = [target, *chosen]
        return rows
