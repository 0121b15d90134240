"""Beam search over a decode step, with GNMT length normalisation.

Written against the decode-step interface of `core.generation.sampling` (step(state, tokens [B]) -> (logits
[B, V], state), every state leaf batch-leading), so that the decoder-only model and a later
encoder-decoder share it. The W beams of each row are a batch dimension: the state is repeated
to B * W rows once, and after every step each beam's state (its key/value cache) is gathered
from its parent's. One `jax.lax.while_loop` runs to `max_new_tokens`, or until no live beam can
still beat the worst of a row's W finished ones (with `early_stopping`: until every row has W).

A sequence scores (log P(y) + r |y|') / ((5 + |y|) / 6) ** alpha (Wu et al., 2016, "Google's
neural machine translation system"), |y| counting the new tokens and its stop token, |y|' those
that are not stop tokens, r the word reward; alpha = 0 ranks by log-probability alone. Repeated
n-grams may be banned (`no_repeat_ngram`; see core/generation/penalties.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from core.errors import UserError
from core.generation import penalties
from core.generation.timestamps import Timestamps
from core.generation.timestamps import rules as timestamp_rules


class Beams(NamedTuple):
    """tokens [B, W, M] (0 past each length), lengths [B, W] and scores [B, W], best first; an
    encoder-decoder's probed token's probability [B] (see `core.generation.sampling.Generation`), or None."""

    tokens: Any
    lengths: Any
    scores: Any
    probe: Any = None


def gnmt_penalty(length, alpha: float):
    """((5 + length) / 6) ** alpha: what a log-probability is divided by."""
    return ((5.0 + length) / 6.0) ** alpha


def beam_search(step, state, logits: jax.Array, **settings) -> Beams:
    """The `beam_size` best continuations of each row, from `state` and the `logits` [B, V] for
    its first new token, in one loop; `settings` are `searcher`'s. A search the host watches
    runs `start`, `run` and `finish` of the same `searcher` a chunk of steps a call
    (`core.generation.chunks.drive_search`)."""
    search = searcher(step, logits.shape, **settings)
    return search.finish(search.run(search.start(state, logits), search.max_new_tokens)[0])


def searcher(
    step,
    shape: tuple[int, int | None],
    *,
    beam_size: int,
    max_new_tokens: int,
    stop_tokens: tuple[int, ...] = (),
    length_penalty: float = 0.6,
    no_repeat_ngram: int = 0,
    word_reward: float = 0.0,
    early_stopping: bool = False,
    timestamps: Timestamps | None = None,
) -> _Search:
    """A search over logits of `shape` [B, V] (V None: checked before). A beam ends at its first stop token; beams still
    alive after `max_new_tokens` come after every ended one, filling the places that no ended
    beam took. With `early_stopping` (Whisper's and CTranslate2's search) a row's output is its
    first W ended beams; without, the search goes on while a live beam could still outscore one.
    With `timestamps`, every beam keeps to Whisper's timestamp rules (`core.generation.timestamps`)."""
    B, V = shape
    W, alpha = beam_size, length_penalty
    if V is not None and not 2 * W <= V:
        raise UserError(f"beam_size={W} needs a vocabulary of at least {2 * W} tokens, not {V}.")
    if alpha < 0:
        raise UserError(f"length_penalty={alpha} must be >= 0.")
    return _Search(
        step=step,
        rows=B,
        beams=W,
        max_new_tokens=max_new_tokens,
        alpha=alpha,
        stops=jnp.asarray(stop_tokens, jnp.int32),
        offsets=(jnp.arange(B) * W)[:, None],
        no_repeat_ngram=no_repeat_ngram,
        word_reward=word_reward,
        early_stopping=early_stopping,
        timestamps=timestamps,
    )


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
    alpha: float
    stops: jax.Array
    offsets: jax.Array
    no_repeat_ngram: int
    word_reward: float
    early_stopping: bool
    timestamps: Timestamps | None

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

    def run(self, carry, until):
        """The carry after the steps up to `until` (exclusive) or the search's end, and whether
        it would go on."""
        carry = jax.lax.while_loop(lambda c: self.running(c) & (c[0] < until), self.body, carry)
        return carry, self.running(carry)

    def finish(self, carry) -> Beams:
        """The W best beams of each row from the loop's last carry."""
        B, W, alpha = self.rows, self.beams, self.alpha
        index, (alive_tokens, alive_scores), finished, _, _ = carry
        # Beams cut at max_new_tokens only fill the places of a row that fewer than W ended beams
        # took (as CTranslate2 and Whisper rank them): a cut beam is not a whole output, and one that
        # loops ("... ... ...") at log-probabilities near 0 would otherwise outscore every ended one.
        cut = (alive_tokens, jnp.full((B, W), index, jnp.int32), alive_scores / gnmt_penalty(index, alpha))
        tokens, lengths, scores = (jnp.concatenate(parts, axis=1) for parts in zip(finished, cut))
        ended = jnp.arange(2 * W)[None, :] < W
        ranked = jnp.where(ended & jnp.isfinite(scores), 0, 1)  # ended first, then cut, then empty
        order = jnp.lexsort((-scores, ranked), axis=-1)[:, :W]
        pick = functools.partial(jnp.take_along_axis, indices=order, axis=1)
        return Beams(jnp.take_along_axis(tokens, order[:, :, None], axis=1), pick(lengths), pick(scores))

    def running(self, carry):
        M, alpha = self.max_new_tokens, self.alpha
        index, (_, alive_scores), (_, _, finished_scores) = carry[:3]
        if self.early_stopping:
            return (index < M) & ~jnp.all(jnp.isfinite(finished_scores[:, -1]))
        # Log-probabilities only fall, the word reward adds at most r per token left and the
        # penalty lies between its values now (what an alive beam scores if the loop stops
        # here) and at M: an upper bound.
        most = alive_scores[:, 0] + max(self.word_reward, 0.0) * (M - index)
        best_alive = most / jnp.where(most < 0, gnmt_penalty(M, alpha), gnmt_penalty(index, alpha))
        return (index < M) & ~jnp.all(finished_scores[:, -1] >= best_alive)

    def select(self, index, logits, alive, finished):
        """Extends the alive beams by one token (the `index`-th) and sorts the candidates into
        alive and finished; -> alive, finished, flat parent of each new beam [B * W], its token."""
        B, W, M, V = self.rows, self.beams, self.max_new_tokens, logits.shape[-1]
        alive_tokens, alive_scores = alive
        if self.timestamps is not None:  # on the logits: the allowed tokens' probabilities sum to 1
            logits = timestamp_rules(logits, alive_tokens.reshape(B * W, M), index, self.timestamps)
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
        if self.early_stopping:  # a row's first W ended beams are its output
            ended = jnp.where(jnp.isfinite(finished[2][:, -1:]), -jnp.inf, ended)
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
