"""A per-process cache of what was read from a user's file or folder, keyed by its stamp.

The splits of one run read the same `--data` several times (train, valid, test, baselines):
the file is parsed once. Its modification times and sizes are part of the key, so that a file
edited between two calls in one process is read again. Callers treat the cached values as
read-only (or copy them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any


def stamp(spec: str | Path | None) -> tuple | None:
    """(modification time, size) of a file, the same for each file below a folder, None for
    anything else (a hub name, the embedded default)."""
    if spec is None:
        return None
    path = Path(spec)
    if path.is_file():
        return (path.stat().st_mtime_ns, path.stat().st_size)
    if path.is_dir():
        files = sorted(file for file in path.rglob("*") if file.is_file())
        return tuple((str(file), file.stat().st_mtime_ns, file.stat().st_size) for file in files)
    return None


def by_file(read: Callable[..., Any]) -> Callable[..., Any]:
    """`read(spec, ...)`, cached per process while the file or folder `spec` is unchanged."""

    @functools.cache
    def cached(spec, file_stamp, *args, **kwargs):
        return read(spec, *args, **kwargs)

    @functools.wraps(read)
    def reader(spec, *args, **kwargs):
        return cached(spec, stamp(spec), *args, **kwargs)

    reader.cache_clear = cached.cache_clear
    return reader
