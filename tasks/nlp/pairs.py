"""The (source, target) pairs of the seq2seq tasks, and their fixed split.

Pairs come from a task's embedded default, the user's table (`--data` CSV/TSV/JSONL/parquet
with `data.source_column` and `data.target_column`, or a hub dataset's train split when
online), or `synthetic` (for tests). The split is deduplicated on the source side: pairs are
grouped by their normalized source (lower case, single spaces), the first pair of each group is
kept, and the CRC-32 of the source puts it in train (90%), valid (5%) or test (5%), so that no
source is in two splits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from core.errors import UserError
from tasks.common import cache, splits, tables

log = logging.getLogger("apps")
# Percent of the sources in each split, by hash.
SHARES = {"train": 90, "valid": 5, "test": 5}


@cache.by_file
def read_pairs(spec: str, source_column: str, target_column: str) -> tuple[tuple[str, str], ...]:
    """(source, target) texts of a local table or a hub dataset's train split; rows missing
    either text are left out with a warning. Cached per process while the file is unchanged."""
    table, where = tables.read_table(spec)
    tables.require_columns(table, {"data.source_column": source_column, "data.target_column": target_column}, where)
    pairs = tuple(
        (source.strip(), target.strip())
        for source, target in zip(table[source_column], table[target_column])
        if isinstance(source, str) and isinstance(target, str) and source.strip() and target.strip()
    )
    if not pairs:
        raise UserError(f"{where} has no row with both a {source_column!r} and a {target_column!r} text.")
    if len(pairs) < len(table):
        log.warning(
            "%s: left out %d of %d rows with an empty or missing text.", where, len(table) - len(pairs), len(table)
        )
    return pairs


def synthetic_pairs(count: int = 600, seed: int = 0) -> list[tuple[str, str]]:
    """Deterministic pairs with structure to learn: the target spells the source's words
    backwards through a fixed word mapping ("red cat" -> "tac-x der-x")."""
    rng = np.random.default_rng(seed)
    words = "red blue cat dog runs sleeps big small house tree".split()
    pairs = []
    for _ in range(count):
        source = list(rng.choice(words, int(rng.integers(2, 6))))
        pairs.append((" ".join(source), " ".join(f"{word[::-1]}-x" for word in reversed(source))))
    return pairs


def normalized(text: str) -> str:
    """The form that identifies a source: lower case, single spaces."""
    return " ".join(text.lower().split())


def split_pairs(pairs: Sequence[tuple[str, str]], split: str, direction: str = "forward") -> list[dict]:
    """The examples of one split: the first pair of each normalized source, placed by its hash."""
    splits.check_split(split)
    if direction == "reverse":
        pairs = [(target, source) for source, target in pairs]
    seen, examples = set(), []
    for source, target in pairs:
        key = normalized(source)
        if key in seen:
            continue
        seen.add(key)
        if splits.hash_split(key, SHARES) == split:
            examples.append({"source": source, "target": target})
    return examples
