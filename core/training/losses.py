"""Losses as (sum, weight) pairs, so that gradient accumulation and data parallelism divide
by the true number of examples or tokens in the global batch, never by a per-shard count."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from core.model import kernels
from core.model.heads import CopyProjection, mix
from core.model.precision import narrower, product, transposed


def cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, label_smoothing: float = 0.0
) -> tuple[jax.Array, jax.Array]:
    """Softmax cross-entropy of logits [..., C] against integer targets [...], weighted.

    Returns (sum of weighted losses, sum of weights). With `label_smoothing` s the target
    distribution is (1 - s) on the label plus s / C on every class.
    """
    logits = logits.astype(jnp.float32)
    if label_smoothing:
        num_classes = logits.shape[-1]
        labels = optax.smooth_labels(jax.nn.one_hot(targets, num_classes), label_smoothing)
        losses = optax.softmax_cross_entropy(logits, labels)
    else:
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    weights = weights.astype(jnp.float32)
    return (losses * weights).sum(), weights.sum()


def linear_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    label_smoothing: float = 0.0,
    chunk: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`cross_entropy(hidden @ weight.T, targets, weights, label_smoothing)` without
    materializing the logits, and without computing them where the weight is 0.

    hidden [..., D], weight [V, D] (an output projection or a tied embedding table). The
    weighted positions are moved first (a stable sort: padding, and the prompts of prompt /
    completion pairs, whose loss counts nothing), then rows are processed `chunk` at a time
    (`chunk_rows` by default), and a chunk of weights all 0 is skipped: the [V, D] products
    scale with the positions the loss counts, not with all the positions read (a fine-tuning
    row's prompt is most of it).
    Each chunk's gradients with respect to `hidden` and `weight` are formed right after its
    softmax, while the chunk's logits are still in cache; the [N, V] logits and their gradient
    never exist whole.
    """
    D = hidden.shape[-1]
    flat_weights = weights.astype(jnp.float32).reshape(-1)
    counted_first = jnp.argsort(flat_weights == 0, stable=True)
    flat_hidden = hidden.reshape(-1, D)[counted_first]
    flat_targets = targets.reshape(-1)[counted_first]
    chunk = min(chunk or chunk_rows(weight.shape[0]), flat_hidden.shape[0])
    total = _fused_ce(flat_hidden, weight, flat_targets, flat_weights[counted_first], float(label_smoothing), chunk)
    return total, flat_weights.sum()


def copy_cross_entropy(
    outputs: CopyProjection, targets: jax.Array, weights: jax.Array, label_smoothing: float = 0.0
) -> tuple[jax.Array, jax.Array]:
    """`cross_entropy(outputs.logits(), targets, weights, label_smoothing)` of a pointer-generator
    (`core.model.heads.CopyProjection`) without mixing its [B, T, V] distribution.

    P(w) = g Pgen(w) + (1 - g) C(w), where C(w) is the copy attention on the source positions
    holding w. The label's term needs P(y) alone. The smoothing term, the mean of -log P(w) over
    the vocabulary, is -log(g Pgen(w)) summed over all of it (a sum of logits) except at the
    source's distinct tokens, which take their mixed term instead: [B, T, S] work beside the
    [B, T, V] logits.
    """
    logits = outputs.hidden.astype(jnp.float32) @ outputs.weight.astype(jnp.float32).T  # [B, T, V]
    V = logits.shape[-1]
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    gate, log_gen = outputs.gate[..., None], jax.nn.log_sigmoid(outputs.gate)[..., None]

    def mixed(ids: jax.Array, copied: jax.Array) -> jax.Array:
        """log P of `ids` [B, T, K] whose copy mass is `copied` [B, T, K]."""
        return mix(gate, jnp.take_along_axis(logits, ids, axis=-1) - lse, copied)

    tokens, real = outputs.tokens, outputs.mask
    on_target = (tokens[:, None, :] == targets[..., None]) & real[:, None, :]  # [B, T, S]
    copied = (outputs.attention * on_target).sum(-1, keepdims=True)
    losses = -mixed(targets[..., None], copied)[..., 0]
    if label_smoothing:
        same = (tokens[:, :, None] == tokens[:, None, :]) & real[:, None, :] & real[:, :, None]  # [B, S, S]
        # Each distinct source token once: at its first real position.
        first = real & ~jnp.any(jnp.tril(same, k=-1), axis=-1)
        at_source = jnp.broadcast_to(tokens[:, None, :], outputs.attention.shape)
        source_copied = jnp.einsum("BTS,BRS->BTR", outputs.attention, same.astype(jnp.float32))
        generated_only = log_gen + jnp.take_along_axis(logits, at_source, axis=-1) - lse
        correction = ((generated_only - mixed(at_source, source_copied)) * first[:, None, :]).sum(-1)
        everything = -(V * log_gen[..., 0] + logits.sum(-1) - V * lse[..., 0])
        losses = (1 - label_smoothing) * losses + label_smoothing * (everything + correction) / V
    weights = weights.astype(jnp.float32)
    return (losses * weights).sum(), weights.sum()


def chunk_rows(vocabulary: int) -> int:
    """`linear_cross_entropy`'s rows per chunk: 512, or as many as keep a chunk's float32 logits
    within 2^25 values (128 MB) at a large vocabulary, and at least 256. Longer chunks feed the
    products more rows at once: at SmolLM2's 49,152 pieces, 512 rows take the output layer's three
    bfloat16 products from 0.71 to 0.43 s a step; at Gemma 3's 262,144, 256 rows already hold
    2^26 values."""
    return max(256, min(512, 2**25 // vocabulary))


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    pad = (-x.shape[0]) % chunk
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(-1, chunk, *x.shape[1:])


def _ce_chunk(h, output, t, w, smoothing: float, with_grads: bool, weight_grads: bool = True):
    """One chunk's loss, and with `with_grads` its gradients for h and (transposed, [D, V]) for
    the weight [V, D], whose products `output` (`_OutputProducts`) runs."""
    logits = output.logits(h)  # [K, V], float32 (or wider)
    V = logits.shape[-1]
    # The softmax's exponentials once, for the loss's log-sum and the gradient alike: a fused
    # exp-and-sum runs in XLA:CPU's reduction library at a sixth of its elementwise exp's speed
    # (a chunk's logsumexp and gradient 120 -> 78 ms at 512 x 49,152).
    peak = jax.lax.stop_gradient(logits.max(-1, keepdims=True))
    exps = jnp.exp(logits - peak)
    sums = exps.sum(-1, keepdims=True)
    lse = (jnp.log(sums) + peak)[:, 0]
    picked = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
    # The target distribution (1 - s) one_hot(t) + s / V, as in `cross_entropy`.
    loss = ((lse - (1 - smoothing) * picked - smoothing * logits.mean(-1)) * w).sum()
    if not with_grads:
        return loss, None, None
    labels = (1 - smoothing) * jax.nn.one_hot(t, V) + smoothing / V
    grad_logits = (exps / sums - labels) * w[:, None]
    grad_logits = grad_logits.astype(h.dtype)
    grad_hidden = output.grad_hidden(grad_logits).astype(h.dtype)
    return loss, grad_hidden, output.grad_weight(h, grad_logits) if weight_grads else None


class _OutputProducts:
    """The output layer's three products for the chunks, on operands laid out once per step:
    the logits h W^T, the hidden's gradient g W and the weight's, transposed, h^T g ([D, V]:
    XLA's copy of h [K, D] in `transposed`, not of g [K, V]).

    XLA's take the weight [V, D] in the dtype of `products_in` where it is narrower, and its
    transposed copy (`core.model.precision.transposed`). With bfloat16 products on AMX's tiles
    (the seam's `core.model.kernels.tiles_take`) all three go there, the weight as panels read
    either way, laid out once a step where XLA:CPU copies the weight transposed."""

    def __init__(self, hidden, weight):
        self.dtype = narrower(hidden.dtype)
        self.shape = weight.shape
        self.tiled = kernels.tiles_take(self.dtype)
        if self.tiled:
            self.panels = kernels.tile_panels(weight, transposed=True), kernels.tile_panels(weight)
            return
        if self.dtype.itemsize < weight.dtype.itemsize:
            weight = weight.astype(self.dtype)
        self.weight, self.weight_t = weight, transposed(weight, self.dtype)

    def logits(self, h):
        if self.tiled:
            return kernels.tile_multiply_panels(h, self.panels[0], self.shape[0])
        return product(h, self.weight_t, self.dtype)

    def grad_hidden(self, grad_logits):
        if self.tiled:
            return kernels.tile_multiply_panels(grad_logits, self.panels[1], self.shape[1])
        return product(grad_logits, self.weight, self.dtype)

    def grad_weight(self, h, grad_logits):
        if self.tiled:
            return kernels.tile_multiply(h, grad_logits, self.shape[0], True, False)
        return product(h, grad_logits, self.dtype, a_transposed=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_ce(hidden, weight, targets, weights, smoothing, chunk):
    def body(total, inputs):
        def add(total):
            return total + _ce_chunk(inputs[0], output, inputs[1], inputs[2], smoothing, with_grads=False)[0]

        return jax.lax.cond(jnp.any(inputs[2] != 0), add, lambda total: total, total), None

    output = _OutputProducts(hidden, weight)
    inputs = (_chunks(hidden, chunk), _chunks(targets, chunk), _chunks(weights, chunk))
    return jax.lax.scan(body, jnp.zeros((), jnp.float32), inputs)[0]


def _fused_ce_forward(hidden, weight, targets, weights, smoothing, chunk):
    """The loss and its gradients, in one pass over the chunks. The weight's gradient is formed
    only where the weight is being differentiated (`perturbed`): a frozen output layer (LoRA's
    tied embedding) costs no [V, D] product per chunk."""
    weight_grads = weight.perturbed
    hidden, weight, targets, weights = (x.value for x in (hidden, weight, targets, weights))

    def body(carry, inputs):
        def add(carry):
            total, grad_weight = carry
            loss, grad_hidden, grad_w = _ce_chunk(
                inputs[0], output, inputs[1], inputs[2], smoothing, with_grads=True, weight_grads=weight_grads
            )
            grad_weight = grad_weight + grad_w.astype(jnp.float32) if weight_grads else grad_weight
            return (total + loss, grad_weight), grad_hidden

        # A chunk that counts nothing (sorted last) costs nothing: its hidden gradient is 0.
        return jax.lax.cond(jnp.any(inputs[2] != 0), add, lambda carry: (carry, jnp.zeros_like(inputs[0])), carry)

    output = _OutputProducts(hidden, weight)
    inputs = (_chunks(hidden, chunk), _chunks(targets, chunk), _chunks(weights, chunk))
    init = (jnp.zeros((), jnp.float32), jnp.zeros(weight.shape[::-1] if weight_grads else (), jnp.float32))
    (total, grad_weight), grad_hidden = jax.lax.scan(body, init, inputs)
    grad_hidden = grad_hidden.reshape(-1, hidden.shape[-1])[: hidden.shape[0]]
    return total, (
        grad_hidden,
        grad_weight.T.astype(weight.dtype) if weight_grads else None,
        targets,
        weights,
    )


def _fused_ce_backward(smoothing, chunk, residuals, cotangent):
    grad_hidden, grad_weight, targets, weights = residuals
    if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):  # the loss itself unused
        return None, None, None, None
    # A custom VJP must return cotangents in its inputs' dtypes (bf16 under bf16 compute); the
    # float32 loss cotangent would otherwise promote them.
    return (
        (cotangent * grad_hidden).astype(grad_hidden.dtype),
        None if grad_weight is None else (cotangent * grad_weight).astype(grad_weight.dtype),
        None,
        None,
    )


_fused_ce.defvjp(_fused_ce_forward, _fused_ce_backward, symbolic_zeros=True)


def ctc_loss(
    logits: jax.Array, mask: jax.Array, labels: jax.Array, label_mask: jax.Array, weights: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Connectionist temporal classification (optax.ctc_loss, blank id 0) of logits [B, T, V]
    over the real frames of `mask` [B, T] against labels [B, U] (real where `label_mask`).

    Returns (sum of weighted per-sequence negative log-likelihoods, sum of weights). Labels wider
    than the frames are cut to T: a label longer than its frames has no alignment at all, and
    callers reject such examples before training (they would otherwise cost a huge constant).
    """
    width = min(labels.shape[1], logits.shape[1])
    losses = optax.ctc_loss(
        logits.astype(jnp.float32),
        1.0 - mask.astype(jnp.float32),
        labels[:, :width],
        1.0 - label_mask[:, :width].astype(jnp.float32),
    )
    weights = weights.astype(jnp.float32)
    return (losses * weights).sum(), weights.sum()
