"""A model's last hidden states over token ids: its embedder, then its body, as a task's
embeddings read them (`Task.embed`: a decoder's prompt, a protein run's residues, a sentiment run's tokens)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@nnx.jit
def _forward(model: nnx.Module, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """The body's last states [B, T, D]: compiled once per shape, whatever the call."""
    return model.body(*model.embedder(ids, mask))


def last_states(model: nnx.Module, ids: np.ndarray, mask: np.ndarray, batch_size: int) -> np.ndarray:
    """The body's last states [N, T, D] of rows of `ids` [N, T] (positions where `mask` is false
    are padding), `batch_size` rows a call."""
    return np.concatenate(
        [
            np.asarray(_forward(model, jnp.asarray(ids[i : i + batch_size]), jnp.asarray(mask[i : i + batch_size])))
            for i in range(0, len(ids), batch_size)
        ]
    )
