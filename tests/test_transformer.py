"""The shared body: shapes, causality, padding invariance, and every option combination."""

import itertools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TINY_BODY

from core.config import ModelConfig
from core.model.heads import PooledClassifier, TokenEmbedder
from core.model.transformer import Model, Transformer

D_MODEL = TINY_BODY["d_model"]


def body(**changes):
    return Transformer(ModelConfig(**{**TINY_BODY, **changes}), rngs=nnx.Rngs(0))


def inputs(B=2, T=10, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, D_MODEL), np.float32))


@pytest.mark.parametrize(
    "norm,mlp,positions,causal",
    list(itertools.product(["layernorm", "rmsnorm"], ["gelu", "swiglu"], ["learned", "rotary"], [False, True])),
)
def test_every_option_sees_what_it_should(norm, mlp, positions, causal):
    model = body(norm=norm, mlp=mlp, positions=positions, causal=causal)
    x, mask = inputs(), jnp.ones((2, 10), bool)
    out = model(x, mask)
    assert out.shape == (2, 10, D_MODEL) and bool(jnp.all(jnp.isfinite(out)))
    # New values from position 6 on change those positions, and the earlier ones if and only if
    # the body attends both ways.
    changed = model(x.at[:, 6:].set(5.0), mask)
    assert not np.allclose(out[:, 6:], changed[:, 6:])
    assert np.allclose(out[:, :6], changed[:, :6], atol=1e-5) == causal
    # Whatever padded positions hold, the real ones come out the same.
    padded = jnp.asarray(np.arange(10) < 7)[None].repeat(2, 0)
    np.testing.assert_allclose(model(x, padded)[:, :7], model(x.at[:, 7:].set(-3.0), padded)[:, :7], atol=1e-5)


def test_pooled_classifier_ignores_padding_length():
    rngs = nnx.Rngs(0)
    model = Model(TokenEmbedder(50, 32, rngs=rngs), body(), PooledClassifier(32, 3, rngs=rngs))
    tokens = jnp.asarray([[5, 6, 7, 0, 0, 0]])
    short = {"inputs": tokens[:, :4], "mask": tokens[:, :4] > 0}
    long = {"inputs": tokens, "mask": tokens > 0}
    np.testing.assert_allclose(model(short), model(long), atol=1e-5)


def test_dropout_is_active_only_with_a_key():
    model = body(dropout=0.5)
    x, mask = inputs(), jnp.ones((2, 10), bool)
    np.testing.assert_array_equal(model(x, mask), model(x, mask))
    assert not np.allclose(model(x, mask, dropout_key=jax.random.key(1)), model(x, mask))


class HalvingFrontEnd(nnx.Module):
    """A front end that shortens the sequence, as a strided convolution over frames does."""

    def __init__(self, rngs):
        self.embed = TokenEmbedder(50, D_MODEL, rngs=rngs)

    def __call__(self, tokens, mask):
        x, _ = self.embed(tokens, mask)
        B, T, D = x.shape
        return x.reshape(B, T // 2, 2, D).mean(2), mask[:, 1::2]


class MaskEcho(nnx.Module):
    def __call__(self, hidden, mask):
        return hidden, mask


def test_a_front_end_may_change_the_length():
    model = Model(HalvingFrontEnd(nnx.Rngs(0)), body(), MaskEcho())
    tokens = jnp.asarray([[5, 6, 7, 8, 9, 0], [5, 6, 7, 8, 0, 0]])
    hidden, mask = model({"inputs": tokens, "mask": tokens > 0})
    assert hidden.shape == (2, 3, D_MODEL)
    # The body and the head see the front end's mask: pairs with a real second token are real.
    np.testing.assert_array_equal(mask, [[True, True, False], [True, True, False]])


def test_post_norm_blocks_end_normalized_with_biases_and_token_types():
    # BERT's options (core/checkpoints/pretrained.py): every block ends in its MLP's norm, which at its
    # initial scale 1 and bias 0 leaves each position with mean 0 and variance 1.
    model = body(norm_position="post", embedding_norm=True, bias=True, token_types=2, mlp="gelu_exact")
    assert model.final_norm is None and model.blocks[0].attention.qkv.bias is not None
    x, mask = inputs(), jnp.ones((2, 10), bool)
    out = model(x, mask)
    np.testing.assert_allclose(out.mean(-1), 0, atol=1e-5)
    np.testing.assert_allclose(out.var(-1), 1, atol=1e-3)
    segments = jnp.asarray(np.arange(10) >= 5, jnp.int32)[None].repeat(2, 0)
    assert not np.allclose(model(x, mask, token_types=segments), out)
    np.testing.assert_allclose(model(x, mask, token_types=jnp.zeros((2, 10), jnp.int32)), out, atol=1e-6)


@pytest.mark.parametrize("attention", ["blockwise", "xla"])
@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_packed_examples_read_as_if_alone(attention, positions):
    """Three examples packed in one row (segments 1, 2, 3, then padding) give each position the
    hidden state that the example alone gives: no attention across them, positions from each start."""
    from core.model.heads import TiedOutput

    config = ModelConfig(**{**TINY_BODY, "max_len": 16, "causal": True, "positions": positions, "attention": attention})
    rngs = nnx.Rngs(0)
    embedder = TokenEmbedder(50, config.d_model, rngs=rngs)
    model = Model(embedder, Transformer(config, rngs=rngs), TiedOutput(embedder))
    examples = [[5, 9, 3], [7, 1, 1, 4, 2], [8, 8]]
    row = [token for example in examples for token in example] + [0] * 6
    segments = [i + 1 for i, example in enumerate(examples) for _ in example] + [0] * 6
    packed = model(
        {"inputs": jnp.asarray([row]), "mask": jnp.asarray([segments]) > 0, "segments": jnp.asarray([segments])}
    ).logits()[0]
    start = 0
    for example in examples:
        alone = model({"inputs": jnp.asarray([example]), "mask": jnp.ones((1, len(example)), bool)}).logits()[0]
        np.testing.assert_allclose(packed[start : start + len(example)], alone, atol=1e-5, rtol=1e-5)
        start += len(example)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("inputs,outputs", [(4, 12), (12, 4), (6, 6)])  # both branches of the weight gradient
def test_matmul_gradients_are_plain_autodiff(inputs, outputs, dtype):
    """`core.model.precision.matmul`'s custom backward (the weight gradient written transposed when
    O > I) gives the gradients, and the dtypes, of `x @ kernel` differentiated by JAX."""
    from core.model.precision import matmul

    rng = np.random.default_rng(inputs * outputs)
    x = jnp.asarray(rng.standard_normal((2, 3, inputs)), dtype)
    kernel = jnp.asarray(rng.standard_normal((inputs, outputs)), dtype)
    cotangent = jnp.asarray(rng.standard_normal((2, 3, outputs)), dtype)

    def loss(product):
        return lambda x, kernel: (product(x, kernel) * cotangent).astype(jnp.float32).sum()

    custom = jax.grad(loss(matmul), (0, 1))(x, kernel)
    plain = jax.grad(loss(jnp.matmul), (0, 1))(x, kernel)
    tolerance = 1e-6 if dtype == jnp.float32 else 2e-2
    for a, b in zip(custom, plain):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tolerance, atol=tolerance)


def test_products_in_bfloat16_multiply_float32_weights_rounded_and_give_unrounded_float32_gradients():
    """Mixed precision (`train.matmul_dtype=bfloat16`): float32 activations and weights multiply
    as their bfloat16 roundings with float32 sums, exactly (products of bfloat16 values are exact
    in float32); both gradients are float32 and unrounded: the float32 sums of rounded operands."""
    from core.model.precision import matmul, products_in

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 5, 24)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((24, 40)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((3, 5, 40)), jnp.float32)

    def rounded(a):
        return a.astype(jnp.bfloat16).astype(jnp.float32)

    def loss(x, k, g):  # g an argument, as in a step: XLA:CPU has no bfloat16 dot of a constant's transpose
        return (matmul(x, k) * g).sum()

    with products_in("bfloat16"):
        got = jax.jit(lambda x, k: matmul(x, k))(x, kernel)
        grad_x, grad_kernel = jax.jit(jax.grad(loss, (0, 1)))(x, kernel, g)
    np.testing.assert_allclose(got, rounded(x) @ rounded(kernel), rtol=1e-6, atol=1e-5)
    assert not np.allclose(got, x @ kernel, rtol=1e-6, atol=1e-5)  # the rounding is there to see
    assert grad_x.dtype == grad_kernel.dtype == jnp.float32
    np.testing.assert_allclose(grad_x, rounded(g) @ rounded(kernel).T, rtol=1e-6, atol=1e-5)
    flat = rounded(x).reshape(-1, 24).T @ rounded(g).reshape(-1, 40)
    np.testing.assert_allclose(grad_kernel, flat, rtol=1e-6, atol=1e-5)
    # Outside the context (and once it is left) products are float32 again.
    np.testing.assert_allclose(matmul(x, kernel), x @ kernel, rtol=1e-6)


@pytest.mark.parametrize("flags", [{"avx2", "fma"}, {"avx512f", "avx512_bf16"}, {"avx2", "amx_bf16", "amx_tile"}])
def test_auto_products_are_bfloat16_only_where_the_cpu_multiplies_bfloat16(monkeypatch, flags):
    """`train.matmul_dtype=auto` (the lm fine-tuning presets'): bfloat16 products on a CPU with
    AMX or AVX-512 BF16, float32 on one that would emulate them (AVX2 alone); the products
    traced under it are those of the dtype chosen."""
    from core.model import kernels, precision

    monkeypatch.setattr(kernels, "_cpu_flags", lambda: flags)
    expected = "float32" if flags == {"avx2", "fma"} else "bfloat16"
    assert kernels.fastest_products() == precision.chosen_products("auto") == expected
    assert precision.chosen_products("float32") == "float32"  # named dtypes stand as they are
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 24)), jnp.float32)
    kernel = jnp.asarray(np.random.default_rng(1).standard_normal((24, 8)), jnp.float32)
    # Fresh functions to trace: jit's cache does not key on the context.
    with precision.products_in("auto"):
        got = jax.jit(lambda x, k: precision.matmul(x, k))(x, kernel)
    with precision.products_in(expected):
        np.testing.assert_array_equal(got, jax.jit(lambda x, k: precision.matmul(x, k))(x, kernel))
    rounded = x.astype(jnp.bfloat16).astype(jnp.float32) @ kernel.astype(jnp.bfloat16).astype(jnp.float32)
    assert np.allclose(got, rounded, rtol=1e-6, atol=1e-5) == (expected == "bfloat16")


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_bfloat16_weights_multiply_in_bfloat16_with_float32_sums(rows):
    """A bfloat16 kernel under float32 activations (decoding weights, `core.model.precision.narrowed`):
    the product is float32 and equals the float32 product of both operands rounded to bfloat16
    (products of bfloat16 values are exact in float32), for one row (multiplied as two inside)
    as for several; the gradients keep each operand's dtype."""
    from core.model.precision import matmul

    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 1, 24)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((24, 40)), jnp.bfloat16)
    rounded = x.astype(jnp.bfloat16).astype(jnp.float32) @ kernel.astype(jnp.float32)
    got = matmul(x, kernel)
    assert got.dtype == jnp.float32 and got.shape == (rows, 1, 40)
    np.testing.assert_allclose(got, rounded, rtol=1e-6, atol=1e-5)
    grad_x, grad_kernel = jax.grad(lambda x, k: matmul(x, k).sum(), (0, 1))(x, kernel)
    assert grad_x.dtype == jnp.float32 and grad_kernel.dtype == jnp.bfloat16
    np.testing.assert_allclose(grad_x, jnp.broadcast_to(kernel.astype(jnp.float32).sum(1), x.shape), rtol=1e-6)
    column = x.astype(jnp.bfloat16).astype(jnp.float32).reshape(rows, 24).sum(0)
    np.testing.assert_allclose(grad_kernel.astype(jnp.float32)[:, 0], column, rtol=1e-2, atol=1e-2)


def test_bfloat16_products_and_their_gradients_stay_bfloat16_where_xla_compiles_them():
    """XLA:CPU multiplies a bfloat16 product in float32 when an operand is transposed in memory,
    as the weight gradients' x^T g are (3 to 3.5 times slower): `core.model.precision.transposed`
    copies such operands in order. Every product of a linear layer's step and of the fused output
    layer's, forward and backward, reaches the compiled program with bfloat16 operands."""
    from core.model.precision import matmul, products_in
    from core.training.losses import linear_cross_entropy

    rng = np.random.default_rng(0)
    x, g = (jnp.asarray(rng.standard_normal((2, 64, n)), jnp.float32) for n in (32, 96))
    kernel = jnp.asarray(rng.standard_normal((32, 96)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((300, 32)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 300, (2, 64)))

    def layer(x, k, g):
        return (matmul(x, k) * g).sum()

    def output(x, table):
        return linear_cross_entropy(x, table, targets, jnp.ones((2, 64)), chunk=32)[0]

    with products_in("bfloat16"):
        layer_dots = helpers.compiled_dot_operands(jax.value_and_grad(layer, (0, 1)), x, kernel, g)
        output_dots = helpers.compiled_dot_operands(jax.value_and_grad(output, (0, 1)), x, table)
    assert len(layer_dots) == 3 and len(output_dots) == 3  # forward, and both gradients
    assert set(layer_dots + output_dots) == {("bf16", "bf16")}


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
def test_a_gated_mlp_saves_its_input_for_the_backward_in_the_products_dtype(kind):
    """The gate's backward reads the up projection's output as the products would read it: in
    float32 exactly autodiff's gradient; under bfloat16 products, autodiff's gradient at the
    bfloat16 rounding of that output, while the forward value stays unrounded."""
    from core.model.layers import MLP, _gated
    from core.model.precision import products_in

    rng = np.random.default_rng(3)
    gate_up = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)

    def plain(x):
        gate, up = jnp.split(x, 2, axis=-1)
        return MLP.GATES[kind](gate) * up

    def value_and_grad(function, x):
        value, pullback = jax.vjp(function, x)
        return value, pullback(cotangent)[0]

    value, grad = value_and_grad(lambda x: _gated(kind, x), gate_up)
    expected_value, expected_grad = value_and_grad(plain, gate_up)
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-6, atol=1e-7)
    with products_in("bfloat16"):
        value, grad = jax.jit(lambda x: value_and_grad(lambda y: _gated(kind, y), x))(gate_up)
    rounded = gate_up.astype(jnp.bfloat16).astype(jnp.float32)
    # Compiled, XLA's fused tanh and sigmoid differ from eager ones in the last bits.
    np.testing.assert_allclose(value, expected_value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, value_and_grad(plain, rounded)[1], rtol=1e-5, atol=1e-6)
    assert np.abs(grad - expected_grad).max() > 1e-4  # the rounding shows
