"""Input embedders and output heads that several tasks share.

Every head takes the body's hidden states [B, T, D] and the padding mask [B, T] and returns the
task's outputs, so that `Model` can call any of them the same way.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


class TokenEmbedder(nnx.Module):
    """A front end: token ids [B, T] and their mask -> vectors [B, T, D] and the same mask;
    positions are added by the body."""

    def __init__(self, vocab_size: int, d_model: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=d_model**-0.5)
        self.embedding = nnx.Embed(vocab_size, d_model, embedding_init=init, rngs=rngs)

    def __call__(self, tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        # The table's own dtype, which is the compute dtype (nnx.Embed would promote to float32).
        return jnp.take(self.embedding.embedding[...], tokens, axis=0), mask


def mean_pool(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """The mean of the hidden states [B, T, D] over the real positions of `mask` [B, T] -> [B, D]
    (sentence-transformers' mean pooling)."""
    weights = mask.astype(hidden.dtype)[..., None]
    return (hidden * weights).sum(1) / jnp.maximum(weights.sum(1), 1)


class PooledClassifier(nnx.Module):
    """Masked mean of the hidden states, then a linear layer: -> logits [B, C]."""

    def __init__(self, d_model: int, num_classes: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(d_model, num_classes, rngs=rngs)

    def __call__(self, hidden: jax.Array, mask: jax.Array) -> jax.Array:
        return self.linear(mean_pool(hidden, mask)).astype(jnp.float32)

    def probe_rows(self, hidden: jax.Array, mask: jax.Array, batch: dict) -> tuple[jax.Array, ...]:
        """What a linear probe of this head fits (`core.transfer.fit_probe`): the pooled features
        [B, D], their class ids [B] and weights [B]."""
        return mean_pool(hidden, mask), batch["targets"], batch["weights"]


class TokenClassifier(nnx.Module):
    """A linear layer at every position: -> logits [B, T, C]."""

    def __init__(self, d_model: int, num_classes: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(d_model, num_classes, rngs=rngs)

    def __call__(self, hidden: jax.Array, mask: jax.Array) -> jax.Array:
        return self.linear(hidden).astype(jnp.float32)


class Projection(NamedTuple):
    """Hidden states [B, T, D] and an output matrix [V, D], not yet multiplied.

    Losses over large vocabularies take both (`losses.linear_cross_entropy`) and never form the
    [B, T, V] logits; decoding asks for `logits()` where it needs them.
    """

    hidden: jax.Array
    weight: jax.Array

    def logits(self) -> jax.Array:
        return jnp.einsum("BTD,VD->BTV", self.hidden, self.weight.astype(self.hidden.dtype)).astype(jnp.float32)


class TiedOutput(nnx.Module):
    """Output over a vocabulary through the input embedding table itself: -> `Projection`."""

    def __init__(self, embedder: TokenEmbedder):
        self.embedder = embedder

    def __call__(self, hidden: jax.Array, mask: jax.Array) -> Projection:
        return Projection(hidden, self.embedder.embedding.embedding[...])
