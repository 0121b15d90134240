"""Losses as (sum, weight) pairs, so that gradient accumulation and data parallelism divide
by the true number of examples or tokens in the global batch, never by a per-shard count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


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
