"""Beam search over a decode step, with GNMT length normalisation.

Written against the decode-step interface of `core.generate` (step(state, tokens [B]) -> (logits
[B, V], state), every state leaf batch-leading), so that the decoder-only model and a later
encoder-decoder share it. The W beams of each row are a batch dimension: the state is repeated
to B * W rows once, and after every step each beam's state (its key/value cache) is gathered
from its parent's. One `jax.lax.while_loop` runs to `max_new_tokens`, or until no live beam can
still beat the worst of a row's W finished ones.

A sequence scores (log P(y) + r |y|') / ((5 + |y|) / 6) ** alpha (Wu et al., 2016, "Google's
neural machine translation system"), |y| counting the new tokens and its stop token, |y|' those
that are not stop tokens, r the word reward; alpha = 0 ranks by log-probability alone. Repeated
n-grams may be banned (`no_repeat_ngram`; see core/penalties.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from core import penalties
from core.errors import UserError


class Beams(NamedTuple):
    """tokens [B, W, M] (0 past each length), lengths [B, W] and scores [B, W], best first."""

    tokens: Any
    lengths: Any
    scores: Any


def gnmt_penalty(length, alpha: float):
    """((5 + length) / 6) ** alpha: what a log-probability is divided by."""
    return ((5.0 + length) / 6.0) ** alpha


def beam_search(
    step,
    state,
    logits: jax.Array,
    *,
    beam_size: int,
    max_new_tokens: int,
    stop_tokens: tuple[int, ...] = (),
    length_penalty: float = 0.6,
    no_repeat_ngram: int = 0,
    word_reward: float = 0.0,
) -> Beams:
    """The `beam_size` best continuations of each row, from `state` and the `logits` [B, V] for
    its first new token. A beam ends at its first stop token; beams still alive after
    `max_new_tokens` compete with the finished ones as they are."""
    B, V = logits.shape
    W, M, alpha = beam_size, max_new_tokens, length_penalty
    if not 2 * W <= V:
        raise UserError(f"beam_size={W} needs a vocabulary of at least {2 * W} tokens, not {V}.")
    if alpha < 0:
        raise UserError(f"length_penalty={alpha} must be >= 0.")
    search = _Search(
        step=step,
        rows=B,
        beams=W,
        max_new_tokens=M,
        vocabulary=V,
        alpha=alpha,
        stops=jnp.asarray(stop_tokens, jnp.int32),
        offsets=(jnp.arange(B) * W)[:, None],
        no_repeat_ngram=no_repeat_ngram,
        word_reward=word_reward,
    )
    carry = search.start(state, logits)
    index, (alive_tokens, alive_scores), finished, _, _ = jax.lax.while_loop(search.running, search.body, carry)
    lengths = jnp.full((B, W), index, jnp.int32)
    tokens, lengths, scores = _best(W, finished, (alive_tokens, lengths, alive_scores / gnmt_penalty(index, alpha)))
    return Beams(tokens, lengths, scores)


@dataclass(frozen=True, eq=False)
class _Search:
    """One search over B `rows` of W `beams`, at most M new tokens from a vocabulary of V.

    Its loop carries (index, alive, finished, last tokens [B * W], state): alive = (tokens
    [B, W, M], log-probabilities [B, W]) and finished = (tokens, lengths, normalised scores) of
    the W best ended beams of each row, both best first. `offsets` [B, 1] turn a row's beam
    into its flat row of the state."""

    step: Any
    rows: int
    beams: int
    max_new_tokens: int
    vocabulary: int
    alpha: float
    stops: jax.Array
    offsets: jax.Array
    no_repeat_ngram: int
    word_reward: float

    def start(self, state, logits):
        """The carry after the first new token, from the prompt's `state` and `logits` [B, V]."""
        B, W, M = self.rows, self.beams, self.max_new_tokens
        # Every beam starts as a copy of its row; only the first is alive, so that the first step
        # does not pick the same token W times.
        state = jax.tree.map(lambda x: jnp.repeat(x, W, axis=0), state)
        alive = (jnp.zeros((B, W, M), jnp.int32), jnp.where(jnp.arange(W) == 0, 0.0, -jnp.inf)[None].repeat(B, 0))
        finished = (jnp.zeros((B, W, M), jnp.int32), jnp.zeros((B, W), jnp.int32), jnp.full((B, W), -jnp.inf))
        alive, finished, parents, last = self.select(0, jnp.repeat(logits, W, axis=0), alive, finished)
        return jnp.int32(1), alive, finished, last, _reorder(state, parents)

    def body(self, carry):
        index, alive, finished, last, state = carry
        logits, state = self.step(state, last)
        alive, finished, parents, last = self.select(index, logits, alive, finished)
        return index + 1, alive, finished, last, _reorder(state, parents)

    def running(self, carry):
        M, alpha = self.max_new_tokens, self.alpha
        index, (_, alive_scores), (_, _, finished_scores) = carry[:3]
        # Log-probabilities only fall, the word reward adds at most r per token left and the
        # penalty lies between its values now (what an alive beam scores if the loop stops
        # here) and at M: an upper bound.
        most = alive_scores[:, 0] + max(self.word_reward, 0.0) * (M - index)
        best_alive = most / jnp.where(most < 0, gnmt_penalty(M, alpha), gnmt_penalty(index, alpha))
        return (index < M) & ~jnp.all(finished_scores[:, -1] >= best_alive)

    def select(self, index, logits, alive, finished):
        """Extends the alive beams by one token (the `index`-th) and sorts the candidates into
        alive and finished; -> alive, finished, flat parent of each new beam [B * W], its token."""
        B, W, M, V = self.rows, self.beams, self.max_new_tokens, self.vocabulary
        alive_tokens, alive_scores = alive
        log_probs = penalties.adjust(
            jax.nn.log_softmax(logits, axis=-1),
            alive_tokens.reshape(B * W, M),
            index,
            self.stops,
            self.no_repeat_ngram,
            self.word_reward,
        ).reshape(B, W, V)
        candidates = (alive_scores[:, :, None] + log_probs).reshape(B, W * V)
        # 2W candidates: even if W of them stop, W others stay alive.
        scores, chosen = jax.lax.top_k(candidates, 2 * W)  # [B, 2W]
        parents, tokens = chosen // V, (chosen % V).astype(jnp.int32)
        sequences = jnp.take_along_axis(alive_tokens, parents[:, :, None], axis=1)  # [B, 2W, M]
        sequences = jax.lax.dynamic_update_slice(sequences, tokens[:, :, None], (0, 0, index))
        stopped = jnp.isin(tokens, self.stops)
        ended = jnp.where(stopped, scores / gnmt_penalty(index + 1, self.alpha), -jnp.inf)
        finished = _best(W, finished, (sequences, jnp.full((B, 2 * W), index + 1, jnp.int32), ended))
        alive_scores, order = jax.lax.top_k(jnp.where(stopped, -jnp.inf, scores), W)
        alive = (jnp.take_along_axis(sequences, order[:, :, None], axis=1), alive_scores)
        parents = (jnp.take_along_axis(parents, order, axis=1) + self.offsets).reshape(-1)
        return alive, finished, parents, jnp.take_along_axis(tokens, order, axis=1).reshape(-1)


def _reorder(state, parents):
    """Each new beam's state: its parent's, from the flat rows `parents` [B * W]."""
    return jax.tree.map(lambda x: x[parents], state)


def _best(count, *groups):
    """The `count` best of the (tokens [B, C, M], lengths [B, C], scores [B, C]) groups together."""
    tokens, lengths, scores = (jnp.concatenate(parts, axis=1) for parts in zip(*groups))
    scores, order = jax.lax.top_k(scores, count)
    return jnp.take_along_axis(tokens, order[:, :, None], axis=1), jnp.take_along_axis(lengths, order, axis=1), scores
