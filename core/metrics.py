"""Metric primitives streamed on device as (numerator, denominator) pairs.

A task's `metrics` returns {name: (numerator, denominator)}; the eval loop adds the pairs over
batches on device and divides once at the end, so a metric is exact over the whole split
however it is batched or sharded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Streamed = dict[str, tuple[jax.Array, jax.Array]]


def accuracy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Weighted count of argmax hits, and the weight."""
    return hits(logits.argmax(-1), targets, weights)


def hits(predicted: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Weighted count of predicted ids equal to the targets, and the weight."""
    weights = weights.astype(jnp.float32)
    return ((predicted == targets).astype(jnp.float32) * weights).sum(), weights.sum()


def add(total: Streamed | None, update: Streamed) -> Streamed:
    """Adds two streamed metric dicts pairwise (`total` None starts a sum)."""
    if total is None:
        return update
    return {name: (total[name][0] + num, total[name][1] + den) for name, (num, den) in update.items()}


def finish(total: Streamed) -> dict[str, float]:
    """Divides each numerator by its denominator on the host."""
    return {name: float(num) / max(float(den), 1e-12) for name, (num, den) in total.items()}


def target_rank(scores: jax.Array, targets: jax.Array, exclude: jax.Array | None = None) -> jax.Array:
    """0-based rank of each row's target among its candidates: scores [B, V], targets [B].

    `exclude` [B, V] marks candidates that do not compete (already-seen items, say); the target
    itself always competes. Ties count in the target's favour only if strictly lower: an item
    with the same score as the target does not push it down.
    """
    target_scores = jnp.take_along_axis(scores, targets[:, None], axis=-1)
    above = scores > target_scores
    if exclude is not None:
        above = above & ~exclude
    return above.sum(-1)


def ranking(ranks: jax.Array, weights: jax.Array, ks: tuple[int, ...] = (1, 5, 10, 20)) -> Streamed:
    """HR@K, NDCG@K and MRR@K (one relevant item per row) as streamed pairs."""
    weights = weights.astype(jnp.float32)
    ranks = ranks.astype(jnp.float32)
    total = weights.sum()
    streamed = {}
    for k in ks:
        hit = (ranks < k).astype(jnp.float32) * weights
        streamed[f"hr@{k}"] = (hit.sum(), total)
        streamed[f"ndcg@{k}"] = ((hit / jnp.log2(ranks + 2.0)).sum(), total)
        streamed[f"mrr@{k}"] = ((hit / (ranks + 1.0)).sum(), total)
    return streamed
