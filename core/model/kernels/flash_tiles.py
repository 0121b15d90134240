"""Attention of a training step on AMX's tiles (`core.model.kernels.native.flash_forward` and
`flash_backward`, cpu/flash.h): the blockwise kernel's attention
(`core.model.attention`), computed a block of 32 queries at a time with its scores kept in
cache, and its backward from each query's log-sum-exp instead of the saved probabilities.

`usable` says where it replaces the blockwise kernel: products in bfloat16 (`train.matmul_dtype`),
a process of one device on a CPU with the tiles (as for the layers' products,
`core.model.kernels.tiles`), and a head width that is a multiple of 32. The results are the
blockwise kernel's to float32 rounding: the same bfloat16 operands (the scores' and the
probabilities' products, the gradients'), float32 sums and softmax. A query that sees no key
(a row of padding alone) gives zeros here, a uniform average there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import core.model.kernels.native as native
import core.model.kernels.tiles as tiles


def usable(q: jax.Array, k: jax.Array, causal: bool, dtype) -> bool:
    """Whether `attention` runs these queries and keys [B, T, heads, H] with products in `dtype`."""
    same = not causal or q.shape[1] == k.shape[1]
    return q.shape[-1] % 32 == 0 and same and tiles.takes(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def attention(q, k, v, mask, causal: bool, window: int | None = None, segments=None):
    """`core.model.attention.blockwise_attention` on the tiles, where `usable`."""
    return _forward(q, k, v, mask, causal, window, segments)[0]


def _operands(q, k, v, mask, segments):
    """The kernel's operands: q, k, v in bfloat16, the mask as bytes, the segments of the
    queries and of the keys (all one segment without them)."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    if segments is None:
        query_segments, key_segments = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)
    else:
        query_segments = key_segments = segments.astype(jnp.int32)  # self-attention: one array for both
    narrow = (x.astype(jnp.bfloat16) for x in (q, k, v))
    return (*narrow, mask.astype(jnp.uint8), query_segments, key_segments)


def _forward(q, k, v, mask, causal, window, segments):
    operands = _operands(q, k, v, mask, segments)
    out, lse = native.flash_forward(*operands, causal, window)
    return out.astype(v.dtype), (operands, lse)


def _backward(causal, window, residuals, grad_out):
    operands, lse = residuals
    grads = native.flash_backward(*operands, lse, grad_out.astype(jnp.bfloat16), causal, window)
    return (*(g.astype(grad_out.dtype) for g in grads), None, None)


attention.defvjp(_forward, _backward)
