"""The command line's terminal: rows written for people or for programs (`--format`,
`--output`), a user's mistake as one message, the lines of stdin, the tasks' log on stderr.

A table is a title and its rows, each row a dict of column -> a typed value (text, int, float, a
list). `table` prints rich tables and rounds floats for people; `json`, `jsonl` and `csv` write
every value as it is, numbers at full precision, so that a program reads what Python returns.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from core.errors import LostPeer, UserError

FORMATS = ("table", "json", "jsonl", "csv")


def check_format(form: str, formats: Mapping[str, Callable] = {}) -> None:  # noqa: B006
    """`--format`: one of `FORMATS` or of a task's own `formats`, checked before any work."""
    if form not in FORMATS and form not in formats:
        raise UserError(f"--format {form!r}: expected one of {', '.join([*FORMATS, *formats])}.")


def console() -> Console:
    return Console(highlight=False)


def write(
    tables: dict[str, list[dict]],
    form: str,
    output: Path | None = None,
    document=None,
    formats: Mapping[str, Callable[[dict], str]] = {},  # noqa: B006
) -> None:
    """Writes `tables` (title: rows) to stdout or `output`: as rich tables whose cells fold
    rather than cut; as one JSON document (`document` if given, else the rows, or title: rows for
    several tables); as JSON lines; as CSV; or in a task's own format (`formats`: a document a
    row, `documents`). Rows of several tables carry their title in a `table` field (JSON lines, CSV)."""
    check_format(form, formats)
    if form in formats:
        documents([row for rows in tables.values() for row in rows], form, formats[form], output)
        return
    several = len(tables) > 1
    rows = [{"table": title, **row} if several else row for title, rows in tables.items() for row in rows]
    text = io.StringIO()
    if form == "table":
        _print_tables(tables, console() if output is None else Console(file=text, highlight=False, width=160))
    elif form == "json":
        whole = document if document is not None else dict(tables) if several else rows
        text.write(json.dumps(whole, ensure_ascii=False, indent=2, default=_plain) + "\n")
    elif form == "jsonl":
        text.writelines(json.dumps(row, ensure_ascii=False, default=_plain) + "\n" for row in rows)
    else:
        writer = csv.DictWriter(text, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows({key: _csv_cell(value) for key, value in row.items()} for row in rows)
    if output is None:
        sys.stdout.write(text.getvalue())  # empty for tables, printed by the console
        sys.stdout.flush()
        return
    _write_text(output, text.getvalue())


def documents(rows: list[dict], form: str, write: Callable[[dict], str], output: Path | None) -> None:
    """A document per row, `write(row)`: one row to stdout or the file `output`; several (or an
    `output` that is a folder) each into that folder, named after its row's `file` (a.wav ->
    a.srt) or its number."""
    if output is None or (len(rows) == 1 and not output.is_dir()):
        text = write(rows[0]) if rows else ""
        if output is None:
            sys.stdout.write(text)
            return
        return _write_text(output, text)
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output}: {len(rows)} documents go into a folder, and this is a file.")
    names: set[str] = set()
    for number, row in enumerate(rows, 1):
        stem = Path(str(row.get("file", number))).stem
        name = next(
            n for n in (f"{stem}.{form}", *(f"{stem}-{k}.{form}" for k in range(2, len(rows) + 2))) if n not in names
        )
        names.add(name)
        _write_text(output / name, write(row))


def _write_text(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        raise UserError(f"--output {path}: cannot be written ({error.strerror or error}).") from None
    print(f"Wrote {path}.", file=sys.stderr)


def _print_tables(tables: dict[str, list[dict]], printer: Console) -> None:
    for title, rows in tables.items():
        table = Table(title=title)
        for column in dict.fromkeys(key for row in rows for key in row):
            table.add_column(column, overflow="fold")
        for row in rows:
            table.add_row(*(cell(value) for value in row.values()))
        printer.print(table)


def cell(value) -> str:
    """A value as a table shows it to people: floats to 4 decimals, lists joined by commas, a
    list of records a line per record."""
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, list | tuple):
        if value and all(isinstance(item, dict) for item in value):  # records (a transcript's segments): a line each
            return "\n".join(" ".join(cell(v) for v in item.values()) for item in value)
        return ", ".join(cell(item) for item in value)
    return "" if value is None else str(value)


def _csv_cell(value) -> str:
    """A value in a CSV cell, in full: a float as Python's shortest exact repr, a list or a dict
    as JSON."""
    if isinstance(value, list | tuple | dict):
        return json.dumps(value, ensure_ascii=False, default=_plain)
    return "" if value is None else str(value)


def _plain(value):
    """A numpy scalar or array (from a task of the user's own) as the Python value JSON takes."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not a value a row can hold")


def metric_rows(metrics: dict, columns: dict | None = None) -> list[dict]:
    """One row a metric: the model's value beside other columns (decodings, baselines) of
    metrics; only float values are metrics."""
    cells = {"model": metrics, **(columns or {})}
    names = [key for values in cells.values() for key, value in values.items() if isinstance(value, float)]
    return [
        {"metric": key, **{column: values.get(key) for column, values in cells.items()}} for key in dict.fromkeys(names)
    ]


def user_errors(command):
    """A command that prints a UserError (or a device out-of-memory error,
    `core.training.memory.explain`) as a message and exits 1, without a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except UserError as error:
            _fail(error)
        except Exception as error:
            from core.training import memory

            explained = memory.explain(error)  # a device out of memory: the figures and the knobs
            if explained is None:
                raise
            _fail(explained)

    return wrapper


def _fail(error: UserError):
    typer.secho(f"Error: {error}", fg=typer.colors.RED, err=True)
    if isinstance(error, LostPeer):
        # Skips JAX's exit handler, which would wait for the lost process and then abort.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    raise typer.Exit(1) from None


def stdin_lines() -> list[str]:
    """The lines of stdin, each checked to be UTF-8."""
    lines = []
    for number, raw in enumerate(sys.stdin.buffer.read().splitlines(), start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"stdin line {number} is not valid UTF-8.") from None
    return lines


def show_task_log() -> None:
    """Tasks report counts (rows dropped, items skipped) on the "apps" logger: show them plainly."""
    logger = logging.getLogger("apps")
    if not logger.handlers:
        logger.addHandler(_StderrHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False


class _StderrHandler(logging.Handler):
    """Writes to whatever `sys.stderr` is at the time (test runners swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def split_options(arguments: list[str], switches: set[str] = frozenset()) -> tuple[list[str], dict[str, str]]:
    """Positional inputs, and `--flag value` / `--flag=value` pairs for the task to read; a
    switch (`--chat`) stands alone."""
    lines, options, index = [], {}, 0
    while index < len(arguments):
        argument = arguments[index]
        if argument.startswith("--") and len(argument) > 2:
            flag, sep, value = argument.partition("=")
            if not sep and flag in switches:
                value = "true"
            elif not sep:
                if index + 1 == len(arguments):
                    raise UserError(f"{flag} needs a value.")
                index, value = index + 1, arguments[index + 1]
            options[flag] = value
        else:
            lines.append(argument)
        index += 1
    return lines, options


def print_metrics(title: str, metrics: dict, columns=None, form="table", output=None, document=None) -> None:
    """A table of the model's metrics beside other columns (decodings, baselines), one row a
    metric, in `--format` (`document` is the JSON one)."""
    write({title: metric_rows(metrics, columns)}, form, output, document)
