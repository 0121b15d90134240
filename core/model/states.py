"""A model's last hidden states over token ids: its embedder, then its body, as a task's
embeddings read them (`Task.embed`: a protein run's residues, a sentiment run's tokens)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class Body(nnx.Module):
    """A model's embedder and body: ids and mask -> hidden states [B, T, D]."""

    def __init__(self, model: nnx.Module):
        self.embedder, self.body = model.embedder, model.body

    def __call__(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
        x, mask = self.embedder(ids, mask)
        return self.body(x, mask)


@nnx.jit
def _forward(body: Body, ids: jax.Array, mask: jax.Array) -> jax.Array:
    return body(ids, mask)


def last_states(model: nnx.Module, ids: np.ndarray, mask: np.ndarray, batch_size: int) -> np.ndarray:
    """The body's last states [N, T, D] of rows of `ids` [N, T] (positions where `mask` is false
    are padding), `batch_size` rows a call."""
    body = Body(model)
    return np.concatenate(
        [
            np.asarray(_forward(body, jnp.asarray(ids[i : i + batch_size]), jnp.asarray(mask[i : i + batch_size])))
            for i in range(0, len(ids), batch_size)
        ]
    )
