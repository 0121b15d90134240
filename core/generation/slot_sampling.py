"""How each slot of the engine (`core.generation.slots`) picks its next token, on the device,
with its own settings, and the log-probabilities a request may ask for beside it.

Each slot samples with its own settings (temperature, nucleus, seed): greedy where the
temperature is 0, else a draw from the softmax of the logits over the temperature, cut to the
nucleus of `top_p`, with the key folded from the request's seed and its token count, so a
request gives the same tokens whichever slot it lands in and whatever runs beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def pick(logits, temperature, top_p, seed, count, held, wants):
    """`_choose`'s tokens [S] and, for the rows that `wants` them, their log-probabilities under
    the distribution each was drawn from (its temperature and nucleus; the model's own at
    temperature 0): the chosen token's [S] and the TOP most likely ids [S, TOP] with theirs.
    Only computed when some row asks (a real branch on the CPU, as `_choose`'s)."""
    logits = logits.at[jnp.arange(logits.shape[0])[:, None], held].set(-jnp.inf, mode="drop")
    token = _choose(logits, temperature, top_p, seed, count)

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
    return token, jax.lax.cond(jnp.any(wants), scored, lambda: none)


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
