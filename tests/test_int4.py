"""Four-bit decoding weights (`core.model.int4`, `narrowed(params, "int4")`): the quantization's
bound and layout, our kernel (`core.model.kernels.native`) against the float product of the same
dequantized matrix, XLA's fallback, and a decoder that decodes with them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_generate import full_logits, language_model

from core.generation.generate import generate
from core.model import int4, kernels, quantized
from core.model.kernels import native
from core.model.precision import narrowed

RNG = np.random.default_rng(0)


def test_each_group_spans_its_minimum_to_its_maximum_in_fifteen_float16_steps():
    """Per output and group of 32 inputs: the offset is the group's minimum rounded down to
    float16 and the scale its remaining range over 15 rounded up, so that every weight lies
    within half a step; the values hold two weights a byte, 32g + k low and 32g + 16 + k high."""
    kernel = jnp.asarray(RNG.standard_normal((96, 5)).astype(np.float32))
    q = int4.quantize(kernel)
    assert q.values.shape == (5, 48) and q.values.dtype == jnp.uint8 and q.scales.shape == (5, 3) == q.offsets.shape
    assert q.scales.dtype == jnp.float16 == q.offsets.dtype
    groups = np.asarray(kernel).T.reshape(5, 3, 32)
    offsets, scales = np.asarray(q.offsets, np.float32), np.asarray(q.scales, np.float32)
    assert np.all(offsets <= groups.min(-1)) and np.all(offsets > groups.min(-1) - 2e-3)
    assert np.all(scales * 15 >= groups.max(-1) - offsets) and np.all(scales * 15 < (groups.max(-1) - offsets) * 1.002)
    got = np.asarray(q.astype(jnp.float32))
    assert got.shape == (96, 5) and q.shape == (96, 5)
    assert np.all(np.abs(got - kernel) <= np.repeat(scales.T, 32, 0) / 2 * (1 + 1e-4))
    first = np.asarray(q.values[0, 0])  # weights 0 (low) and 16 (high) of output 0
    codes = np.round((groups[0, 0] - offsets[0, 0]) / scales[0, 0])
    assert first == codes[0] + 16 * codes[16]


def kernel_product(x: np.ndarray, q: int4.Int4) -> np.ndarray:
    """What our kernel computes, in float64: each row's groups of 32 inputs scaled by 127 over
    their largest magnitude (in float32, as the kernel does) in two int8 parts, the rounded value
    and its rounding error times 127 rounded, times the four-bit codes, each group's integer sum
    scaled by both scales, plus the offsets times the groups' sums."""
    rows, inputs = x.shape
    groups = x.reshape(rows, inputs // 32, 32)
    largest = np.abs(groups).max(-1, keepdims=True)
    inverse = np.where(largest > 0, np.float32(127) / np.where(largest > 0, largest, 1), np.float32(0))
    scaled = groups * inverse
    high = np.rint(scaled)
    codes_x = high.astype(np.float64) * 127 + np.rint((scaled - high) * np.float32(127))  # [R, G, 32]
    packed = np.asarray(q.values).reshape(q.values.shape[0], -1, 16)
    codes_w = np.concatenate([packed & 15, packed >> 4], -1).astype(np.float64)  # [O, G, 32]
    sums = np.einsum("rgj,ogj->rog", codes_x, codes_w)
    scales, offsets = np.asarray(q.scales, np.float64), np.asarray(q.offsets, np.float64)
    steps = largest[..., 0].astype(np.float64) / 127 / 127
    return (sums * steps[:, None, :] * scales[None]).sum(-1) + groups.astype(np.float64).sum(-1) @ offsets.T


@pytest.mark.skipif(not native.available(), reason="no C++ compiler, or a CPU without AVX2 and FMA")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])
def test_our_kernel_sums_few_rows_in_integers_and_blocks_of_four_in_float32(rows):
    """A decoding step's rows go through our kernel. Rows in blocks of four widen the weights to
    float32 and sum in float32: the float product of the dequantized matrix. The rest (one to
    three rows, a decoding step's usual count) split each group of 32 inputs into two int8 parts
    and sum their products with the four-bit codes in integers: exactly `kernel_product` (to
    float32's rounding), and the float product within the bound that the parts set (each input
    off by at most half its group's finer step). Rows of very different sizes, a group of zeros,
    an output count neither even nor a multiple of 4, three groups (a pair and a lone one)."""
    x = np.asarray(RNG.standard_normal((rows, 96)).astype(np.float32) * np.linspace(0.01, 10, rows)[:, None])
    x[-1, 32:64] = 0  # a group of zeros: no scale to divide by
    q = int4.quantize(jnp.asarray(RNG.standard_normal((96, 37)).astype(np.float32)))
    got = np.asarray(jax.jit(quantized.product)(jnp.asarray(x), q))
    assert got.shape == (rows, 37) and got.dtype == np.float32
    matrix = np.asarray(q.astype(jnp.float32), np.float64)
    exact = np.asarray(x, np.float64) @ matrix
    blocks = rows // 4 * 4
    np.testing.assert_allclose(got[:blocks], exact[:blocks], rtol=1e-5, atol=1e-5 * np.abs(exact).max())
    if blocks == rows:
        return
    few, exact = got[blocks:], exact[blocks:]
    expected = kernel_product(x[blocks:], q)
    np.testing.assert_allclose(few, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    half_steps = np.repeat(np.abs(x[blocks:]).reshape(-1, 3, 32).max(-1) / 127 / 127 / 2, 32, axis=1)  # [R, I]
    assert np.all(np.abs(few - exact) <= half_steps @ np.abs(matrix) * (1 + 1e-4) + 1e-6)
    assert np.abs(few - exact).max() > 1e-5 * np.abs(exact).max()  # the parts round: not a float product


@pytest.mark.parametrize("rows", [1, kernels.INT4_ROWS])
def test_without_our_kernel_or_with_many_rows_the_matrix_widens_to_bfloat16(rows, monkeypatch):
    """Where our kernel is missing (and from `core.model.kernels.INT4_ROWS` rows on) XLA multiplies x and the
    dequantized matrix, both rounded to bfloat16, in float32 sums."""
    monkeypatch.setattr(native, "available", lambda: False)
    x = jnp.asarray(RNG.standard_normal((rows, 64)).astype(np.float32))
    q = int4.quantize(jnp.asarray(RNG.standard_normal((64, 24)).astype(np.float32)))
    bf16 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    np.testing.assert_allclose(quantized.product(x, q), bf16(x) @ bf16(q.astype(jnp.float32)), rtol=1e-5, atol=1e-5)


def test_a_compiler_that_fails_is_named_with_its_message(monkeypatch, tmp_path):
    """A kernel that cannot be built says which compiler failed on which file, and why."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(OSError, match="false could not build .*core/model/kernels"):
        native.built()


def test_a_kernel_beyond_float16s_range_or_groups_stays_int8():
    """Four bits keep float16 scales and offsets: a kernel with a weight past 65,504, or inputs
    that do not divide into groups of 32, narrows to int8 instead (no infinite offset)."""
    table = {
        "kernel": quantized.LinearKernel(jnp.ones((64, 4)).at[3, 1].set(-7e4)),
        "odd": quantized.LinearKernel(jnp.ones((48, 4))),
    }
    got = narrowed(nnx.State(table), "int4")
    assert isinstance(got["kernel"][...], quantized.Quantized) and isinstance(got["odd"][...], quantized.Quantized)
    assert isinstance(
        narrowed(nnx.State({"kernel": quantized.LinearKernel(jnp.ones((64, 4)))}), "int4")["kernel"][...], int4.Int4
    )


def test_a_four_bit_kernel_is_read_whole():
    with pytest.raises(TypeError, match="read whole"):
        int4.quantize(jnp.ones((32, 3)))[jnp.asarray([1])]


@pytest.fixture(scope="module")
def decoder():
    model = language_model()
    graphdef, params = nnx.split(model)
    return model, nnx.merge(graphdef, narrowed(params, "int4"))


def values(model, kind) -> list:
    is_variable = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    return [v[...] for v in jax.tree.leaves(nnx.state(model, kind), is_leaf=is_variable)]


def test_int4_takes_the_linear_kernels_and_leaves_the_table_int8(decoder):
    """Every linear kernel (inputs in groups of 32 here) in four bits, the token table int8,
    the rest (norms) float32."""
    kernels = values(decoder[1], quantized.LinearKernel)
    assert kernels and all(isinstance(kernel, int4.Int4) for kernel in kernels)
    (table,) = values(decoder[1], quantized.TokenTable)
    assert isinstance(table, quantized.Quantized) and table.values.dtype == jnp.int8
    rest = nnx.state(decoder[1], nnx.Not(nnx.Any(quantized.LinearKernel, quantized.TokenTable)))
    assert {leaf.dtype for leaf in jax.tree.leaves(rest)} == {jnp.dtype(jnp.float32)}


def test_int4_weights_decode_near_float32_and_cached_equals_uncached(decoder):
    """On the tiny decoder (random weights, 15 steps a group of 32): logits within 15% of their
    range of float32's; a cached decode on four-bit weights equals their full forward pass,
    token for token."""
    model, narrow = decoder
    prompts = [[1, 5, 9, 2], [7, 7, 3, 11]]
    exact, got = full_logits(model, prompts), full_logits(narrow, prompts)
    spread = float(exact.max() - exact.min())
    assert 0 < float(jnp.abs(got - exact).max()) < 0.15 * spread
    tokens = generate(narrow, prompts, max_new_tokens=8).tokens
    np.testing.assert_array_equal(tokens, generate(narrow, prompts, max_new_tokens=8, use_cache=False).tokens)
