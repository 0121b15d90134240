"""The kernel seam: how the network's heavy operations run, chosen once per process and backend.

`model.kernels` names the choice (`select`, called when a run's model is built; `chosen` reads it,
"auto" until then); the model, training and generation code ask the functions below and never
test the hardware themselves. One line says what was chosen (`Kernels.describe`): in training's
header, at the server's start and in the debug log.

| operation                          | native (CPU)                       | pallas (TPU)       | xla (anywhere)   |
|------------------------------------|------------------------------------|--------------------|------------------|
| bfloat16 products of a layer       | AMX tiles where the CPU has them   | XLA                | XLA              |
| attention of training and prefill  | AMX flash tiles, else blockwise    | splash attention   | XLA's dense one  |
| cached attention, one query a row  | our kernel (each row's slots)      | XLA                | XLA              |
| int4 weights                       | our kernel                         | refused            | refused          |
| a stack of identical layers        | unrolled                           | one scanned layer  | scanned          |
| XLA:CPU compiler options           | set                                | none               | none on TPU/GPU  |

"auto" is native on the CPU (xla where our kernels cannot be built, with the reason logged),
pallas on a TPU and xla elsewhere. "pallas" off a TPU runs Pallas's interpreter: slow, for tests
of the TPU's path on the CPU. A choice that cannot run here ("native" on a TPU) is refused, and so
are int4 weights wherever our int4 kernel does not run (`check_weights`): XLA would widen them to
bfloat16 at every step, slower than bfloat16 weights.

The layers are scanned where XLA compiles them (TPU, GPU, XLA forced): the compile time then does
not grow with depth. On the CPU they stay unrolled: our kernels' buffers and XLA:CPU's thread
pool schedule across layers, and the CPU's figures were measured so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from core.errors import UserError
from core.model.kernels import flash_tiles, native, splash, tiles

NAMES = ("auto", "xla", "native", "pallas")
# Products of fewer rows than this go through our int4 kernel (`core.model.int4`).
INT4_ROWS = 64
# XLA:CPU's copy insertion with region analysis: the generation programs' in-place cache updates
# stay in place across their loops instead of copying the cache.
CPU_COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}
log = logging.getLogger("apps")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """What `select` chose: `name` (native, pallas or xla) on `platform` (jax's backend)."""

    name: str
    platform: str

    @property
    def interpret(self) -> bool:
        """Whether Pallas kernels run in Pallas's interpreter (off the TPU)."""
        return self.name == "pallas" and self.platform != "tpu"

    @property
    def scan_layers(self) -> bool:
        """Whether a stack of identical layers compiles as one scanned layer."""
        return self.name != "native"

    def describe(self) -> str:
        attention = {"native": "AMX flash tiles or blockwise", "pallas": "splash", "xla": "XLA's"}[self.name]
        interpreted = " (Pallas interpreted: slow, for tests)" if self.interpret else ""
        layers = "scanned" if self.scan_layers else "unrolled"
        return f"kernels: {self.name} on {self.platform}{interpreted}; attention {attention}, layers {layers}"


def resolve(requested: str, platform: str, native_ready: bool = True) -> Kernels:
    """The kernels that `requested` (one of `NAMES`) gives on `platform`, or a UserError that
    says why it cannot run there. `native_ready`: whether our C++ kernels built here."""
    if requested not in NAMES:
        raise UserError(f"model.kernels={requested!r}: choose one of {', '.join(NAMES)}.")
    if requested == "auto":
        name = {"cpu": "native" if native_ready else "xla", "tpu": "pallas"}.get(platform, "xla")
        return Kernels(name, platform)
    if requested == "native" and platform != "cpu":
        raise UserError(
            f"model.kernels=native: our C++ kernels run on the CPU backend only, and this process runs on "
            f"{platform} (use auto, pallas or xla)."
        )
    if requested == "native" and not native_ready:
        raise UserError("model.kernels=native: our C++ kernels could not be built here (the log says why); use xla.")
    if requested == "pallas" and platform not in ("tpu", "cpu"):
        raise UserError(f"model.kernels=pallas: the Pallas kernels here are TPU kernels; on {platform} use xla.")
    return Kernels(requested, platform)


_chosen: Kernels | None = None


def select(requested: str = "auto") -> Kernels:
    """Choose the kernels for this process (`model.kernels`), logging the choice when it changes."""
    global _chosen
    platform = jax.default_backend()
    ready = requested in ("auto", "native") and platform == "cpu" and _native_ready()
    kernels = resolve(requested, platform, ready)
    if kernels != _chosen:
        log.debug(kernels.describe())  # training's header and the server's start say it to the user
        _chosen = kernels
    return kernels


def chosen() -> Kernels:
    """The kernels this process runs: `select`'s choice, "auto" where none was made."""
    return _chosen if _chosen is not None else select("auto")


@contextlib.contextmanager
def using(requested: str):
    """Within it, `requested` kernels; the earlier choice after. Programs traced within it keep
    them (a jitted function's cache does not see this choice: trace new functions within it)."""
    global _chosen
    before = _chosen
    try:
        yield select(requested)
    finally:
        _chosen = before


def _native_ready() -> bool:
    return native.available()


# Products.


def tiled(dtype, rows: int, depth: int, columns: int) -> bool:
    """Whether a product of rows x depth times depth x columns in `dtype` runs on AMX's tiles."""
    return chosen().name == "native" and tiles.tiled(dtype, rows, depth, columns)


def tiles_take(dtype) -> bool:
    """Whether products in `dtype` run on AMX's tiles here, whatever their shape."""
    return chosen().name == "native" and tiles.takes(dtype)


def cpu_layouts() -> bool:
    """Whether products compile for XLA:CPU, whose bfloat16 products want their operands laid
    out in order (`core.model.precision.transposed`)."""
    return chosen().platform == "cpu"


def fastest_products() -> str:
    """The products of `train.matmul_dtype=auto`: "bfloat16" where the hardware multiplies it
    (TPUs, GPUs; CPUs with AMX or AVX-512 BF16, which XLA:CPU uses), else "float32" (an AVX2 CPU
    emulates bfloat16 products through float32, slower than float32 itself)."""
    if chosen().platform != "cpu":
        return "bfloat16"
    return "bfloat16" if _cpu_flags() & {"amx_bf16", "avx512_bf16"} else "float32"


def default_products() -> str:
    """The products of `train.matmul_dtype`'s default: "bfloat16" on an accelerator, whose
    matrix units run it (float32 master weights and sums stay), "float32" on a CPU."""
    return "float32" if chosen().platform == "cpu" else "bfloat16"


@functools.cache
def _cpu_flags() -> set[str]:
    """The CPU's feature flags, as Linux lists them (none elsewhere: float32, the safe choice)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())
    except OSError:
        return set()


def compiler_options() -> dict:
    """Options for compiling a generation program on this process's backend: XLA:CPU's on the
    CPU, none elsewhere (read where a program is decorated, before any kernels are chosen)."""
    return dict(CPU_COMPILER_OPTIONS) if jax.default_backend() == "cpu" else {}


# Attention.


def attention_kernel(q: jax.Array, k: jax.Array, causal: bool, dtype, requested: str = "auto") -> str:
    """Which kernel attends q [B, T, N, H] over k [B, S, K, H] with products in `dtype`:
    "tiles" (AMX), "blockwise", "splash", "xla" or "cudnn". `requested` is `model.attention`:
    "auto" follows the seam; "blockwise" takes the tiles where they run."""
    kernels = chosen()
    if requested == "auto":
        requested = {"native": "blockwise", "pallas": "splash"}.get(kernels.name, "xla")
    if requested == "blockwise" and kernels.name == "native" and flash_tiles.usable(q, k, causal, dtype):
        return "tiles"
    if requested == "splash" and not splash.usable(q, k):
        return "xla"
    return requested


def tiles_attention(q, k, v, mask, causal, window, segments):
    """`core.model.attention.blockwise_attention` on AMX's tiles (`attention_kernel` "tiles")."""
    return flash_tiles.attention(q, k, v, mask, causal, window, segments)


def splash_attention(q, k, v, mask, *, causal: bool, dtype, window=None, segments=None, cross: bool = False):
    """Attention through Pallas's splash kernel (`attention_kernel` "splash")."""
    # Interpreted off a TPU, whichever kernels were chosen (`model.attention=splash` asks for it by name).
    return splash.attention(q, k, v, mask, causal, dtype, window, segments, cross, chosen().platform != "tpu")


def cached_rows_here(q: jax.Array, cache_dtype) -> bool:
    """Whether one new query a row attends over its cache through our kernel."""
    return (
        chosen().name == "native"
        and q.shape[1] == 1
        and jnp.dtype(cache_dtype) in (jnp.float32, jnp.bfloat16)
        and _native_ready()
    )


def cached_rows(q, k, v, keys, values, first, lengths, window):
    return native.cached_rows(q, k, v, keys, values, first, lengths, window)


# Quantized products.


def check_weights(dtype: str) -> None:
    """Refuse decoding weights in `dtype` where no kernel multiplies them fast."""
    if dtype == "int4" and chosen().name != "native":
        kernels = chosen()
        raise UserError(
            f"int4 weights multiply through our CPU kernel alone; with {kernels.name} kernels on "
            f"{kernels.platform} XLA would widen them at every step, slower than bfloat16 weights: "
            "use bfloat16 or int8 here."
        )


def int4_rows_here(rows: int) -> bool:
    """Whether a product of `rows` rows by int4 weights runs through our kernel."""
    return chosen().name == "native" and rows < INT4_ROWS and _native_ready()


def int4_rows(x, values, scales, offsets):
    return native.int4_rows(x, values, scales, offsets)


def tile_multiply(a, b, columns: int, a_transposed: bool, b_transposed: bool):
    return tiles.multiply(a, b, columns, a_transposed, b_transposed)


def tile_panels(b, transposed: bool = False):
    return tiles.panels(b, transposed)


def tile_multiply_panels(a, panels, columns: int, a_transposed: bool = False):
    return tiles.multiply_panels(a, panels, columns, a_transposed)


def stacked(spec: str):
    """For an einsum of two stacks of matrices, whether each operand is transposed (`tiles.stacked`)."""
    return tiles.stacked(spec)
