"""The blockwise attention kernel equals `jax.nn.dot_product_attention`, values and gradients,
with grouped-query heads too; the cuDNN path gets lengths that mean the padding mask."""

import re

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.config import apply_overrides
from core.errors import UserError
from core.model.attention import _attend, attention, cached_attention, library_arguments
from core.model.cache import KeyValues
from core.model.kernels import native
from tasks.nlp.sentiment import tiny


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [40, 96, 300])
@pytest.mark.parametrize("heads,key_value_heads", [(3, 3), (6, 2), (4, 1)])
def test_blockwise_matches_xla(causal, length, heads, key_value_heads):
    rng = np.random.default_rng(length)
    q, cotangent = (jnp.asarray(rng.standard_normal((2, length, heads, 8), np.float32)) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, length, key_value_heads, 8), np.float32)) for _ in range(2))
    # The second sequence is padded after 70% of its length.
    mask = jnp.asarray(np.arange(length)[None, :] < np.array([[length], [int(length * 0.7)]]))

    def loss(implementation):
        def f(q, k, v):
            out = attention(q, k, v, mask, causal=causal, implementation=implementation)
            # Only real query rows count: padded rows are free to differ.
            return (out * cotangent * mask[:, :, None, None]).sum()

        return f

    for a, b in zip(
        jax.value_and_grad(loss("blockwise"), (0, 1, 2))(q, k, v),
        jax.value_and_grad(loss("xla"), (0, 1, 2))(q, k, v),
    ):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(x, y, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_in_bfloat16_gives_bfloat16_gradients_of_the_float32_form(causal):
    rng = np.random.default_rng(7)
    q, k, v, cotangent = (jnp.asarray(rng.standard_normal((2, 96, 2, 8), np.float32)) for _ in range(4))
    mask = jnp.ones((2, 96), bool)

    def loss(implementation):
        return lambda q, k, v: (
            attention(q, k, v, mask, causal=causal, implementation=implementation).astype(jnp.float32) * cotangent
        ).sum()

    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    for a, b in zip(jax.grad(loss("blockwise"), (0, 1, 2))(*low), jax.grad(loss("xla"), (0, 1, 2))(q, k, v)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=0.1, rtol=0.05)


def test_blockwise_with_bfloat16_products_multiplies_rounded_float32_operands():
    """Under `products_in("bfloat16")` (mixed precision) the blockwise kernel's six products take
    bfloat16 operands with float32 results; values and gradients stay float32 and follow the
    float32 kernel within bfloat16 rounding, and differ from it."""
    from core.model.precision import products_in

    rng = np.random.default_rng(8)
    q, k, v, cotangent = (jnp.asarray(rng.standard_normal((2, 96, 2, 8), np.float32)) for _ in range(4))
    mask = jnp.ones((2, 96), bool)

    def loss(q, k, v):
        return (attention(q, k, v, mask, causal=True, implementation="blockwise") * cotangent).sum()

    step = jax.value_and_grad(loss, (0, 1, 2))
    exact = step(q, k, v)
    with products_in("bfloat16"):
        mixed = jax.jit(step)(q, k, v)
        program = jax.jit(step).lower(q, k, v).as_text()
    dots = re.findall(r"dot_general.*: \((tensor<[^)]*)\) -> (tensor<[^>]*>)", program)
    assert len(dots) == 6 * 2  # two forward and four backward products in each query block (two of 64)
    assert all(operands.count("bf16") == 2 and "f32" in result for operands, result in dots)
    for a, b in zip(jax.tree.leaves(mixed), jax.tree.leaves(exact)):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, atol=0.05, rtol=0.05)
        assert not np.allclose(a, b, atol=1e-6, rtol=1e-6)


def test_blockwise_products_stay_bfloat16_where_xla_compiles_them():
    """XLA:CPU folded the heads-first transpose into the products that read whole keys (the last
    causal block's), whose layout YNNPACK refused, and multiplied them in float32: the kernel
    copies its operands in order (`core.model.precision.transposed`). Of each block's six
    products, the two that contract over query rows (the keys' and values' gradients) are the
    ones XLA still widens, whatever the layout."""
    from core.model.precision import products_in

    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 256, h, 16)), jnp.float32) for h in (4, 2, 2))
    mask = jnp.ones((2, 256), bool)

    def loss(q, k, v):
        return (attention(q, k, v, mask, causal=True, implementation="blockwise") ** 2).sum()

    with products_in("bfloat16"):
        dots = helpers.compiled_dot_operands(jax.value_and_grad(loss, (0, 1, 2)), q, k, v)
    assert len(dots) == 6 * 4  # four query blocks of 64
    assert dots.count(("bf16", "bf16")) == 4 * 4


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_arguments_are_lengths_that_mean_the_mask(causal):
    # The cuDNN kernel only runs on NVIDIA GPUs; its arguments are built the same way everywhere.
    # Lengths, not a dense mask (which JAX would turn into a bias that cuDNN rejects) ...
    mask = jnp.asarray(np.arange(12)[None, :] < np.array([[12], [5]]))
    arguments = library_arguments(mask, causal, "cudnn")
    assert "mask" not in arguments and "bias" not in arguments
    np.testing.assert_array_equal(arguments["key_value_seq_lengths"], [12, 5])
    assert arguments["implementation"] == "cudnn" and arguments["is_causal"] == causal
    # ... and the lengths say what the mask says: XLA given either gives the same real rows.
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 12, 2, 8), np.float32)) for _ in range(3))
    with_lengths = jax.nn.dot_product_attention(q, k, v, **{**arguments, "implementation": "xla"})
    with_mask = jax.nn.dot_product_attention(q, k, v, **library_arguments(mask, causal, "xla"))
    real = np.asarray(mask)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, with_lengths, 0), np.where(real, with_mask, 0), atol=1e-5)


def test_cudnn_needs_bfloat16_compute():
    with pytest.raises(UserError, match="model.attention='cudnn' needs train.compute_dtype"):
        apply_overrides(tiny(), ["model.attention=cudnn"])
    config = apply_overrides(tiny(), ["model.attention=cudnn", "train.compute_dtype=bfloat16"])
    assert config.model.attention == "cudnn"


@pytest.mark.parametrize("implementation", ["blockwise", "xla"])
def test_a_sliding_window_sees_the_last_w_positions(implementation):
    """Both kernels against the softmax written out with the window's mask (values and
    gradients): query i sees keys i - 2 .. i, across the blockwise kernel's blocks."""
    rng = np.random.default_rng(3)
    length, window = 150, 3
    q, cotangent = (jnp.asarray(rng.standard_normal((2, length, 4, 8), np.float32)) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, length, 2, 8), np.float32)) for _ in range(2))
    mask = jnp.asarray(np.arange(length)[None, :] < np.array([[length], [100]]))
    offsets = np.arange(length)[:, None] - np.arange(length)[None, :]
    allowed = jnp.asarray((offsets >= 0) & (offsets < window))[None, None] & mask[:, None, None, :]

    def reference(q, k, v):
        keys, values = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, keys) / np.sqrt(8)
        probabilities = jax.nn.softmax(jnp.where(allowed, scores, -1e30), axis=-1)
        return jnp.einsum("BNTS,BSNH->BTNH", probabilities, values)

    def loss(f):
        return lambda q, k, v: (f(q, k, v) * cotangent * mask[:, :, None, None]).sum()

    kernel = lambda q, k, v: attention(q, k, v, mask, causal=True, implementation=implementation, window=window)  # noqa: E731
    for a, b in zip(
        jax.value_and_grad(loss(kernel), (0, 1, 2))(q, k, v), jax.value_and_grad(loss(reference), (0, 1, 2))(q, k, v)
    ):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(x, y, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "lengths,window,slots",
    [
        ([3, 5], None, 512),
        ([3, 70, 200], None, 512),
        ([0, 64, 65], None, 512),
        ([3, 511], None, 512),
        ([40, 300, 700], 256, 256),
        ([10, 100], 256, 256),
    ],
)
def test_cached_attention_reads_the_slots_in_use_and_gives_what_reading_all_gives(lengths, window, slots, monkeypatch):
    """Through XLA (without our kernel), a decode step reads the shortest leading span of the
    cache (S/8 .. S) that holds every row's positions: the same outputs as the whole cache, for
    rows of very different lengths, at a span's edge, and for a sliding window's ring once it
    has wrapped (700 > 256 slots)."""
    monkeypatch.setattr(native, "available", lambda: False)

    rng = np.random.default_rng(len(lengths) + slots)
    B, T, N, K, H = len(lengths), 1, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32) for _ in range(2))
    cache = KeyValues(
        *(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((B, K, slots, H), (B, K, H, slots)))
    )
    lengths = jnp.asarray(lengths)
    got = jax.jit(cached_attention, static_argnums=5)(q, k, v, cache, lengths, window)
    whole = _attend(q, k, v, cache, lengths, window, slots)
    np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not native.available(), reason="no C++ compiler, or a CPU without AVX2 and FMA")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "lengths,window,slots,size",
    [
        ([0, 1, 17, 300, 511], None, 512, 64),  # none held, one, a vector and a tail, nearly full
        ([3, 70, 200], None, 256, 8),  # heads narrower than a vector
        ([40, 300, 700], 256, 256, 64),  # a sliding window's ring, wrapped
        ([5, 260, 1000], 100, 128, 16),  # a window shorter than the ring: older slots out of sight
    ],
)
def test_our_kernel_attends_each_row_over_its_own_slots_as_xla_over_the_whole_cache(
    lengths, window, slots, size, dtype
):
    """One query a row goes through our kernel on the CPU, which reads each row's slots alone
    (rows `first` on of a larger cache, as a slot engine's step over some of its rows): what
    XLA gives reading every slot of the cache, float32 or bfloat16 (widened as XLA widens it),
    three query heads to each key head."""
    rng = np.random.default_rng(slots + size)
    B, N, K, first = len(lengths), 6, 2, 1
    q = jnp.asarray(rng.standard_normal((B, 1, N, size)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, 1, K, size)), jnp.float32) for _ in range(2))
    shapes = (B + 2, K, slots, size), (B + 2, K, size, slots)
    cache = KeyValues(*(jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes), jnp.int32(first))
    lengths = jnp.asarray(lengths, jnp.int32)
    got = jax.jit(cached_attention, static_argnums=5)(q, k, v, cache, lengths, window)
    widened = KeyValues(cache.keys.astype(jnp.float32), cache.values.astype(jnp.float32), cache.first)
    whole = _attend(q, k, v, widened, lengths, window, slots)
    assert got.shape == q.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, whole, rtol=2e-5, atol=2e-6)
