"""Sentiment's tables: the embedded reviews (`tasks.common.reviews`), the user's
CSV/TSV/JSONL/parquet files or a hub dataset (`tasks.common.tables`), or a small synthetic set;
and the fixed stratified split. A user's table is read once per process while it is unchanged
(`tasks.common.cache`); callers treat it as read-only.
"""

from __future__ import annotations

import logging

import numpy as np

from core.errors import UserError
from tasks.common import cache, splits, tables

log = logging.getLogger("apps")


def synthetic_reviews(count: int = 800, seed: int = 0) -> dict[str, list]:
    """Deterministic short reviews whose rating (1 or 5) follows their sentiment words.

    Learnable but not trivial: each review mixes neutral words with two to four cue words, and
    its rating follows the majority of positive over negative cues.
    """
    rng = np.random.default_rng(seed)
    positive = "lovely perfect flattering soft comfortable gorgeous great beautiful".split()
    negative = "cheap scratchy awful tight returned disappointing ugly thin".split()
    neutral = "the dress fabric color size top jeans fit sleeves shirt this was and it".split()
    texts, ratings = [], []
    for _ in range(count):
        cues = int(rng.integers(2, 5))
        good = int(rng.integers(0, cues + 1))
        if 2 * good == cues:
            good += 1
        words = list(rng.choice(neutral, int(rng.integers(4, 10))))
        words += list(rng.choice(positive, good)) + list(rng.choice(negative, max(cues - good, 0)))
        rng.shuffle(words)
        texts.append(" ".join(words))
        ratings.append(5 if good * 2 > cues else 1)
    return {"text": texts, "label": ratings}


@cache.by_file
def load_table(spec: str, text_column: str, label_column: str) -> dict[str, list]:
    """Columns `text_column` and `label_column` of a local file or a hub dataset's train split;
    rows without a label (`tables.labelled_rows`) or a text are left out with a warning."""
    table, where = tables.read_table(spec)
    tables.require_columns(table, {"data.text_column": text_column, "data.label_column": label_column}, where)
    texts, labels = table[text_column], table[label_column]
    labelled = tables.labelled_rows(labels, where, label_column)
    keep = [i for i in labelled if isinstance(texts[i], str) and texts[i].strip()]
    if len(keep) < len(labelled):
        log.warning(
            "%s: %d labelled rows have no text in column %r; they are left out.",
            where,
            len(labelled) - len(keep),
            text_column,
        )
    if not keep:
        raise UserError(f"{where} has no rows with a text and a label.")
    return {"text": [texts[i] for i in keep], "label": [labels[i] for i in keep]}


def split(columns: dict[str, list], split_name: str, train_fraction: float = 1.0) -> list[dict]:
    """The examples of one split of a table: `tasks.common.splits.stratified_split`."""
    rows = splits.stratified_split(columns["label"], split_name, train_fraction)
    return [{"text": columns["text"][i], "label": columns["label"][i]} for i in rows]
