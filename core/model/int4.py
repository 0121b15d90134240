"""Four-bit decoding weights: a linear layer's kernel in groups of 32 inputs, each group's
weights as integers 0-15 with a float16 scale and offset (w = q * scale + offset, the layout of
llama.cpp's Q4_1, which llama-server serves SmolLM2 in), two to a byte.

A decoding step reads every weight once, and its time follows those bytes: SmolLM2's linear
layers read 106 MB a token in int8, 66 MB in four bits (0.625 bytes a weight with the group's
scale and offset; 80 MB with float32 ones). XLA has no product that reads four-bit weights in
place, so the few rows of a decoding step go through our CPU kernel (the seam's
`core.model.kernels.int4_rows`: one to three rows summed in integers, the activations in two
int8 parts a group; blocks of four rows with the weights widened to float32 in registers); more
rows (a prompt) dequantize the matrix to bfloat16 and multiply through XLA. Where our kernel does
not run the seam refuses int4 weights (`core.model.kernels.check_weights`). The token table
stays int8 (`core.model.quantized`), as the GGUF's is Q8_0. A scale per 32 inputs follows the
weights closer than int8's one per output: SmolLM2's logits move less than with int8
(core/README.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from core.model import kernels

GROUP = 32
_LEVELS = 15.0
_FLOAT16_MAX = float(jnp.finfo(jnp.float16).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4:
    """A kernel [I, O] in four bits, stored one row per output: `values` [O, I/2] uint8 (byte k
    of group g: weight 32g + k in its low four bits, 32g + 16 + k in its high four), `scales`
    and `offsets` [O, I/32] float32."""

    values: jax.Array
    scales: jax.Array
    offsets: jax.Array

    def __getitem__(self, key):
        """[...] (an nnx variable read whole): itself."""
        if key is not Ellipsis:
            raise TypeError("A four-bit kernel is read whole ([...]) or multiplied.")
        return self

    def rows(self) -> jax.Array:
        """The dequantized matrix one row per output, [O, I] float32."""
        outputs = self.values.shape[0]
        packed = self.values.reshape(outputs, -1, GROUP // 2)  # [O, groups, 16]
        q = jnp.concatenate([packed & 15, packed >> 4], axis=-1)  # weights 32g + k, then 32g + 16 + k
        scales, offsets = self.scales.astype(jnp.float32), self.offsets.astype(jnp.float32)
        weights = q.astype(jnp.float32) * scales[..., None] + offsets[..., None]
        return weights.reshape(outputs, -1)

    def astype(self, dtype) -> jax.Array:
        """The kernel [I, O] in `dtype`, dequantized."""
        return self.rows().T.astype(dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[1] * 2, self.values.shape[0])

    @property
    def dtype(self):
        return self.values.dtype


def fits(kernel: jax.Array) -> bool:
    """Whether a kernel [I, O] (concrete: a checkpoint's) divides into groups of `GROUP` inputs
    and its weights lie within float16's range, where its scales and offsets are kept."""
    return kernel.ndim == 2 and kernel.shape[0] % GROUP == 0 and float(jnp.abs(kernel).max()) <= _FLOAT16_MAX


def _float16(values: jax.Array, direction: float) -> jax.Array:
    """float32 values -> the nearest float16 ones on the side of `direction` (-inf: at most each
    value, inf: at least)."""
    rounded = values.astype(jnp.float16)
    wrong_side = rounded.astype(jnp.float32) > values if direction < 0 else rounded.astype(jnp.float32) < values
    return jnp.where(wrong_side, jnp.nextafter(rounded, jnp.asarray(direction, jnp.float16)), rounded)


def quantize(kernel: jax.Array) -> Int4:
    """A kernel [I, O] (I a multiple of `GROUP`) -> four bits a weight: each group of 32 inputs
    of an output spans from its offset (its minimum rounded down to float16) in 15 steps of its
    scale (rounded up to float16, so that the 15 reach its maximum), every weight within half a
    step. Weights beyond float16's range (65,504) do not fit (`fits`)."""
    rows = jnp.asarray(kernel, jnp.float32).T
    outputs, inputs = rows.shape
    groups = rows.reshape(outputs, inputs // GROUP, GROUP)
    low = _float16(groups.min(-1), -jnp.inf)
    scales = _float16(jnp.maximum(groups.max(-1) - low.astype(jnp.float32), 1e-7) / _LEVELS, jnp.inf)
    steps = (groups - low[..., None].astype(jnp.float32)) / scales[..., None].astype(jnp.float32)
    q = jnp.clip(jnp.round(steps), 0, _LEVELS).astype(jnp.uint8)
    packed = q[..., : GROUP // 2] | q[..., GROUP // 2 :] << 4
    return Int4(packed.reshape(outputs, inputs // 2), scales, low)


def product(x: jax.Array, weight: Int4) -> jax.Array:
    """x [..., I] @ the kernel -> [..., O] in x's dtype: a few rows through our kernel where the
    seam runs it (`core.model.kernels.int4_rows_here`), more through the matrix dequantized to
    bfloat16."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    if kernels.int4_rows_here(rows.shape[0]):
        y = kernels.int4_rows(rows, weight.values, weight.scales, weight.offsets)
    else:
        matrix = weight.rows().astype(jnp.bfloat16)
        y = jax.lax.dot_general(
            rows.astype(jnp.bfloat16), matrix, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
    return y.reshape(*lead, -1).astype(x.dtype)
