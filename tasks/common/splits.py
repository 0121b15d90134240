"""Fixed splits that every run and every user sees alike.

`hash_split` places a record by the CRC-32 of a key (a normalized source, a sequence, a
species, a clip's path): the same key lands in the same split in every process, whatever the
order or the size of the data, so no key is in two splits. `stratified_split` is the
scikit-learn split of a labelled table, 80/10/10 with a fixed seed and each class in
proportion.
"""

from __future__ import annotations

import zlib

import numpy as np
from sklearn.model_selection import train_test_split

from core.errors import UserError

SPLITS = ("train", "valid", "test")
# Fractions of the whole table in valid and test; the rest is train.
VALID_FRACTION, TEST_FRACTION, SPLIT_SEED = 0.1, 0.1, 0


def hash_split(key: str, shares: dict[str, int]) -> str:
    """The split of `key`: its CRC-32 modulo the sum of `shares` falls in one split's share, the
    shares laid out in their order ({"train": 90, "valid": 5, "test": 5}: buckets 0-89 train)."""
    bucket = zlib.crc32(key.encode("utf-8")) % sum(shares.values())
    for split, share in shares.items():
        if bucket < share:
            return split
        bucket -= share
    raise AssertionError("unreachable: the bucket is below the sum of the shares")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"Unknown split {split!r}: expected {', '.join(SPLITS)}.")


def stratified_split(labels: list, split: str, train_fraction: float = 1.0) -> np.ndarray:
    """The rows (sorted) of `split` in the fixed stratified split (80/10/10, seed 0) of a table
    with these labels; with `train_fraction` < 1, a stratified share of the training rows (for
    learning curves; valid and test stay whole; a smaller share is part of a larger one)."""
    check_split(split)
    labels = np.asarray(labels, dtype=object).astype(str)
    rows = np.arange(len(labels))
    counts = dict(zip(*np.unique(labels, return_counts=True)))
    stratify = labels if min(counts.values()) >= 3 else None
    try:
        rest, test = train_test_split(rows, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=stratify)
        rest_labels = labels[rest] if stratify is not None else None
        train, valid = train_test_split(
            rest, test_size=VALID_FRACTION / (1 - TEST_FRACTION), random_state=SPLIT_SEED, stratify=rest_labels
        )
    except ValueError as error:
        raise UserError(f"The table of {len(rows)} rows is too small to split 80/10/10: {error}") from None
    chosen = {"train": train, "valid": valid, "test": test}[split]
    if split == "train" and train_fraction < 1:
        # The first share of each class in one fixed shuffle: stratified, and nested.
        shuffled = np.random.default_rng(SPLIT_SEED).permutation(train)
        chosen = np.concatenate(
            [
                members[: max(round(train_fraction * len(members)), 1)]
                for members in (shuffled[labels[shuffled] == name] for name in np.unique(labels[train]))
            ]
        )
    return np.sort(chosen)
