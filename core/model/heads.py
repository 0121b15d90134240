"""Input embedders and output heads that several tasks share.

Every head takes the body's hidden states [B, T, D] and the padding mask [B, T] and returns the
task's outputs, so that `Model` can call any of them the same way.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from core.model import quantized


class TokenEmbedder(nnx.Module):
    """A front end: token ids [B, T] and their mask -> vectors [B, T, D] and the same mask;
    positions are added by the body."""

    def __init__(self, vocab_size: int, d_model: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=d_model**-0.5)
        self.embedding = nnx.Embed(vocab_size, d_model, embedding_init=init, rngs=rngs)
        self.embedding.embedding = quantized.TokenTable(self.embedding.embedding[...])  # int8 decoding takes it

    def __call__(self, tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        # The table's own dtype, which is the compute dtype (nnx.Embed would promote to float32).
        return quantized.take(self.embedding.embedding[...], tokens), mask


def mean_pool(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """The mean of the hidden states [B, T, D] over the real positions of `mask` [B, T] -> [B, D]
    (sentence-transformers' mean pooling)."""
    weights = mask.astype(hidden.dtype)[..., None]
    return (hidden * weights).sum(1) / jnp.maximum(weights.sum(1), 1)


class LinearProbe(abc.ABC):
    """A head whose `linear` layer a logistic-regression probe may set (`model.head_init=probe`,
    core/training/transfer.py): it says which features that layer reads and which classes they have."""

    linear: nnx.Linear

    @abc.abstractmethod
    def probe_rows(self, hidden: jax.Array, mask: jax.Array, batch: dict) -> tuple[jax.Array, ...]:
        """What a linear probe of this head fits: the features [B, D] its linear layer reads,
        their class ids [B] and weights [B]."""


class PooledClassifier(nnx.Module, LinearProbe):
    """Masked mean of the hidden states, then a linear layer: -> logits [B, C]."""

    def __init__(self, d_model: int, num_classes: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(d_model, num_classes, rngs=rngs)

    def __call__(self, hidden: jax.Array, mask: jax.Array) -> jax.Array:
        return self.linear(mean_pool(hidden, mask)).astype(jnp.float32)

    def probe_rows(self, hidden: jax.Array, mask: jax.Array, batch: dict) -> tuple[jax.Array, ...]:
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
    [B, T, V] logits; decoding asks for `logits()` where it needs them. A `shortlist` (ascending
    ids) limits the output to those rows of the matrix: only they are multiplied, and every
    other id's logit is -inf (`TiedOutput`).
    """

    hidden: jax.Array
    weight: jax.Array
    shortlist: jax.Array | None = None

    def rows(self) -> jax.Array:
        """The rows of the output matrix that the output covers: [V, D], or [S, D] with a shortlist."""
        return self.weight if self.shortlist is None else self.weight[self.shortlist]

    def logits(self) -> jax.Array:
        rows = self.rows()
        if isinstance(rows, quantized.Quantized):  # int8 decoding weights
            logits = quantized.product(self.hidden.astype(jnp.float32), rows)
        else:
            logits = jnp.einsum("BTD,VD->BTV", self.hidden, rows.astype(self.hidden.dtype)).astype(jnp.float32)
        if self.shortlist is None:
            return logits
        full = jnp.full((*logits.shape[:-1], self.weight.shape[0]), -jnp.inf, jnp.float32)
        return full.at[..., self.shortlist].set(logits)

    def predictions(self, chunk: int = 256) -> jax.Array:
        """The likeliest id at each position [B, T], `chunk` positions at a time: a metric's
        argmax never holds the [B, T, V] logits whole (2 GB for 8 rows of 256 at Gemma's vocabulary)."""
        *lead, D = self.hidden.shape
        flat = self.hidden.reshape(-1, D)
        rows = flat.shape[0]
        chunk = min(chunk, rows)
        chunks = jnp.pad(flat, ((0, (-rows) % chunk), (0, 0))).reshape(-1, chunk, D)
        weight = self.rows().astype(self.hidden.dtype)
        ids = jax.lax.map(lambda hidden: jnp.argmax(hidden @ weight.T, axis=-1), chunks).reshape(-1)[:rows]
        return (ids if self.shortlist is None else self.shortlist[ids]).reshape(lead)

    def rows_of(self, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each target id's row in `rows()`, and whether the output covers it at all (a
        shortlist may not: such a target can be neither predicted nor scored)."""
        if self.shortlist is None:
            return targets, jnp.ones(targets.shape, bool)
        found = jnp.clip(jnp.searchsorted(self.shortlist, targets), 0, self.shortlist.shape[0] - 1)
        return found, self.shortlist[found] == targets


class TiedOutput(nnx.Module):
    """Output over a vocabulary through the input embedding table itself: -> `Projection`.
    `shortlist`: the ids the output covers (None: all of them), a fixed part of the model."""

    # Whether an encoder-decoder hands this head the source (`source`, then a third argument).
    reads_source: ClassVar[bool] = False

    def __init__(self, embedder: TokenEmbedder, shortlist: Sequence[int] | None = None):
        self.embedder = embedder
        # A tuple: a static part of the module, compiled into the programs as a constant.
        self.shortlist = None if shortlist is None else tuple(sorted({int(i) for i in shortlist}))

    def __call__(self, hidden: jax.Array, mask: jax.Array) -> Projection:
        shortlist = None if self.shortlist is None else jnp.asarray(self.shortlist, jnp.int32)
        return Projection(hidden, self.embedder.embedding.embedding[...], shortlist)


class Source(NamedTuple):
    """What a `CopyOutput` reads of an encoder-decoder's source: its copy keys [B, S, D] (the
    memory projected once per source), the memory's mask [B, S] and the source's token ids
    [B, S], in the target vocabulary."""

    keys: jax.Array
    mask: jax.Array
    tokens: jax.Array


class CopyProjection(NamedTuple):
    """A `CopyOutput`'s parts, not yet mixed over the vocabulary: the decoder states [B, T, D],
    the output table [V, D], the gate's logits [B, T], the copy attention [B, T, S] and the
    source's token ids [B, S] and mask [B, S].

    Its loss (`losses.copy_cross_entropy`) needs only the targets' probabilities and never forms
    the mixed [B, T, V] distribution; decoding asks for `logits()`, the mixture's
    log-probabilities (a softmax gives them back unchanged).
    """

    hidden: jax.Array
    weight: jax.Array
    gate: jax.Array
    attention: jax.Array
    tokens: jax.Array
    mask: jax.Array

    def logits(self) -> jax.Array:
        generated = jax.nn.log_softmax(Projection(self.hidden, self.weight).logits(), axis=-1)
        # Attention on each source position, summed per vocabulary id: a scatter-add of S columns
        # per row, not a product with a [B, S, V] one-hot (which a decode step would rebuild).
        vocabulary = self.weight.shape[0]
        copied = jax.vmap(lambda weights, ids: jnp.zeros((weights.shape[0], vocabulary)).at[:, ids].add(weights))(
            self.attention, self.tokens
        )
        return mix(self.gate[..., None], generated, copied)

    def predictions(self) -> jax.Array:
        return self.logits().argmax(-1)


def mix(gate: jax.Array, generated: jax.Array, copied: jax.Array) -> jax.Array:
    """log(g p + (1 - g) c) of a pointer-generator, from the gate's logits, log p and c (broadcast
    together); c is 0 for ids not in the source, whose log is then floored."""
    return jnp.logaddexp(
        jax.nn.log_sigmoid(gate) + generated, jax.nn.log_sigmoid(-gate) + jnp.log(jnp.maximum(copied, 1e-30))
    )


class CopyOutput(nnx.Module):
    """A pointer-generator output (See et al. 2017, "Get to the point") over a vocabulary that
    source and target share: -> `CopyProjection`.

    At each target position a gate g = sigmoid(w . h + b) mixes the tied output's softmax with a
    copy distribution: one attention head from the decoder state over the memory, whose weights
    go to the source tokens at the attended positions. P(y) = g softmax(h E^T)_y + (1 - g) sum of
    the attention on the source positions holding y. A word the model can read in the source (a
    name, a dictionary gloss) is then one attention away, not a row of the output table to learn.
    """

    reads_source: ClassVar[bool] = True

    def __init__(self, embedder: TokenEmbedder, d_model: int, *, rngs: nnx.Rngs):
        self.embedder = embedder
        self.query = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.key = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.gate = nnx.Linear(d_model, 1, rngs=rngs)

    def source(self, memory: jax.Array, mask: jax.Array, tokens: jax.Array) -> Source:
        """The source as this head reads it; computed once per source when decoding."""
        return Source(self.key(memory), mask, tokens)

    def __call__(self, hidden: jax.Array, mask: jax.Array, source: Source) -> CopyProjection:
        scores = jnp.einsum("BTD,BSD->BTS", self.query(hidden), source.keys).astype(jnp.float32)
        scores = jnp.where(source.mask[:, None, :], scores * hidden.shape[-1] ** -0.5, -1e9)
        return CopyProjection(
            hidden,
            self.embedder.embedding.embedding[...],
            self.gate(hidden)[..., 0].astype(jnp.float32),
            jax.nn.softmax(scores, axis=-1),
            source.tokens,
            source.mask,
        )
