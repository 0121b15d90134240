"""Losses and metrics against values computed by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import metrics
from core.model.heads import CopyProjection, Projection
from core.training import losses


def test_cross_entropy_by_hand():
    # softmax([0, ln 3]) = [1/4, 3/4]: the loss is -ln(3/4) for target 1 and -ln(1/4) for target 0.
    logits = jnp.asarray([[0.0, math.log(3)], [0.0, math.log(3)], [0.0, math.log(3)]])
    total, weight = losses.cross_entropy(logits, jnp.asarray([1, 0, 0]), jnp.asarray([1.0, 1.0, 0.0]))
    assert float(weight) == 2.0
    assert float(total) == pytest.approx(-math.log(0.75) - math.log(0.25), rel=1e-6)


def test_label_smoothing_by_hand():
    # s = 0.2 over two classes: target distribution [0.1, 0.9] for label 1.
    logits = jnp.asarray([[0.0, math.log(3)]])
    total, _ = losses.cross_entropy(logits, jnp.asarray([1]), jnp.ones(1), label_smoothing=0.2)
    assert float(total) == pytest.approx(-(0.1 * math.log(0.25) + 0.9 * math.log(0.75)), rel=1e-6)


# `counted` is the share of positions the loss counts; the rest (a prompt, padding) are sorted
# into chunks that are skipped, and must still get their zero gradient in place.
@pytest.mark.parametrize(
    "chunk,smoothing,counted",
    [(1, 0.0, 0.7), (7, 0.0, 0.7), (64, 0.0, 0.7), (7, 0.1, 0.7), (4, 0.1, 0.2), (4, 0.0, 0.0)],
)
def test_linear_cross_entropy_matches_plain_form_and_gradients(chunk, smoothing, counted):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((3, 11, 8), np.float32))
    weight = jnp.asarray(rng.standard_normal((40, 8), np.float32))
    targets = jnp.asarray(rng.integers(0, 40, (3, 11)))
    weights = jnp.asarray(rng.random((3, 11)) < counted)

    def plain(h, w):
        return losses.cross_entropy(jnp.einsum("BTD,VD->BTV", h, w), targets, weights, smoothing)[0]

    def fused(h, w):
        return losses.linear_cross_entropy(h, w, targets, weights, smoothing, chunk=chunk)[0]

    np.testing.assert_allclose(fused(hidden, weight), plain(hidden, weight), rtol=1e-5)
    for a, b in zip(jax.grad(fused, (0, 1))(hidden, weight), jax.grad(plain, (0, 1))(hidden, weight)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def smoothed_losses(seed: int, counted: float):
    """Random hidden states [2, 9, 8] and table [40, 8], and two losses of them with label
    smoothing 0.1 over the same targets and weights: (hidden, weight, fused, plain)."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((2, 9, 8), np.float32))
    weight = jnp.asarray(rng.standard_normal((40, 8), np.float32))
    targets = jnp.asarray(rng.integers(0, 40, (2, 9)))
    weights = jnp.asarray(rng.random((2, 9)) < counted)

    def fused(h, w):
        return losses.linear_cross_entropy(h, w, targets, weights, 0.1, chunk=4)[0]

    def plain(h, w):
        return losses.cross_entropy(jnp.einsum("BTD,VD->BTV", h, w), targets, weights, 0.1)[0]

    return hidden, weight, fused, plain


def test_linear_cross_entropy_in_bfloat16_gives_bfloat16_gradients_of_the_float32_form():
    """Under bf16 compute the custom backward hands back each input's own dtype, close to the
    float32 form's gradients (the fused loss forms its logits in float32)."""
    hidden, weight, fused, plain = smoothed_losses(seed=3, counted=0.5)
    low = (hidden.astype(jnp.bfloat16), weight.astype(jnp.bfloat16))
    np.testing.assert_allclose(fused(*low), plain(hidden, weight), rtol=2e-2)
    for a, b in zip(jax.grad(fused, (0, 1))(*low), jax.grad(plain, (0, 1))(hidden, weight)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=3e-2, rtol=3e-2)


def test_linear_cross_entropy_with_bfloat16_products_is_the_float32_form_of_rounded_operands():
    """Under `products_in("bfloat16")` float32 hidden states and table multiply as their bfloat16
    roundings with float32 sums: the loss is the float32 loss of the rounded operands, and the
    gradients stay float32."""
    from core.model.precision import products_in

    hidden, weight, fused, plain = smoothed_losses(seed=4, counted=0.6)

    def rounded(a):
        return a.astype(jnp.bfloat16).astype(jnp.float32)

    with products_in("bfloat16"):
        loss = jax.jit(fused)(hidden, weight)
        grads = jax.jit(jax.grad(fused, (0, 1)))(hidden, weight)
    np.testing.assert_allclose(loss, plain(rounded(hidden), rounded(weight)), rtol=1e-6)
    assert abs(float(loss) - float(plain(hidden, weight))) > 1e-5  # the rounding is there to see
    for a, b in zip(grads, jax.grad(plain, (0, 1))(rounded(hidden), rounded(weight))):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)  # the softmax's gradient is rounded too


def test_projection_predictions_are_the_argmax_of_its_logits_chunk_by_chunk():
    rng = np.random.default_rng(2)
    projection = Projection(
        jnp.asarray(rng.standard_normal((3, 5, 8), np.float32)), jnp.asarray(rng.standard_normal((30, 8), np.float32))
    )
    expected = np.asarray(projection.logits().argmax(-1))
    for chunk in (1, 4, 15, 64):  # 15 positions: chunks that divide them, and that do not
        np.testing.assert_array_equal(projection.predictions(chunk), expected)


def test_a_shortlisted_projection_is_a_softmax_over_its_ids_alone():
    # Hidden [1, 0] against rows whose first coordinate is the id: logit of id i is i. With
    # the shortlist {1, 3}, softmax([1, 3]) gives id 3 e^3 / (e + e^3); ids 0, 2 and 4 are out.
    weight = jnp.stack([jnp.arange(5.0), jnp.ones(5)], axis=1)
    projection = Projection(jnp.asarray([[[1.0, 0.0]]]), weight, jnp.asarray([1, 3]))
    logits = np.asarray(projection.logits())[0, 0]
    assert logits[1] == 1.0 and logits[3] == 3.0 and np.isneginf(logits[[0, 2, 4]]).all()
    assert projection.predictions().tolist() == [[3]]
    rows, covered = projection.rows_of(jnp.asarray([3, 1, 4, 0]))
    assert rows[:2].tolist() == [1, 0] and covered.tolist() == [True, True, False, False]
    total, count = losses.linear_cross_entropy(projection.hidden, projection.rows(), rows[:1], jnp.ones(1))
    assert float(total) == pytest.approx(-math.log(math.e**3 / (math.e + math.e**3)), rel=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_copy_cross_entropy_matches_the_mixed_distribution_and_gradients(smoothing):
    rng = np.random.default_rng(1)
    B, T, S, V, D = 3, 5, 6, 20, 8
    # Repeated source tokens; masked positions hold real ids (an id also found in the source).
    tokens = jnp.asarray([[4, 7, 4, 4, 9, 2], [3, 3, 11, 5, 7, 7], [6, 1, 12, 13, 14, 6]])
    mask = jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], bool)
    targets = jnp.asarray([[4, 9, 0, 7, 4], [3, 7, 11, 5, 19], [12, 6, 13, 1, 1]])
    weights = jnp.asarray(rng.random((B, T)) > 0.2)
    hidden = jnp.asarray(rng.standard_normal((B, T, D), np.float32))
    weight = jnp.asarray(rng.standard_normal((V, D), np.float32))
    gate = jnp.asarray(rng.standard_normal((B, T), np.float32))
    scores = jnp.asarray(rng.standard_normal((B, T, S), np.float32))

    def parts(h, w, g, a):
        attention = jax.nn.softmax(jnp.where(mask[:, None, :], a, -1e9), axis=-1)
        return CopyProjection(h, w, g, attention, tokens, mask)

    def plain(*args):
        return losses.cross_entropy(parts(*args).logits(), targets, weights, smoothing)[0]

    def direct(*args):
        return losses.copy_cross_entropy(parts(*args), targets, weights, smoothing)[0]

    args = (hidden, weight, gate, scores)
    np.testing.assert_allclose(direct(*args), plain(*args), rtol=1e-5)
    for a, b in zip(jax.grad(direct, (0, 1, 2, 3))(*args), jax.grad(plain, (0, 1, 2, 3))(*args)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_accuracy_and_streaming_by_hand():
    logits = jnp.asarray([[2.0, 1.0], [0.0, 3.0], [5.0, 0.0]])
    first = {"accuracy": metrics.accuracy(logits, jnp.asarray([0, 0, 0]), jnp.asarray([1.0, 1.0, 0.0]))}
    second = {"accuracy": metrics.accuracy(logits[:1], jnp.asarray([0]), jnp.ones(1))}
    # hits: 1 of 2 weighted rows, then 1 of 1: 2 / 3 overall.
    assert metrics.finish(metrics.add(metrics.add(None, first), second)) == {"accuracy": pytest.approx(2 / 3)}


def test_target_rank_with_exclusion_by_hand():
    scores = jnp.asarray([[0.9, 0.1, 0.5, 0.7], [0.2, 0.8, 0.8, 0.1]])
    # Row 0: target item 2 (0.5) is beaten by items 0 and 3; excluding item 0 leaves rank 1.
    # Row 1: target item 2 ties item 1 (0.8): a tie does not push it down, rank 0.
    exclude = jnp.asarray([[True, False, False, False], [False, False, False, False]])
    np.testing.assert_array_equal(metrics.target_rank(scores, jnp.asarray([2, 2])), [2, 0])
    np.testing.assert_array_equal(metrics.target_rank(scores, jnp.asarray([2, 2]), exclude), [1, 0])


def test_ranking_metrics_by_hand():
    ranks, weights = jnp.asarray([0, 3, 12, 7]), jnp.asarray([1.0, 1.0, 1.0, 0.0])
    result = metrics.finish(metrics.ranking(ranks, weights, ks=(1, 5, 10, 20)))
    assert result["hr@1"] == pytest.approx(1 / 3)
    assert result["hr@5"] == pytest.approx(2 / 3) and result["hr@10"] == pytest.approx(2 / 3)
    assert result["hr@20"] == pytest.approx(1.0)
    assert result["ndcg@5"] == pytest.approx((1 + 1 / math.log2(5)) / 3)
    assert result["ndcg@20"] == pytest.approx((1 + 1 / math.log2(5) + 1 / math.log2(14)) / 3)
    assert result["mrr@5"] == pytest.approx((1 + 1 / 4) / 3)
    assert result["mrr@20"] == pytest.approx((1 + 1 / 4 + 1 / 13) / 3)
