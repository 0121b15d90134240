"""Four-bit decoding weights (`core.model.int4`, `narrowed(params, "int4")`): the quantization's
bound and layout, our kernel (`core.model.native`) against the float product of the same
dequantized matrix, XLA's fallback, and a decoder that decodes with them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_generate import full_logits, language_model

from core.generation.generate import generate
from core.model import int4, native, quantized
from core.model.precision import narrowed

RNG = np.random.default_rng(0)


def test_each_group_spans_its_minimum_to_its_maximum_in_fifteen_steps():
    """Per output and group of 32 inputs: the offset is the group's minimum and the scale its
    range over 15, so both ends are exact and every weight lies within half a step; the values
    hold two weights a byte, 32g + k low and 32g + 16 + k high."""
    kernel = jnp.asarray(RNG.standard_normal((96, 5)).astype(np.float32))
    q = int4.quantize(kernel)
    assert q.values.shape == (5, 48) and q.values.dtype == jnp.uint8 and q.scales.shape == (5, 3) == q.offsets.shape
    groups = np.asarray(kernel).T.reshape(5, 3, 32)
    np.testing.assert_allclose(q.offsets, groups.min(-1))
    np.testing.assert_allclose(q.scales, (groups.max(-1) - groups.min(-1)) / 15, rtol=1e-6)
    got = np.asarray(q.astype(jnp.float32))
    assert got.shape == (96, 5) and q.shape == (96, 5)
    assert np.all(np.abs(got - kernel) <= np.repeat(np.asarray(q.scales).T, 32, 0) / 2 * (1 + 1e-4))
    np.testing.assert_allclose(got.T.reshape(5, 3, 32).max(-1), groups.max(-1), rtol=1e-5)
    first = np.asarray(q.values[0, 0])  # weights 0 (low) and 16 (high) of output 0
    codes = np.round((groups[0, 0] - groups[0, 0].min()) / np.asarray(q.scales[0, 0]))
    assert first == codes[0] + 16 * codes[16]


@pytest.mark.skipif(not native.available(), reason="no C++ compiler, or a CPU without AVX2 and FMA")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])
def test_our_kernel_is_the_float32_product_of_the_dequantized_matrix(rows):
    """A decoding step's rows go through our kernel, which widens the weights to float32 and sums
    in float32: the product of x and the dequantized kernel, rows of very different sizes, an
    output count that is neither even nor a multiple of 4."""
    x = jnp.asarray(RNG.standard_normal((rows, 96)).astype(np.float32) * np.linspace(0.01, 10, rows)[:, None])
    q = int4.quantize(jnp.asarray(RNG.standard_normal((96, 37)).astype(np.float32)))
    exact = np.asarray(x, np.float64) @ np.asarray(q.astype(jnp.float32), np.float64)
    got = jax.jit(quantized.product)(x, q)
    assert got.shape == (rows, 37) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())


@pytest.mark.parametrize("rows", [1, int4.NATIVE_ROWS])
def test_without_our_kernel_or_with_many_rows_the_matrix_widens_to_bfloat16(rows, monkeypatch):
    """Where our kernel is missing (and from `NATIVE_ROWS` rows on) XLA multiplies x and the
    dequantized matrix, both rounded to bfloat16, in float32 sums."""
    monkeypatch.setattr(int4.native, "available", lambda: False)
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
