"""The slot engine's compiled programs (`core.generation.slots`), over one cache of `slots` rows.

- `prefill`: a prompt into a slot's row from its first position (one program per padded width);
- `extend`: up to `CHUNK` more of a prompt's tokens into a slot's row after the positions it
  holds (a kept prompt's beginning, `core.generation.prompt_cache`; one program per width of
  `EXTEND_WIDTHS`, called once per chunk);
- `begin`: a slot's first token from the logits either gives, its steering set up;
- `step`: one token for each of the leading rows (one program per count of rows).

Each runs the model through each row's LoRA adapter where the engine holds several
(`core.model.lora.per_row`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from core.generation.generate import COMPILER_OPTIONS, logits_of
from core.generation.slot_sampling import Steering, pick
from core.model import lora
from core.model.cache import Cache

CHUNK = 64  # prompt tokens an `extend` takes at most
# The widths an `extend` is compiled for: a short rest after a kept beginning (often a token or
# two: the same prompt again) pays for the tokens it has, not for CHUNK.
EXTEND_WIDTHS = (8, 16, 32, CHUNK)


class Programs:
    """The compiled programs of an engine whose model is `graphdef` (with `adapters` LoRA
    adapters stacked, 0: none) and whose cache has `slots` rows."""

    def __init__(self, graphdef, adapters: int, slots: int):
        self.graphdef, self.adapters, self.slots = graphdef, adapters, slots
        self.prefill = jax.jit(self._prefill, donate_argnums=1, compiler_options=COMPILER_OPTIONS)
        self.extend = jax.jit(self._extend, donate_argnums=1, compiler_options=COMPILER_OPTIONS)
        self.begin = jax.jit(self._begin, donate_argnums=0, compiler_options=COMPILER_OPTIONS)
        self.step = jax.jit(
            self._decode_rows, static_argnums=0, donate_argnums=(2, 3), compiler_options=COMPILER_OPTIONS
        )

    def _model(self, params, adapters):
        """The model of a program whose rows decode through adapters [B] (with `adapters`)."""
        return nnx.merge(self.graphdef, lora.per_row(params, adapters) if self.adapters else params)

    def _prefill(self, params, cache, tokens, length, slot, adapter):
        """Prompt tokens [1, W] (length real ones, through adapter [1]) into row `slot` of the
        cache from its first position -> (the logits [V] of the token after them, the cache)."""
        return self._fill(
            params, cache, tokens, length, slot, adapter, lambda body, x, mask, row: body.prefill(x, mask, row)
        )

    def _extend(self, params, cache, tokens, length, held, slot, adapter):
        """As `_prefill`, for tokens [1, W] (W in EXTEND_WIDTHS) after the `held` positions that
        row `slot` holds: its queries attend to those too (across the row's slots, which a whole
        prompt's own blockwise attention does at half the cost: hence a program of its own)."""

        def run(body, x, mask, row):
            return body.extend(x, row._replace(lengths=held.reshape(1)), mask)

        return self._fill(params, cache, tokens, length, slot, adapter, run)

    def _fill(self, params, cache, tokens, length, slot, adapter, run):
        """`run` on row `slot` of the cache, read and written where it lies (`KeyValues.first`)."""
        model = self._model(params, adapter)
        row = Cache(
            tuple(layer._replace(first=slot) for layer in cache.layers),
            jax.lax.dynamic_slice_in_dim(cache.lengths, slot, 1),
            cache.memory,
        )
        x, mask = model.embedder(tokens, jnp.arange(tokens.shape[1])[None, :] < length)
        hidden, row = run(model.body, x, mask, row)
        logits = logits_of(model, jnp.take_along_axis(hidden, (length - 1).reshape(1, 1, 1), axis=1))[0]
        return logits, Cache(
            tuple(layer._replace(first=None) for layer in row.layers),
            jax.lax.dynamic_update_slice_in_dim(cache.lengths, row.lengths, slot, axis=0),
            cache.memory,
        )

    def _begin(self, steering, logits, slot, sampling, bias):
        """A request's first token from its prompt's `logits` [V], its `bias` (ids, values) set
        into the slot's steering -> (the token, its scores, the steering)."""
        # The slot's steering row, moved to the front for `pick`, which steers the leading rows.
        steering = steering.begin(slot, *bias)
        first = Steering(*(jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0) for a in steering))
        token, scores = pick(logits[None], sampling, first)
        steering = steering._replace(counts=steering.counts.at[slot, token[0]].add(1))
        return token[0], jax.tree.map(lambda a: a[0], scores), steering

    def _decode_rows(self, rows, params, cache, steering, tokens, active, sampling, adapters):
        """`_decode_step` on the cache's first `rows` rows alone (every argument after the
        steering is of those rows): a step costs what its rows cost, so a few active slots in
        the lowest rows (where the engine puts requests) step at the price of a few. The layers
        read those rows where they lie and write each new key into them in place; only the
        lengths are cut and set back. (Copying the rows out and back cost a one-row step of
        SmolLM2 at 512 positions 38 against 78 ms.) The steering is read and counted by row."""
        if rows == self.slots:
            return self._decode_step(params, cache, steering, tokens, active, sampling, adapters)
        part = cache._replace(lengths=cache.lengths[:rows])
        tokens, scores, part, steering = self._decode_step(params, part, steering, tokens, active, sampling, adapters)
        return tokens, scores, part._replace(lengths=cache.lengths.at[:rows].set(part.lengths)), steering

    def _decode_step(self, params, cache, steering, tokens, active, sampling, adapters):
        """One token for every slot [S] (each through its adapter) -> (the next token of each,
        their log-probabilities where wanted, the cache, the steering with the new tokens
        counted); an idle slot computes at position 0, so its row never runs past the context."""
        model = self._model(params, adapters)
        cache = cache._replace(lengths=jnp.where(active, cache.lengths, 0))
        x, _ = model.embedder(tokens[:, None], jnp.ones((tokens.shape[0], 1), bool))
        hidden, cache = model.body.extend(x, cache)
        tokens, scores = pick(logits_of(model, hidden), sampling, steering)
        return tokens, scores, cache, steering.tally(tokens, active)
