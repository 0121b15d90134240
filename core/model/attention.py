"""Self-attention kernels: `jax.nn.dot_product_attention`, a blockwise form for CPUs, or the
kernels of the seam (`core.model.kernels`: AMX tiles on a CPU, splash attention on a TPU).

`implementation` (`model.attention`) selects:

- "auto": what the seam chose (`core.model.kernels.attention_kernel`);
- "xla" / "cudnn": `jax.nn.dot_product_attention` (cuDNN's fused flash kernel on NVIDIA GPUs,
  which needs bf16 or fp16 inputs and takes padding as sequence lengths; the config requires
  bf16 compute with it; it has not yet run on a GPU in this project's tests);
- "blockwise": queries in up to four blocks, each attending only to the keys it can see, with a
  hand-written backward pass that reuses the saved probabilities. Causal attention then skips
  the masked upper blocks (about 3/8 of the work at four blocks), and the backward is one fused
  elementwise pass instead of autodiff through the masked softmax: on a 2-core CPU, half the
  time of the XLA path. With bfloat16 products on a CPU with AMX, the seam's tiles compute the
  same;
- "splash": Pallas's splash attention (`core.model.kernels.splash`), XLA's where it cannot run.

Shapes: q [B, T, N, H]; k, v [B, T, K, H] with K key/value heads, each shared by G = N / K query
heads (grouped-query attention; K = N is plain multi-head attention); mask [B, T] true at real
keys; output [B, T, N, H]. The blockwise kernel stacks the G query heads of each key head as
rows of one [B, K, G * T, H] operand instead of repeating the keys G times; with G = 1 that is
the plain multi-head program, unchanged. XLA's kernel groups the heads natively.

Packed rows (several examples in one row, `segments` [B, T]: each position's example, 1, 2, ...)
attend within their own example only: a query sees the keys of its segment.

A causal layer with a `window` W (sliding-window attention) lets query i see keys i - W + 1 .. i
only; the blockwise kernel masks the rest, XLA's takes it as `local_window_size`.

Cross-attention (`cross=True`) takes queries [B, T, N, H] from one sequence and keys and values
[B, S, K, H] from another, the mask [B, S] covering the keys only.

`cached_attention` serves decoding: a few new queries per row against a key/value cache;
`memory_attention` the same queries against an encoder's keys and values, computed once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from core.model import kernels
from core.model.cache import KeyValues, held
from core.model.precision import einsum_product, narrower, transposed

# Large but finite, so that a row with no visible key gives a uniform row instead of NaNs.
MASKED = -1e30
# A cache of S slots is read in the shortest of S, S / 2, ... S / 2**SPAN_HALVINGS (no shorter than
# SPAN_MIN) that holds every row's positions (`cached_attention`).
SPAN_HALVINGS, SPAN_MIN = 3, 64
MIN_BLOCK = 64
MAX_BLOCKS = 4


def attention(
    q, k, v, mask, *, causal: bool, implementation: str, cross: bool = False, window: int | None = None, segments=None
):
    dtype = narrower(q.dtype)
    implementation = kernels.attention_kernel(q, k, causal, dtype, implementation)
    if implementation == "tiles":
        return kernels.tiles_attention(q, k, v, mask, causal, window, segments)
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, mask, causal, window, segments)
    if implementation == "splash":
        return kernels.splash_attention(
            q, k, v, mask, causal=causal, dtype=dtype, window=window, segments=segments, cross=cross
        )
    arguments = library_arguments(mask, causal, implementation, cross)
    if segments is not None:
        if implementation == "cudnn":
            raise ValueError("Packed rows (segments) need the xla or blockwise attention kernel.")
        arguments["mask"] = arguments["mask"] & (segments[:, :, None] == segments[:, None, :])[:, None]
    if window is not None:
        arguments["local_window_size"] = (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, **arguments)


def library_arguments(mask, causal: bool, implementation: str, cross: bool = False) -> dict:
    """Keyword arguments for `jax.nn.dot_product_attention` that express the padding `mask`.

    XLA takes the mask itself, broadcast over heads and queries. cuDNN's flash kernel takes no
    dense mask (JAX turns one into a bias whose layout that kernel rejects): it takes each row's
    number of real keys, which says the same thing because the suite pads on the right. In
    self-attention the queries have the keys' lengths; in cross-attention the mask says nothing
    about the queries, so all of them run (JAX's default).
    """
    arguments = {"is_causal": causal, "implementation": implementation}
    if implementation == "cudnn":
        lengths = mask.sum(-1, dtype=jnp.int32)
        if cross:
            return {**arguments, "key_value_seq_lengths": lengths}
        return {**arguments, "query_seq_lengths": lengths, "key_value_seq_lengths": lengths}
    return {**arguments, "mask": mask[:, None, None, :]}


def _blocks(length: int, causal: bool) -> list[tuple[int, int]]:
    """Query blocks [start, stop); one block unless causal attention can skip keys."""
    if not causal:
        return [(0, length)]
    size = max(MIN_BLOCK, -(-length // MAX_BLOCKS))
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def _probabilities(q, k, mask, start: int, stop: int, causal: bool, window: int | None = None, segments=None):
    """Softmax over keys [0, S) of q [B, K, G * Tq, H], the queries at positions [start, stop) of
    the G heads that share each key head, stacked: [B, K, G * Tq, S] in float32."""
    scores = einsum_product("BKTH,BKSH->BKTS", q, k) * q.shape[-1] ** -0.5
    visible = mask[:, None, None, : k.shape[2]]
    if segments is not None:
        same = segments[:, start:stop, None] == segments[:, None, : k.shape[2]]  # [B, Tq, S]
        visible = visible & jnp.tile(same, (1, q.shape[2] // (stop - start), 1))[:, None]
    if causal:
        offsets = jnp.arange(stop - start)[:, None] + start - jnp.arange(k.shape[2])[None, :]  # [Tq, S]: i - j
        rows = (offsets >= 0) if window is None else (offsets >= 0) & (offsets < window)
        groups = q.shape[2] // (stop - start)
        visible = visible & jnp.tile(rows, (groups, 1))[None, None]
    scores = jnp.where(visible, scores, MASKED)
    scores = jnp.exp(scores - scores.max(-1, keepdims=True))
    return scores / scores.sum(-1, keepdims=True)


def _heads_first(*arrays):
    """[B, T, N, H] -> [B, N, T, H], once per layer: blocks then slice whole rows of memory."""
    return [x.transpose(0, 2, 1, 3) for x in arrays]


def _stacked(block, key_value_heads: int):
    """Query heads [B, N, Tq, H] -> [B, K, G * Tq, H]: the G heads of each key head as rows."""
    B, N, T, H = block.shape
    return block.reshape(B, key_value_heads, N // key_value_heads * T, H)


def _unstacked(block, query_heads: int):
    """[B, K, G * Tq, H] -> [B, N, Tq, H], undoing `_stacked`."""
    B, K, rows, H = block.shape
    return block.reshape(B, query_heads, rows * K // query_heads, H)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def blockwise_attention(q, k, v, mask, causal: bool, window: int | None = None, segments=None):
    return _forward(q, k, v, mask, causal, window, segments)[0]


def _operands(*arrays):
    """Heads first (`_heads_first`) in the dtype the products run in (`narrower`): every use of q,
    k, v and the output's gradient is a product, so they are converted once per layer, and saved
    so (half the memory in bfloat16). Through `transposed`: XLA:CPU folded the plain transpose
    into the products that read a whole operand (the last causal block's keys), whose layout
    YNNPACK then refused, so it multiplied them in float32. For SmolLM2's fine-tuning step this
    took 60 MB off the peak (7.34 -> 7.28 GB) and no time that six steps could tell apart."""
    return [transposed(x.astype(narrower(x.dtype)), narrower(x.dtype), (0, 2, 1, 3)) for x in arrays]


def _forward(q, k, v, mask, causal, window=None, segments=None):
    qt, kt, vt = _operands(q, k, v)
    heads = kt.shape[1]
    outputs, probabilities = [], []
    for start, stop in _blocks(q.shape[1], causal):
        keys = stop if causal else k.shape[1]
        p = _probabilities(
            _stacked(qt[:, :, start:stop], heads), kt[:, :, :keys], mask, start, stop, causal, window, segments
        )
        probabilities.append(p)
        block = einsum_product("BKTS,BKSH->BKTH", p.astype(vt.dtype), vt[:, :, :keys]).astype(v.dtype)
        outputs.append(_unstacked(block, qt.shape[1]))
    output = jnp.concatenate(outputs, axis=2).transpose(0, 2, 1, 3)
    return output, (qt, kt, vt, mask, segments, probabilities)


def _backward(causal, window, residuals, grad_out):
    qt, kt, vt, mask, segments, probabilities = residuals
    (gt,) = _operands(grad_out)
    dtype, heads = grad_out.dtype, kt.shape[1]
    scale = qt.shape[-1] ** -0.5
    grad_q, grad_k, grad_v = [], jnp.zeros(kt.shape, jnp.float32), jnp.zeros(vt.shape, jnp.float32)
    for (start, stop), p in zip(_blocks(qt.shape[2], causal), probabilities):
        keys = stop if causal else kt.shape[2]
        g = _stacked(gt[:, :, start:stop], heads)
        # Contracting over the stacked rows sums the gradients of the G heads that share a key.
        grad_v = grad_v.at[:, :, :keys].add(einsum_product("BKTS,BKTH->BKSH", p.astype(g.dtype), g))
        grad_p = einsum_product("BKTH,BKSH->BKTS", g, vt[:, :, :keys])
        # Softmax backward: dS = P * (dP - rowsum(dP * P)), folded with the 1/sqrt(H) scale.
        grad_s = (p * (grad_p - (grad_p * p).sum(-1, keepdims=True)) * scale).astype(qt.dtype)
        grad_q.append(_unstacked(einsum_product("BKTS,BKSH->BKTH", grad_s, kt[:, :, :keys]).astype(dtype), qt.shape[1]))
        queries = _stacked(qt[:, :, start:stop], heads)
        grad_k = grad_k.at[:, :, :keys].add(einsum_product("BKTS,BKTH->BKSH", grad_s, queries))
    grad_q = jnp.concatenate(grad_q, axis=2)
    grad_q, grad_k, grad_v = _heads_first(grad_q, grad_k.astype(dtype), grad_v.astype(dtype))
    return grad_q, grad_k, grad_v, None, None


blockwise_attention.defvjp(_forward, _backward)


def cached_attention(q, k, v, cache: KeyValues, lengths, window: int | None = None):
    """New queries q [B, T, N, H], with their own keys and values k, v [B, T, K, H], that follow
    the `lengths` [B] positions each row holds in a `cache` of keys [B', K, S, H] and values
    [B', K, H, S] (B' >= B: the queries are its B rows from `cache.first`, a slot engine's step
    over a few of its slots or its fill of one): each query sees the positions the row's cache
    holds (`core.model.cache.held`) and the new keys up to its own (with a `window` W, those
    less than W positions behind it). Slots that hold no position of the row yet (stale, or
    zeros) stay out of sight, so that rows of different lengths share one fixed-shape program.
    -> [B, T, N, H].

    One grouped softmax whatever the configured implementation: with a few queries against the
    cache, the work is reading the cache once, which no flash kernel shortens. But it reads only
    the slots in use: until some row's positions pass S / 8, S / 4 or S / 2, the slots past that
    hold nothing any row can see, and a branch of the program (`jax.lax.switch`) attends over
    the leading ones alone. (Sixteen rows of SmolLM2 at 512 slots read 377 MB of float32 cache a
    step; their requests, a few dozen to a few hundred tokens long, seldom fill half of it.)
    With our kernels (the seam's "native", on the CPU), one query a row (a decoding step) goes
    through our kernel instead (`core.model.kernels.cached_rows`), which reads each row's own
    slots alone.
    """
    if kernels.cached_rows_here(q, cache.keys.dtype):
        first = 0 if cache.first is None else cache.first
        y = kernels.cached_rows(q[:, 0], k[:, 0], v[:, 0], cache.keys, cache.values, first, lengths, window)
        return y[:, None].astype(q.dtype)
    S = cache.keys.shape[2]
    halves = [S // 2**i for i in range(SPAN_HALVINGS, 0, -1) if S % 2**i == 0 and S // 2**i >= SPAN_MIN]
    spans = [*halves, S]
    attend = functools.partial(_attend, q, k, v, cache, lengths, window)
    if len(spans) == 1:
        return attend(S)
    needed = jnp.max(jnp.minimum(lengths, S))  # the slots in use: [0, length) until a ring wraps
    return jax.lax.switch(jnp.sum(jnp.asarray(spans) < needed), [functools.partial(attend, span) for span in spans])


def _attend(q, k, v, cache: KeyValues, lengths, window: int | None, span: int):
    """`cached_attention` over the cache's first `span` slots alone, which hold every position
    that any row holds. U indexes the new keys, S the cache slots."""
    B, T, N, H = q.shape
    cached_keys, cached_values, _ = cache.rows(B)
    cached_keys, cached_values = cached_keys[:, :, :span], cached_values[..., :span]
    K, S = k.shape[2], span
    grouped = q.reshape(B, T, K, N // K, H)
    old = jnp.einsum("BTKGH,BKSH->BKGTS", grouped, cached_keys, preferred_element_type=jnp.float32)
    new = jnp.einsum("BTKGH,BUKH->BKGTU", grouped, k, preferred_element_type=jnp.float32)
    scores = jnp.concatenate([old, new], axis=-1) * H**-0.5  # [B, K, G, T, S + U]
    # [B, S]: a ring's slots hold the window's latest positions; the span holds every one in use.
    positions = held(lengths, cache.keys.shape[2])[:, :span]
    cached = jnp.broadcast_to((positions >= 0)[:, None, :], (B, T, S))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool))[None], (B, T, T))
    if window is not None:
        # Query t of row b stands at position lengths[b] + t.
        behind = (lengths[:, None, None] + jnp.arange(T)[None, :, None]) - positions[:, None, :]
        cached = cached & (behind < window)
        causal = causal & (jnp.arange(T)[:, None] - jnp.arange(T)[None, :] < window)[None]
    visible = jnp.concatenate([cached, causal], axis=-1)  # [B, T, S + U]
    scores = jnp.where(visible[:, None, None], scores, MASKED)
    probabilities = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    y = jnp.einsum("BKGTS,BKHS->BTKGH", probabilities[..., :S], cached_values)
    y = y + jnp.einsum("BKGTU,BUKH->BTKGH", probabilities[..., S:], v)
    return y.reshape(B, T, N, H)


def memory_attention(q, keys, values, mask):
    """Queries q [B, T, N, H] over an encoder's keys [B, K, S, H] and values [B, K, H, S], laid
    out as a decoding cache is (see `core.model.cache.KeyValues`), mask [B, S] true at real
    positions -> [B, T, N, H]. The decoding form of cross-attention: a grouped softmax that reads
    the keys and values as they lie, as `cached_attention` reads its cache."""
    return memory_weighted(memory_probabilities(q, keys, mask), values)


def memory_probabilities(q, keys, mask):
    """The attention probabilities [B, K, G, T, S] of `memory_attention` (G query heads per key
    head: query head n is (n // G, n % G)), float32."""
    B, T, N, H = q.shape
    K = keys.shape[1]
    grouped = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BKSH->BKGTS", grouped, keys, preferred_element_type=jnp.float32) * H**-0.5
    scores = jnp.where(mask[:, None, None, None, :], scores, MASKED)
    return jax.nn.softmax(scores, axis=-1)


def memory_weighted(probabilities, values):
    """`memory_probabilities` [B, K, G, T, S] over values [B, K, H, S] -> [B, T, N, H]."""
    B, K, G, T, _ = probabilities.shape
    y = jnp.einsum("BKGTS,BKHS->BTKGH", probabilities.astype(values.dtype), values)
    return y.reshape(B, T, K * G, -1)
