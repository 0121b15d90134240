"""Reading the user's tables: CSV, TSV, JSON lines, JSON and parquet files through HF
`datasets`, or a hub dataset by name when the machine is online.

One rule for every task: a `--data` that has a table suffix or exists on disk is a file, and
anything else a hub name; of a hub dataset, a task that splits the data itself reads the train
split, and a dataset without one is an error that lists its splits. Every problem is a
`UserError` that names the file, and the line where one can be named (bad UTF-8, a malformed
JSON line).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from core.errors import UserError

log = logging.getLogger("apps")

FORMATS = {".csv": "csv", ".tsv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TABLE_FILES = "a .csv, .tsv, .jsonl or .parquet file"


def is_table_file(spec: str) -> bool:
    """Whether `--data spec` is read as a local file rather than a hub name."""
    path = Path(spec)
    return path.suffix.lower() in FORMATS or path.exists()


def read_table(spec: str, local: str = TABLE_FILES):
    """(table, where): a local file, or a hub dataset's train split; `where` names it in errors
    and `local` says what the caller accepts instead of a hub name."""
    if is_table_file(spec):
        return read_file(Path(spec)), str(spec)
    where = f"hub dataset {spec!r}"
    return train_split(read_hub(spec, local), where), where


def train_split(splits, where: str):
    """The train split of a hub dataset's splits."""
    if "train" not in splits:
        raise UserError(f"{where} has no train split; its splits are {', '.join(splits)}.")
    return splits["train"]


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
    if kind == "parquet":
        _check_parquet(path)
    else:
        _check_text_file(path)
    options = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    datasets.disable_progress_bars()
    quiet = logging.getLogger("datasets")
    level, quiet.level = quiet.level, logging.CRITICAL  # its own ERROR lines, before ours says the same
    try:
        table = datasets.load_dataset(kind, data_files=str(path), split="train", **options)
    except Exception as error:  # datasets wraps parser errors in several types: say the innermost
        raise UserError(f"--data {path}: could not be read as {kind}: {_innermost(error)}") from None
    finally:
        quiet.level = level
    if len(table) == 0:
        raise UserError(f"--data {path} has no rows.")
    return table


def _innermost(error: BaseException) -> str:
    """The message of the error at the bottom of `error`'s chain of causes."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _check_parquet(path: Path) -> None:
    """A parquet file's footer read first, so that a file that is none says so in one line."""
    import pyarrow.parquet as parquet

    try:
        rows = parquet.ParquetFile(path).metadata.num_rows
    except Exception as error:  # pyarrow's ArrowInvalid, OSError for a truncated file
        raise UserError(f"--data {path}: not a readable parquet file ({error}).") from None
    if rows == 0:
        raise UserError(f"--data {path} has no rows.")


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
    """Names the first non-UTF-8 or (for JSON lines) malformed line in the error, and a file
    with no rows: empty, or (CSV, TSV) a header line alone."""
    text = read_text(path)
    lines = [line for line in text.split("\n") if line.strip()]
    if not lines:
        raise UserError(f"--data {path} is empty: no header and no rows.")
    if path.suffix.lower() in (".csv", ".tsv") and len(lines) == 1:
        raise UserError(f"--data {path} has a header line and no rows.")
    if path.suffix.lower() != ".jsonl":
        return
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"--data {path}, line {number}: not valid JSON ({error.msg}).") from None


def read_hub(name: str, local: str = TABLE_FILES):
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


def labelled_rows(labels, where: str, column: str) -> list[int]:
    """The rows of `labels` (a table's label column) that hold a label, in order. A missing one
    (empty, or NaN as pandas and CSV readers write an empty number) leaves its row out with one
    warning that counts them; an infinite number is no label and is refused with its row."""
    kept, missing = [], []
    for row, label in enumerate(labels):
        if isinstance(label, float) and math.isinf(label):
            raise UserError(
                f"{where} row {row + 1}: the label {label} in column {column!r} is not a class or a rating."
            )
        if label is None or (isinstance(label, float) and math.isnan(label)) or str(label).strip() == "":
            missing.append(row + 1)
        else:
            kept.append(row)
    if missing:
        log.warning(
            "%s: %d of %d rows have no label in column %r (the first: row %d); they are left out.",
            where,
            len(missing),
            len(missing) + len(kept),
            column,
            missing[0],
        )
    return kept
