"""Int8 decoding weights: a linear layer's kernel, or a tied output's table, as int8 values with
one float32 scale per output, multiplied by XLA's int8 product.

On XLA:CPU an int8 x int8 -> int32 product of two or more rows runs at 1.5-2.5x the speed of a
float32 one over the same weights, a quarter of their bytes (SmolLM2's layer shapes, 2 to 28
rows), where int8 weights converted to float32 inside the program are written out whole before
a float32 product (5.7x slower). The activations are therefore quantized too, each row in two
int8 parts: a row scaled to [-127, 127] and rounded, then its rounding error scaled by 127 and
rounded again; the product of both parts, summed with the second over 127, keeps each row to
about 1/16,000 of its largest value (one part alone moved SmolLM2's logits by up to 7.5). Error
then comes from the weights' 8 bits alone: on
SmolLM2 over the first 190 tokens of this project's README, logits within 1.7 of float32's
(mean 0.18), the same argmax at 95% of positions, cross-entropy 5.133 against 5.112 nats (on 190
tokens of tasks/nlp/README.md 4.224 against 4.234); bfloat16 weights: within 0.47 (mean 0.04),
98%, 5.109. The token table gives most of the cross-entropy's rise: the linear layers alone
in int8 give 5.118 (logits within 1.58). A single row is multiplied as its two parts, which also spares it XLA's one-row
product (8x slower).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from core.model import int4

_LEVELS = 127.0
# From this many rows on, a product widens the int8 values to bfloat16 instead (`product`).
WIDENED_ROWS = 256


class LinearKernel(nnx.Param):
    """The weight of the core's linear layers (`core.model.layers.Dense`), which int8 decoding
    quantizes (`core.model.precision.narrowed`); Flax's own layers (a classifier's output, a
    convolution) keep float kernels."""


class TokenTable(nnx.Param):
    """A token embedding table [V, D] (which a tied output multiplies by too), that int8
    decoding quantizes per row: per vocabulary id, the tied output's columns."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A matrix as int8 `values` [O, I], one row per output, and float32 `scales` [O, 1]: a token
    table [V, D] as it is, a linear layer's kernel [I, O] transposed (`transposed`), so that
    every product reads each output's weights in one contiguous row.
    values * scales is the table, its transpose the kernel (`astype`)."""

    values: jax.Array
    scales: jax.Array
    transposed: bool = dataclasses.field(default=False, metadata={"static": True})

    def __getitem__(self, key):
        """[...] (an nnx variable read whole): itself; a table's rows (a shortlist of ids): those
        rows, still int8."""
        if key is Ellipsis:
            return self
        if self.transposed:
            raise TypeError("A quantized kernel is read whole ([...]) or multiplied; only a table's rows are taken.")
        return Quantized(self.values[key], self.scales[key])

    def astype(self, dtype) -> jax.Array:
        """The matrix in `dtype`, dequantized: for readers other than `product` and `take`."""
        matrix = self.values.astype(jnp.float32) * self.scales
        return (matrix.T if self.transposed else matrix).astype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape[::-1] if self.transposed else self.values.shape

    @property
    def dtype(self):
        return self.values.dtype


# Decoding weights that `product` multiplies (`core.model.precision.matmul` sends them here).
WEIGHTS = (Quantized, int4.Int4)


def quantize(matrix: jax.Array, axis: int) -> Quantized:
    """matrix -> its int8 values and float32 scales, one per output, symmetric, from the absolute
    maximum: `axis` 0 for a kernel [I, O] (a scale per column, stored transposed), 1 for a table
    [V, D] (a scale per row)."""
    matrix = jnp.asarray(matrix, jnp.float32)
    rows = matrix.T if axis == 0 else matrix
    scales = jnp.maximum(jnp.abs(rows).max(axis=1, keepdims=True), 1e-30) / _LEVELS
    return Quantized(jnp.round(rows / scales).astype(jnp.int8), scales, transposed=axis == 0)


def quantized(variable: nnx.Variable, dtype: str = "int8") -> nnx.Variable:
    """An nnx variable of the decoding weights in `dtype` where int8 or int4 decoding takes it:
    a linear kernel (`LinearKernel`) in int8, or with "int4" in four bits where it fits
    (`core.model.int4.fits`: its inputs divide into groups, its weights within float16's range);
    the token table (`TokenTable`) in int8; anything else as
    it is."""
    if isinstance(variable, LinearKernel):
        if dtype == "int4" and int4.fits(variable[...]):
            return variable.replace(int4.quantize(variable[...]))
        return variable.replace(quantize(variable[...], 0))
    if isinstance(variable, TokenTable):
        return variable.replace(quantize(variable[...], 1))
    return variable


def product(x: jax.Array, weight: Quantized | int4.Int4) -> jax.Array:
    """x [..., I] times the matrix of `weight` -> [..., O] in x's dtype: x @ kernel, or x @
    table.T (a tied output's logits), through XLA's int8 x int8 -> int32 product: each row of x
    in two int8 parts (see the module's docstring); from `WIDENED_ROWS` rows on, in bfloat16
    with float32 sums. A four-bit kernel multiplies through `core.model.int4.product`."""
    if isinstance(weight, int4.Int4):
        return int4.product(x, weight)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    count = rows.shape[0]
    contracted = (((1,), (1,)), ((), ()))
    if count >= WIDENED_ROWS:
        # Many rows (a long prompt, an audio encoder's frames): the int8 product is compute-bound
        # there and falls behind a bfloat16 one through YNNPACK (SmolLM2's MLP shape at 3,000
        # rows: 50 against 27 ms; 512 rows: 3.2 against 2.3), which the int8 values convert to
        # exactly. Activations then round to bfloat16, as with bfloat16 weights.
        y = jax.lax.dot_general(
            rows.astype(jnp.bfloat16),
            weight.values.astype(jnp.bfloat16),
            contracted,
            preferred_element_type=jnp.float32,
        )
        y = y * weight.scales.reshape(1, -1)
    else:
        row_scales = jnp.maximum(jnp.abs(rows).max(axis=-1, keepdims=True), 1e-30) / _LEVELS
        scaled = rows / row_scales
        high = jnp.round(scaled)
        low = jnp.round((scaled - high) * _LEVELS)
        parts = jnp.concatenate([high, low]).astype(jnp.int8)
        sums = jax.lax.dot_general(parts, weight.values, contracted, preferred_element_type=jnp.int32)
        sums = sums.astype(jnp.float32)
        y = (sums[:count] + sums[count:] / _LEVELS) * row_scales * weight.scales.reshape(1, -1)
    return y.reshape(*lead, -1).astype(x.dtype)


def take(table: jax.Array | Quantized, ids: jax.Array) -> jax.Array:
    """The rows `ids` of a token table [V, D], int8 or not: [*ids.shape, D] in the table's
    dtype, float32 for an int8 one."""
    if isinstance(table, Quantized):
        return jnp.take(table.values, ids, axis=0).astype(jnp.float32) * jnp.take(table.scales, ids, axis=0)
    return jnp.take(table, ids, axis=0)
