"""Kernels of our own for XLA:CPU: `native.cc` compiled for this machine on first use and
registered as an XLA FFI target (`jax.ffi`).

`int4_rows` multiplies a few float32 rows by four-bit weights stored one row per output, the
product of a decoding step (`core.model.int4.product`). It is built once per source,
jaxlib, compiler and CPU (`-march=native`) into the cache folder (~/.cache/apps/kernels), where
concurrent processes each rename a whole file into place. Where it cannot be built (no C++
compiler, a CPU without AVX2 and FMA, not the CPU backend), `available()` is False, the reason
is logged once, and int4 products go through XLA alone (slower: the weights widen first).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from core.paths import cache_folder

SOURCE = Path(__file__).with_suffix(".cc")
TARGET = "apps_int4_rows"
log = logging.getLogger("apps")


def _cpu() -> str:
    """The CPU's feature flags, which `-march=native` compiles for."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def built() -> Path:
    """The shared library of `SOURCE` for this machine, compiled if the cache lacks it."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise OSError("no C++ compiler found (install g++, or set CXX)")
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}"]
    key = "\0".join([SOURCE.read_text(), jaxlib.__version__, compiler, *flags, _cpu()])
    library = cache_folder() / "kernels" / f"native-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        made = Path(scratch) / library.name
        done = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(made)], capture_output=True, text=True)
        if done.returncode:
            raise OSError(f"{compiler} could not build {SOURCE.name}: {done.stderr.strip()[-600:]}")
        os.replace(made, library)
    return library


@functools.cache
def available() -> bool:
    """Whether `int4_rows` runs here: built and registered (once a process), else False with
    the reason logged."""
    if jax.default_backend() != "cpu":
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(built()))
    except OSError as error:
        log.warning("int4 products go through XLA alone: %s", error)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.Int4Rows), platform="cpu")
    return True


def int4_rows(x: jax.Array, values: jax.Array, scales: jax.Array, offsets: jax.Array) -> jax.Array:
    """x [R, I] float32 times four-bit weights [O, I] -> [R, O] float32, in float32 sums: the
    weights as `core.model.int4.Int4` holds them (values [O, I/2] uint8, two to a byte; scales
    and offsets [O, I/32]). Only where `available()`."""
    out = jax.ShapeDtypeStruct((x.shape[0], values.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(x.astype(jnp.float32), values, scales.astype(jnp.float32), offsets.astype(jnp.float32))
