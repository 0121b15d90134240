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
    weights = weights.astype(jnp.float32)
    hits = (logits.argmax(-1) == targets).astype(jnp.float32)
    return (hits * weights).sum(), weights.sum()


def add(total: Streamed | None, update: Streamed) -> Streamed:
    """Adds two streamed metric dicts pairwise (`total` None starts a sum)."""
    if total is None:
        return update
    return {name: (total[name][0] + num, total[name][1] + den) for name, (num, den) in update.items()}


def finish(total: Streamed) -> dict[str, float]:
    """Divides each numerator by its denominator on the host."""
    return {name: float(num) / max(float(den), 1e-12) for name, (num, den) in total.items()}
