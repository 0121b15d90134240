"""Kernels of our own for XLA:CPU: the C++ files of `cpu/` compiled for this machine on
first use into one library, whose handlers are registered as XLA FFI targets (`jax.ffi`).

- `int4_rows` multiplies a few float32 rows by four-bit weights stored one row per output, the
  product of a decoding step (`core.model.int4.product`, through the seam `core.model.kernels`);
- `cached_rows` attends one new query per row over its key/value cache, reading only the slots
  each row holds (`core.model.attention.cached_attention`);
- `tile_columns` and `tile_product` multiply in bfloat16 with float32 sums on AMX tiles, the
  large products of a training step on CPUs that have them (`core.model.kernels.tiles`;
  `tiles_ready()`);
- `flash_forward` and `flash_backward` attend on the same tiles, the attention of a training
  step (`core.model.kernels.flash_tiles`).

The library is built once per source, jaxlib, compiler and CPU (`-march=native`) into the cache
folder (~/.cache/apps/kernels), where concurrent processes each rename a whole file into place.
Where it cannot be built (no C++ compiler, a CPU without AVX2 and FMA, not the CPU backend),
`available()` is False, the reason is logged once, and XLA alone computes both (slower: int4
weights widen first, and attention reads the longest row's span of every row).
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
import numpy as np

from core.paths import cache_folder

KERNELS = Path(__file__).with_name("cpu")
# XLA's name: the handler
TARGETS = {
    "apps_int4_rows": "Int4Rows",
    "apps_cached_rows": "CachedAttention",
    "apps_tile_columns": "TileColumns",
    "apps_tile_product": "TileProduct",
    "apps_flash_forward": "FlashForward",
    "apps_flash_backward": "FlashBackward",
}
log = logging.getLogger("apps")


def _cpu() -> str:
    """The CPU's feature flags, which `-march=native` compiles for."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def compiler_flags(cpu: str = "native") -> list[str]:
    """The flags `built` compiles the kernels with, for this machine's CPU or another (`-march`)."""
    return ["-O3", f"-march={cpu}", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}"]


def built() -> Path:
    """The shared library of `KERNELS` for this machine, compiled if the cache lacks it."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise OSError("no C++ compiler found (install g++, or set CXX)")
    flags = compiler_flags()
    files = sorted(KERNELS.glob("*.[ch]*"))
    sources = [str(path) for path in files if path.suffix == ".cc"]
    key = "\0".join([*(path.read_text() for path in files), jaxlib.__version__, compiler, *flags, _cpu()])
    library = cache_folder() / "kernels" / f"native-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        made = Path(scratch) / library.name
        done = subprocess.run([compiler, *flags, *sources, "-o", str(made)], capture_output=True, text=True)
        if done.returncode:
            raise OSError(f"{compiler} could not build {KERNELS}: {done.stderr.strip()[-600:]}")
        os.replace(made, library)
    return library


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Our kernels' library, built and its handlers registered (once a process), else None with
    the reason logged."""
    if jax.default_backend() != "cpu":
        return None
    try:
        library = ctypes.cdll.LoadLibrary(str(built()))
    except OSError as error:
        log.warning("int4 products, cached attention and AMX products go through XLA alone: %s", error)
        return None
    for target, handler in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, handler)), platform="cpu")
    return library


def available() -> bool:
    """Whether our kernels run here: built and registered, else False with the reason logged."""
    return _library() is not None


@functools.cache
def tiles_ready() -> bool:
    """Whether `tile_product` runs here: our kernels built for a CPU with AMX's bfloat16 tiles,
    which Linux lets this process use (it asks once, `apps_tiles_ready`)."""
    library = _library()
    return library is not None and bool(library.apps_tiles_ready())


def int4_rows(x: jax.Array, values: jax.Array, scales: jax.Array, offsets: jax.Array) -> jax.Array:
    """x [R, I] float32 times four-bit weights [O, I] -> [R, O] float32: the weights as
    `core.model.int4.Int4` holds them (values [O, I/2] uint8, two to a byte; scales and offsets
    [O, I/32] float16). Rows in blocks of four: the weights widened to float32, float32 sums; the
    one to three left: each group of 32 inputs in two int8 parts (within 1/32,258 of its largest
    magnitude), integer sums (cpu/int4_rows.cc). Only where `available()`."""
    out = jax.ShapeDtypeStruct((x.shape[0], values.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call("apps_int4_rows", out, vmap_method="sequential")
    return call(x.astype(jnp.float32), values, scales.astype(jnp.float16), offsets.astype(jnp.float16))


def cached_rows(q, k, v, keys, values, first, lengths, window: int | None) -> jax.Array:
    """One query per row q [B, N, H] with its new key and value k, v [B, K, H], over rows
    `first` .. `first` + B - 1 of a cache of keys [B', K, S, H] and values [B', K, H, S] (float32
    or bfloat16), which hold `lengths` [B] positions -> [B, N, H] float32: the attention of
    `core.model.attention.cached_attention` for one new position a row. Only where `available()`."""
    f32 = jnp.float32
    call = jax.ffi.ffi_call("apps_cached_rows", jax.ShapeDtypeStruct(q.shape, f32), vmap_method="sequential")
    rows = jnp.asarray(first, jnp.int32)
    return call(
        q.astype(f32),
        k.astype(f32),
        v.astype(f32),
        keys,
        values,
        rows,
        lengths.astype(jnp.int32),
        window=np.int64(window or 0),
    )


def _whole(n: int) -> int:
    return -(-n // 32) * 32


def tile_columns(b: jax.Array, transposed: bool = False) -> jax.Array:
    """b [..., K, N] (float32 or bfloat16; each matrix stored [N, K] when `transposed`) -> its
    bfloat16 panels for `tile_product`, [..., N/32, K/2, 64] with K and N rounded up to 32: each
    panel 32 columns, each row of it a pair of b's rows side by side, as AMX's TDPBF16PS reads
    them (cpu/bf16_tiles.cc). Only where `tiles_ready()`."""
    *stack, depth, columns = b.shape
    if transposed:
        depth, columns = columns, depth
    out = jax.ShapeDtypeStruct((*stack, _whole(columns) // 32, _whole(depth) // 2, 64), jnp.bfloat16)
    return jax.ffi.ffi_call("apps_tile_columns", out, vmap_method="sequential")(b, transposed=np.bool_(transposed))


def tile_product(a: jax.Array, panels: jax.Array, columns: int, transposed: bool = False) -> jax.Array:
    """a [..., M, K] (float32 or bfloat16; each matrix stored [K, M] when `transposed`) times
    the b [..., K, N = `columns`] of `panels` (`tile_columns`), matrix by matrix -> [..., M, N]
    float32: each operand rounded to bfloat16 as XLA rounds it, each product exact, the sums in
    float32 on AMX tiles. The second result is the kernel's copy of a in whole tiles, a buffer
    XLA allocates for the call. Only where `tiles_ready()`."""
    *stack, rows, depth = a.shape
    if transposed:
        rows, depth = depth, rows
    out = (
        jax.ShapeDtypeStruct((*stack, rows, columns), jnp.float32),
        jax.ShapeDtypeStruct((*stack, _whole(rows), _whole(depth)), jnp.bfloat16),
    )
    call = jax.ffi.ffi_call("apps_tile_product", out, vmap_method="sequential")
    return call(a, panels, transposed=np.bool_(transposed))[0]


def flash_forward(q, k, v, mask, query_segments, key_segments, causal: bool, window: int | None):
    """q [B, Tq, N, H], k, v [B, Tk, K, H] (bfloat16, H a multiple of 32), mask [B, Tk] (uint8,
    nonzero at real keys), segments [B, Tq] and [B, Tk] (int32) -> (out [B, Tq, N, H], lse
    [B, N, Tq]) float32: each query's softmax over the keys it sees (`causal`, within `window`),
    the scores q . k / sqrt(H) and the values' weighting in bfloat16 with float32 sums, and its
    scores' log-sum-exp (-inf where it sees none; its output is then 0) (cpu/flash.h).
    Only where `tiles_ready()`."""
    B, T, N, H = q.shape
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((B, N, T), jnp.float32))
    call = jax.ffi.ffi_call("apps_flash_forward", out, vmap_method="sequential")
    return call(q, k, v, mask, query_segments, key_segments, causal=np.bool_(causal), window=np.int64(window or 0))


def flash_backward(q, k, v, mask, query_segments, key_segments, lse, grad, causal: bool, window: int | None):
    """The gradients (dq, dk, dv, float32) of `flash_forward`'s output with respect to q, k and
    v, given its `lse` and the output's gradient `grad` [B, Tq, N, H] (bfloat16). Only where
    `tiles_ready()`."""
    out = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    call = jax.ffi.ffi_call("apps_flash_backward", out, vmap_method="sequential")
    return call(
        q, k, v, mask, query_segments, key_segments, lse, grad, causal=np.bool_(causal), window=np.int64(window or 0)
    )
