"""Int8 decoding weights (`core.model.quantized`, `narrowed(params, "int8")`): the quantization's
bound, the int8 product against the float product of the same dequantized matrix, and a decoder
that decodes with them: logits within a stated tolerance of float32's and the same greedy tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_generate import full_logits, language_model

from core.generation.generate import generate
from core.model import quantized
from core.model.precision import narrowed

RNG = np.random.default_rng(0)


def test_a_kernel_is_int8_within_half_a_step_of_each_column():
    """Each column's scale is its largest magnitude over 127; every weight lies within half a
    scale of its int8 value times the scale, and the largest of a column is exact. The values
    are kept one row per output (the kernel transposed)."""
    kernel = jnp.asarray(RNG.standard_normal((48, 20)).astype(np.float32))
    q = quantized.quantize(kernel, 0)
    assert q.values.dtype == jnp.int8 and q.values.shape == (20, 48) and q.scales.shape == (20, 1)
    assert q.shape == (48, 20) and q.astype(jnp.float32).shape == (48, 20)
    np.testing.assert_allclose(q.scales[:, 0], np.abs(kernel).max(0) / 127, rtol=1e-6)
    assert np.all(np.abs(q.astype(jnp.float32) - kernel) <= q.scales.T / 2 * (1 + 1e-5))
    assert np.all(np.abs(q.values).max(1) == 127)


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_the_int8_product_is_the_float_product_of_the_dequantized_matrix(rows):
    """Only the weights' rounding separates an int8 product from float32's: a row of x in two
    int8 parts is within max|x| / 127 / 254 of itself at each entry, so x @ q lies within that
    times the column's sum of |q| of x @ dequantized(q); for a kernel [I, O] and for a table
    [V, D] multiplied transposed (a tied output's logits), rows of very different sizes."""
    x = jnp.asarray(RNG.standard_normal((rows, 3, 64)).astype(np.float32) * np.asarray([1, 10, 0.01])[:, None])
    kernel = quantized.quantize(jnp.asarray(RNG.standard_normal((64, 40)).astype(np.float32)), 0)
    table = quantized.quantize(jnp.asarray(RNG.standard_normal((40, 64)).astype(np.float32)), 1)
    for weight, matrix in ((kernel, kernel.astype(jnp.float32)), (table, table.astype(jnp.float32).T)):
        got, exact = quantized.product(x, weight), x @ matrix
        assert got.shape == (rows, 3, 40) and got.dtype == jnp.float32
        bound = jnp.abs(x).max(-1, keepdims=True) / 127 / 254 * jnp.abs(matrix).sum(0, keepdims=True)[None]
        assert jnp.all(jnp.abs(got - exact) <= bound * 1.01 + 1e-6 * jnp.abs(exact))
        assert float(jnp.abs(got - exact).max()) > 0  # int8 indeed, not a float product


def test_many_rows_multiply_in_bfloat16_with_the_int8_values_exact():
    """From `WIDENED_ROWS` rows on (a long prompt, an encoder's frames) the int8 values widen to
    bfloat16, which holds them exactly, and x rounds to bfloat16: the product is that of the
    rounded x and the dequantized matrix, within float32 sums' error."""
    x = jnp.asarray(RNG.standard_normal((quantized.WIDENED_ROWS, 64)).astype(np.float32))
    for weight, matrix in (
        (
            q := quantized.quantize(jnp.asarray(RNG.standard_normal((64, 40)).astype(np.float32)), 0),
            q.astype(jnp.float32),
        ),
        (
            t := quantized.quantize(jnp.asarray(RNG.standard_normal((40, 64)).astype(np.float32)), 1),
            t.astype(jnp.float32).T,
        ),
    ):
        rounded = x.astype(jnp.bfloat16).astype(jnp.float32)
        np.testing.assert_allclose(quantized.product(x, weight), rounded @ matrix, rtol=1e-5, atol=1e-5)


def test_a_quantized_table_gives_its_rows_for_ids_and_a_shortlist():
    table = quantized.quantize(jnp.asarray(RNG.standard_normal((30, 8)).astype(np.float32)), 1)
    ids = jnp.asarray([[3, 0], [29, 3]])
    np.testing.assert_array_equal(quantized.take(table, ids), table.astype(jnp.float32)[ids])
    shortlist = table[jnp.asarray([2, 5])]
    np.testing.assert_array_equal(shortlist.values, table.values[jnp.asarray([2, 5])])
    with pytest.raises(TypeError, match="only a table's rows"):
        quantized.quantize(jnp.ones((4, 3)), 0)[jnp.asarray([1])]


@pytest.fixture(scope="module")
def decoder():
    model = language_model()
    graphdef, params = nnx.split(model)
    return model, nnx.merge(graphdef, narrowed(params, "int8"))


def test_int8_quantizes_the_linear_kernels_and_token_table_alone(decoder):
    """Every linear layer's kernel and the token table (which the tied output reads) are int8;
    norms and anything else stay float32."""
    kinds = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(decoder[1]))[0]:
        name = next(key.key for key in reversed(path) if isinstance(key, jax.tree_util.DictKey))
        kinds.setdefault(leaf.dtype, set()).add(name)
    assert kinds[jnp.dtype(jnp.int8)] == {"kernel", "embedding"}
    assert kinds[jnp.dtype(jnp.float32)] == {"kernel", "embedding", "scale", "bias"}  # int8 scales, norms
    with pytest.raises(ValueError, match="from an nnx state"):
        narrowed(nnx.to_pure_dict(nnx.state(decoder[0])), "int8")


def test_int8_weights_decode_as_float32_does_within_the_stated_tolerance(decoder):
    """On the tiny decoder: logits within 2% of their range of float32's, and the same greedy
    tokens; a cached decode on int8 weights equals their full forward pass, token for token."""
    model, narrow = decoder
    prompts = [[1, 5, 9, 2], [7, 7, 3, 11]]
    exact, got = full_logits(model, prompts), full_logits(narrow, prompts)
    spread = float(exact.max() - exact.min())
    assert float(jnp.abs(got - exact).max()) < 0.02 * spread
    assert float(jnp.abs(got - exact).max()) > 0  # int8 indeed
    tokens = generate(narrow, prompts, max_new_tokens=8).tokens
    np.testing.assert_array_equal(tokens, generate(model, prompts, max_new_tokens=8).tokens)
    uncached = generate(narrow, prompts, max_new_tokens=8, use_cache=False).tokens
    np.testing.assert_array_equal(tokens, uncached)
