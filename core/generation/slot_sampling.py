"""How each slot of the engine (`core.generation.slots`) picks its next token, on the device,
with its own settings, and the log-probabilities a request may ask for beside it.

Each slot samples with its own settings (temperature, nucleus, seed): greedy where the
temperature is 0, else a draw from the softmax of the logits over the temperature, cut to the
nucleus of `top_p`, with the key folded from the request's seed and its token count, so a
request gives the same tokens whichever slot it lands in and whatever runs beside it.

Before it chooses, a slot's logits are steered as OpenAI's API defines it: its request's
`logit_bias` added, and for each token it has generated so far `frequency_penalty` subtracted
once per time and `presence_penalty` once. The engine keeps each slot's bias and token counts
on the device (`Steering`), so a step reads no history from the host. A slot whose request
follows a grammar (`core.generation.grammar`) then draws only among the ids its mask allows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from core.generation.sampling import filter_logits

# The most stop ids a request with `min_new` may hold back (a tokenizer has a few: end of text,
# end of turn), and the id that fills the rest of its row, out of any vocabulary's range.
HELD = 8
NO_ID = 2**31 - 1
# The most alternatives a request's log-probabilities may list (OpenAI's top_logprobs bound).
TOP = 20
# The most token ids a request's logit_bias may name (OpenAI's bound).
BIASED = 300


class Settings(NamedTuple):
    """Each row's sampling settings as a compiled step takes them: arrays of one value per row
    ([S]; `held` [S, HELD])."""

    temperature: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray
    count: np.ndarray  # the tokens the row's request has had, which folds its sampling key
    held: np.ndarray  # the ids it may not draw next (`held_ids`)
    wants: np.ndarray  # whether it asks for log-probabilities
    presence: np.ndarray
    frequency: np.ndarray
    steered: np.ndarray  # whether its logits are steered at all (a bias or a penalty)
    constrained: np.ndarray  # whether it follows a grammar
    allowed: np.ndarray  # [S, words]: the ids its grammar allows next, as bits (32 ids an int32)


def settings(requests: Sequence, counts: Sequence[int], words: int) -> Settings:
    """The `Settings` of `requests` (the engine's `Request`s) that have had `counts` tokens;
    `words`: the int32 words of a vocabulary's mask."""

    def each(read, dtype):
        return np.array([read(r) for r in requests], dtype)

    if any(r.constraint is not None for r in requests):
        allowed = np.full((len(requests), words), -1, np.int32)  # every bit set: anything allowed
        for row, request in enumerate(requests):
            if request.constraint is not None:
                request.constraint.fill(allowed[row])
    else:  # the usual step: no mask built on the host nor sent to the device
        allowed = _anything(len(requests), words)

    return Settings(
        temperature=each(lambda r: r.temperature, np.float32),
        top_p=each(lambda r: r.top_p, np.float32),
        seed=each(lambda r: r.seed, np.uint32),
        count=np.asarray(counts, np.int32),
        held=held_ids(requests, counts),
        wants=each(lambda r: r.logprobs is not None, bool),
        presence=each(lambda r: r.presence_penalty, np.float32),
        frequency=each(lambda r: r.frequency_penalty, np.float32),
        steered=each(lambda r: bool(r.logit_bias) or r.presence_penalty != 0 or r.frequency_penalty != 0, bool),
        constrained=each(lambda r: r.constraint is not None, bool),
        allowed=allowed,
    )


@functools.cache
def _anything(rows: int, words: int) -> jax.Array:
    """A mask allowing every id, kept on the device for the steps no grammar constrains."""
    return jnp.full((rows, words), -1, jnp.int32)


class Steering(NamedTuple):
    """Per slot, on the device: its request's logit bias [S, V] and how many times the request
    has generated each token [S, V], which its penalties weigh."""

    bias: jax.Array
    counts: jax.Array

    @classmethod
    def empty(cls, slots: int, vocab_size: int) -> Steering:
        return cls(jnp.zeros((slots, vocab_size), jnp.float32), jnp.zeros((slots, vocab_size), jnp.int32))

    def begin(self, slot, ids, values) -> Steering:
        """Row `slot` for a new request whose bias is `values` at `ids` (padded with NO_ID)."""
        row = jnp.zeros(self.bias.shape[1], jnp.float32).at[ids].set(values, mode="drop")
        return Steering(self.bias.at[slot].set(row), self.counts.at[slot].set(0))

    def tally(self, tokens, active) -> Steering:
        """Counts each active leading row's new token [R]."""
        rows = jnp.arange(tokens.shape[0])
        return self._replace(counts=self.counts.at[rows, tokens].add(active.astype(jnp.int32)))


def bias_of(request) -> tuple[np.ndarray, np.ndarray]:
    """A request's logit_bias as (ids, values) [BIASED], padded with NO_ID."""
    ids, values = np.full(BIASED, NO_ID, np.int32), np.zeros(BIASED, np.float32)
    ids[: len(request.logit_bias)] = list(request.logit_bias)
    values[: len(request.logit_bias)] = list(request.logit_bias.values())
    return ids, values


def steered(logits: jax.Array, settings: Settings, steering: Steering) -> jax.Array:
    """Logits [R, V] of the leading rows, with their bias and penalties, computed only when some
    row is steered (a row that is not has a zero bias and zero penalties: its logits unchanged)."""

    def apply():
        rows = logits.shape[0]
        counts = steering.counts[:rows].astype(logits.dtype)
        penalty = settings.frequency[:, None] * counts + settings.presence[:, None] * (counts > 0)
        return logits + steering.bias[:rows] - penalty

    return jax.lax.cond(jnp.any(settings.steered), apply, lambda: logits)


def constrained(logits: jax.Array, settings: Settings) -> jax.Array:
    """Logits [R, V] with the ids that a row's grammar does not allow at -inf, computed only
    when some row follows one (an unconstrained row's mask allows every id)."""

    def apply():
        ids = jnp.arange(logits.shape[1])
        bits = (settings.allowed[:, ids >> 5] >> (ids & 31)[None, :]) & 1
        return jnp.where(bits == 1, logits, -jnp.inf)

    return jax.lax.cond(jnp.any(settings.constrained), apply, lambda: logits)


def pick(logits: jax.Array, settings: Settings, steering: Steering):
    """`_choose`'s tokens [R] from the leading rows' logits [R, V], steered, and for the rows
    that want them their log-probabilities under the distribution each was drawn from (its
    steered logits at its temperature and nucleus): the chosen token's [R] and the TOP most
    likely ids [R, TOP] with theirs. Only computed when some row asks (a real branch on the CPU,
    as `_choose`'s)."""
    temperature, top_p = settings.temperature, settings.top_p
    logits = constrained(steered(logits, settings, steering), settings)
    logits = logits.at[jnp.arange(logits.shape[0])[:, None], settings.held].set(-jnp.inf, mode="drop")
    token = _choose(logits, temperature, top_p, settings.seed, settings.count)

    def scored():
        drawn = temperature > 0
        scaled = jnp.where(drawn[:, None], logits / jnp.maximum(temperature, 1e-6)[:, None], logits)
        scaled = filter_logits(scaled, None, jnp.where(drawn, top_p, 1.0)[:, None])
        log_probs = jax.nn.log_softmax(scaled, axis=-1)
        chosen = jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0]
        top, ids = jax.lax.top_k(log_probs, TOP)
        return chosen, ids.astype(jnp.int32), top

    rows = logits.shape[0]
    none = jnp.zeros(rows), jnp.zeros((rows, TOP), jnp.int32), jnp.zeros((rows, TOP))
    return token, jax.lax.cond(jnp.any(settings.wants), scored, lambda: none)


def _choose(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, seed: jax.Array, count: jax.Array):
    """Each row's next token from logits [S, V] and its settings [S]: greedy at temperature 0,
    else sampled in the nucleus of top_p with the key of (seed, count). (`pick` has already
    ruled out each row's held ids: its stop ids while it has fewer than `min_new` tokens.)

    The draws (random bits for every entry of the vocabulary) and the nucleus (a sort of it) cost
    more than the rest of a small model's step at a large vocabulary, so each runs only when some
    row asks for it: a real branch on the CPU, and a row's tokens never depend on whether its
    neighbours sample (top_p 1 keeps every logit, with or without the sort)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        nucleus = jnp.any((temperature > 0) & (top_p < 1))
        scaled = jax.lax.cond(nucleus, lambda: filter_logits(scaled, None, top_p[:, None]), lambda: scaled)
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed, count)
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)


def held_ids(requests: Sequence, counts: Sequence[int]) -> np.ndarray:
    """The ids each request may not draw next [len(requests), HELD]: its stop ids while it has
    fewer than `min_new` tokens."""
    held = np.full((len(requests), HELD), NO_ID, np.int32)
    for row, (request, count) in enumerate(zip(requests, counts)):
        if count < request.min_new:
            ids = sorted(request.stop_ids)
            held[row, : len(ids)] = ids
    return held


@dataclass(frozen=True)
class Scores:
    """A new token's log-probability and its most likely alternatives, (id, log-probability)
    best first, under the distribution it was drawn from."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def scored(request, chosen, ids, top) -> Scores | None:
    if request.logprobs is None:
        return None
    return Scores(float(chosen), tuple((int(i), float(p)) for i, p in zip(ids[: request.logprobs], top)))
