"""Attention on AMX's tiles (`core.model.kernels.flash_tiles`, kernels/cpu/flash.h): its output and the
gradients of q, k and v against the blockwise kernel's under bfloat16 products, and against
float64 arithmetic on the same bfloat16 inputs, over causal, windowed, padded, packed, grouped
and cross attention; where it replaces the blockwise kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.model import attention as attention_module
from core.model.kernels import flash_tiles as flash
from core.model.kernels import native
from core.model.kernels import tiles as native_products
from core.model.precision import products_in

needs_tiles = pytest.mark.skipif(not native.tiles_ready(), reason="this CPU has no AMX tiles (or no C++ compiler)")

# (B, T, S, N, K, H, causal, window, packed, padded): T queries, S keys, N query heads over K key heads.
CASES = [
    (2, 64, 64, 4, 2, 32, True, None, False, False),
    (2, 100, 100, 6, 2, 64, True, None, False, True),
    (2, 100, 100, 6, 3, 64, False, None, False, True),
    (1, 80, 48, 2, 1, 64, False, None, False, False),  # cross-attention: other keys than queries
    (2, 130, 130, 4, 2, 64, True, 40, False, False),
    (2, 96, 96, 4, 4, 32, True, None, True, True),
    (1, 33, 33, 2, 1, 96, True, None, False, False),
]


def _inputs(B, T, S, N, K, H, packed, padded):
    keys = jax.random.split(jax.random.PRNGKey(T + S + H), 4)
    q, g = (jax.random.normal(key, (B, T, N, H)) for key in (keys[0], keys[3]))
    k, v = (jax.random.normal(key, (B, S, K, H)) for key in keys[1:3])
    mask = jnp.ones((B, S), bool).at[0, S - 7 :].set(not padded)
    segments = jnp.broadcast_to((jnp.arange(T) >= T // 3).astype(jnp.int32) + 1, (B, T)) if packed else None
    return q, k, v, g, mask, segments


def _gradients(kernel, q, k, v, g, mask, causal, window, segments):
    """The output and the gradients of q, k, v of sum(output * g), with bfloat16 products."""

    def loss(q, k, v):
        with products_in("bfloat16"):
            y = kernel(q, k, v, mask, causal, window, segments)
        return (y * g).sum(), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return y, *grads


@needs_tiles
@pytest.mark.parametrize("case", CASES)
def test_the_tiles_give_the_blockwise_kernels_attention_and_gradients(case):
    """Both round the same operands to bfloat16 and sum in float32; a probability or a score's
    gradient may round to a neighbouring bfloat16 (the tiles recompute the probabilities from the
    log-sum-exp), one part in 256 of it."""
    B, T, S, N, K, H, causal, window, packed, padded = case
    q, k, v, g, mask, segments = _inputs(B, T, S, N, K, H, packed, padded)
    tiles = _gradients(flash.attention, q, k, v, g, mask, causal, window, segments)
    blockwise = _gradients(attention_module.blockwise_attention, q, k, v, g, mask, causal, window, segments)
    for name, got, want, tolerance in zip(("out", "dq", "dk", "dv"), tiles, blockwise, (1e-3, 4e-3, 4e-3, 6e-3)):
        got, want = np.asarray(got), np.asarray(want)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=tolerance * np.abs(want).max(), rtol=0, err_msg=name)


def _reference(q, k, v, mask, causal, window, segments):
    """Attention in float64 numpy over the bfloat16 values of q, k and v."""
    q, k, v = (np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    seen = np.broadcast_to(np.asarray(mask)[:, None, None, :], scores.shape).copy()
    behind = np.arange(T)[:, None] - np.arange(S)[None, :]
    if causal:
        seen &= (behind >= 0) & (behind < (window or T + 1))
    if segments is not None:
        seen &= (np.asarray(segments)[:, :, None] == np.asarray(segments)[:, None, :])[:, None]
    scores = np.where(seen, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bnts,bsnh->btnh", weights / weights.sum(-1, keepdims=True), v)


@needs_tiles
@pytest.mark.parametrize("case", CASES[1:6:2])
def test_the_tiles_attend_as_float64_arithmetic_does(case):
    """Against exact softmax weights of the bfloat16 inputs: off only by the weights' rounding
    to bfloat16 before the values' product, within 1/256 of the largest value."""
    B, T, S, N, K, H, causal, window, packed, padded = case
    q, k, v, _, mask, segments = _inputs(B, T, S, N, K, H, packed, padded)
    with products_in("bfloat16"):
        got = jax.jit(flash.attention, static_argnums=(4, 5))(q, k, v, mask, causal, window, segments)
    want = _reference(q, k, v, mask, causal, window, segments)
    np.testing.assert_allclose(np.asarray(got), want, atol=np.abs(want).max() / 256, rtol=0)


@needs_tiles
def test_a_query_that_sees_no_key_gives_zeros_and_no_gradient():
    q, k, v, g, mask, _ = _inputs(2, 40, 40, 2, 1, 32, False, False)
    mask = mask.at[1].set(False)  # row 1: every key is padding
    y, dq, dk, dv = _gradients(flash.attention, q, k, v, g, mask, True, None, None)
    for x in (y, dq, dk, dv):
        assert np.all(np.asarray(x)[1] == 0) and np.all(np.isfinite(np.asarray(x)))
    assert np.abs(np.asarray(y)[0]).max() > 0


@needs_tiles
def test_the_blockwise_kernel_hands_bfloat16_attention_to_the_tiles_in_a_process_of_one_device(monkeypatch):
    q, k, v, _, mask, _ = _inputs(1, 64, 64, 2, 1, 64, False, False)

    def layer(q, k, v, dtype):
        with products_in(dtype):
            return attention_module.attention(q, k, v, mask, causal=True, implementation="blockwise").sum()

    def lowered(dtype):
        return jax.jit(jax.grad(lambda q, k, v: layer(q, k, v, dtype))).lower(q, k, v).as_text()

    assert "apps_flash" not in lowered("bfloat16")  # the suite's eight devices: XLA's kernel, split across them
    monkeypatch.setattr(native_products, "here", lambda: True)
    text = lowered("bfloat16")
    assert "apps_flash_forward" in text and "apps_flash_backward" in text
    assert "apps_flash" not in lowered("float32")
    assert not flash.usable(
        jnp.ones((1, 8, 2, 48), jnp.float32), k, True, jnp.bfloat16
    )  # a head width the tiles do not take
