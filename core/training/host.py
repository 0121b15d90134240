"""Host memory allocator settings that make repeated XLA:CPU executions cheap.

Each execution of a compiled step allocates one temporary arena for all its intermediate
buffers (2.4 GB for the "big" benchmark) and frees it at the end. glibc serves a block that
large with a fresh `mmap`, and gives it back with `munmap`, so every step the kernel zero-fills
and faults in every page again: 600,000 page faults and several CPU-seconds of system time per
step on a 2-core machine, about a fifth of the step. XLA's worker threads allocate from their
own malloc arenas, which fall back to `mmap` for such blocks whatever the mmap threshold.

`keep_freed_memory` makes every thread allocate from the main heap, never through `mmap`,
and keeps freed memory instead of trimming it, so the second step reuses the pages of the first.
The price is that the process keeps its peak heap size until it exits, which is what a training
or serving process does anyway, and not what a library should impose on the program that imports
it. So it is applied where the suite owns the process: the `apps` CLI, before JAX starts, and
`core.run.train`. It works fully only before JAX starts its thread pools (arenas already handed
to threads stay theirs): a Python program that wants the whole gain calls it first thing.
`APPS_KEEP_FREED_MEMORY=0` turns it off. Elsewhere than glibc it does nothing.

Kept or given back, the pages the kernel faults in are 4 KB ones unless malloc asks for huge
pages (2 MB) where the kernel grants them on request (`/sys/kernel/mm/transparent_hugepage/enabled`
at "madvise", the common default): glibc does so with the tunable `glibc.malloc.hugetlb=1`, read
only when a process starts, so `tune_process` restarts the `apps` program with it (before any
import of JAX). A step's arena then costs 512 times fewer faults and its big arrays fewer TLB
misses (core/README.md gives the figures). `APPS_HUGE_PAGES=0` turns it off; another program sets
the tunable itself (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python ...`).

Both are settings for XLA:CPU, whose steps allocate on the host: a process that runs on an
accelerator (`accelerator_present`) keeps glibc's own.

A heap that never shrinks suits a run whose arenas are a small part of the machine; a large
run's kept heap grows in fragments to several times its peak (Gemma 3's fine-tuning past 24 GB).
`give_back_freed_memory` restores glibc's mapping and trimming for the rest of the process:
`core.run.train` calls it when a run's estimate is over an eighth of the memory available (the
estimates run low by up to half, and the kept heap grows to twice a run's real peak and on).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

# mallopt parameters from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# glibc's defaults for the two that `give_back_freed_memory` restores.
DEFAULT_MMAP_MAX = 65536
DEFAULT_TRIM_THRESHOLD = 128 * 1024

HUGE_PAGES = "glibc.malloc.hugetlb=1"
TRANSPARENT_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_kept = False  # whether keep_freed_memory took effect (and was not given back since)


@functools.cache
def _libc():
    """glibc with `mallopt` typed, or None elsewhere; looked up once a process (`find_library`
    runs `ldconfig -p`, and `tune_process` asks before `keep_freed_memory` does)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return None
    return libc


def accelerator_present(environment: Mapping[str, str] = os.environ, dev: Path = Path("/dev")) -> bool:
    """Whether this process will run on an accelerator, told before JAX starts: the first of
    `JAX_PLATFORMS` where it is set, else a TPU's or an NVIDIA GPU's device files."""
    platforms = environment.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() not in ("cpu", "")
    tpu = any(dev.glob("accel[0-9]*")) or any((dev / "vfio").glob("[0-9]*"))
    return tpu or (dev / "nvidia0").exists()


def keep_freed_memory() -> bool:
    """Tune glibc malloc as described above; True when the settings took effect."""
    global _kept
    off = os.environ.get("APPS_KEEP_FREED_MEMORY", "1") == "0" or accelerator_present()
    libc = None if off else _libc()
    if libc is None:
        return False
    # mallopt takes an int and glibc converts it to size_t: -1 is an unlimited trim threshold.
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))
    _kept = all(libc.mallopt(param, value) == 1 for param, value in settings)
    return _kept


def give_back_freed_memory() -> bool:
    """Undo `keep_freed_memory` (but its single arena) from here on: large blocks are mapped
    afresh and unmapped when freed, and the heap's free pages go back to the system now. True
    when there was something to undo."""
    global _kept
    libc = _libc() if _kept else None
    if libc is None:
        return False
    settings = ((M_MMAP_MAX, DEFAULT_MMAP_MAX), (M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD))
    _kept = not all(libc.mallopt(param, value) == 1 for param, value in settings)
    libc.malloc_trim(0)
    return not _kept


def tune_process() -> None:
    """What the `apps` CLI does first: restart with huge pages (only where this process is the
    `apps` program: tests that call the CLI in their own process keep theirs), then keep freed
    memory."""
    if accelerator_present():
        return
    if Path(sys.argv[0]).name == "apps" and _libc() is not None:
        environment = huge_pages_environment(os.environ, _transparent_huge_pages())
        if environment is not None:
            try:
                os.execve(sys.executable, sys.orig_argv, environment)
            except OSError:  # an interpreter that cannot be run again: go on with small pages
                pass
    keep_freed_memory()


def huge_pages_environment(environment: Mapping[str, str], transparent: str | None) -> dict[str, str] | None:
    """`environment` with glibc's huge-pages tunable added, or None where restarting would
    change nothing: turned off (`APPS_HUGE_PAGES=0`), the tunable already set (as after the
    restart), or the kernel's transparent huge pages `transparent` other than "madvise" ("always"
    needs no asking, "never" grants none)."""
    tunables = environment.get("GLIBC_TUNABLES", "")
    if environment.get("APPS_HUGE_PAGES", "1") == "0" or "glibc.malloc.hugetlb" in tunables or transparent != "madvise":
        return None
    return {**environment, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES}


def _transparent_huge_pages() -> str | None:
    """The kernel's transparent huge pages setting ("always", "madvise", "never"), or None."""
    try:
        chosen = re.search(r"\[(\w+)\]", TRANSPARENT_HUGE_PAGES.read_text())
    except OSError:
        return None
    return chosen and chosen.group(1)
