"""Prompts kept after their requests end, so that a request that begins alike skips their prefill.

A served model sees the same beginnings again and again: a system prompt, a few-shot preamble,
a conversation that grows by a turn. When a slot's request ends, the keys and values of its
prompt are copied from the slot's cache row into one of `rows` rows kept aside (the least
recently used one; `keep`). A new request then looks for the kept prompt that shares the longest
beginning with its own (`find`): the slot it takes gets that row (`restore`), and only the rest of
its prompt is prefilled, after the positions it shares (`core.generation.slots`). This is
llama-server's prompt cache (`cache_prompt`, slots picked by the longest common prefix) for a
cache whose rows are a batch.

The kept rows are apart from the slots' cache, so that a decode step reads the slots' rows as it
did (a step over part of a cache copies that part out and back). A sliding-window layer keeps a
ring of its window's latest positions, which later positions overwrite: a prompt is kept there
only while all that its request wrote fits the window. Keys and values depend on the LoRA
adapter a request decodes through (`core.model.lora.stacked`): a kept prompt serves requests of
its own adapter alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from core.model.cache import Cache

MIN_REUSE = 16  # tokens in common below which a prefill is cheaper than the copy


def _row_into(into, source, src, dst):
    """Every layer's row `src` of `source` copied to row `dst` of `into` (its buffers donated)."""
    return jax.tree.map(
        lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(b, src, 1, axis=0), dst, 0),
        into,
        source,
    )


class PromptCache:
    """`rows` rows of keys and values shaped as a cache's, holding ended requests' prompts."""

    def __init__(self, rows: int, cache: Cache, window: int | None):
        """`cache`: the slots' cache, whose layers the kept rows copy; `window`: the smallest
        sliding window of the model's layers (None: every layer sees the whole prefix)."""
        self.rows, self.window = rows, window
        # Placed as the cache is (a copy compiled for one placement would compile again for another).
        self.layers = jax.tree.map(
            lambda a: jax.device_put(np.zeros((rows, *a.shape[1:]), a.dtype), a.sharding), cache.layers
        )
        self.prompts: list[tuple[int, ...]] = [()] * rows
        self.adapters = [0] * rows  # the adapter each kept prompt was read through
        self.used = np.zeros(rows, np.int64)  # when each row was last kept or found, for the LRU
        self.clock = 0
        self._copy = jax.jit(_row_into, donate_argnums=0)

    def find(self, prompt: Sequence[int], adapter: int = 0) -> tuple[int, int]:
        """The kept row (of `adapter`) sharing the longest beginning with `prompt` and the tokens
        it shares (at most all but the prompt's last, whose logits the prefill gives); (-1, 0)
        below MIN_REUSE."""
        best, found = -1, 0
        for row, kept in enumerate(self.prompts):
            shared = _common(kept, prompt, len(prompt) - 1) if self.adapters[row] == adapter else 0
            if shared > found:
                best, found = row, shared
        if found < MIN_REUSE:
            return -1, 0
        self.clock += 1
        self.used[best] = self.clock
        return best, found

    def restore(self, cache: Cache, row: int, slot: int) -> Cache:
        """`cache` with kept row `row` copied into slot `slot` (its positions past the shared
        ones are then out of sight: the prefill sets the slot's length)."""
        return cache._replace(layers=self._copy(cache.layers, self.layers, np.int32(row), np.int32(slot)))

    def keep(self, cache: Cache, slot: int, prompt: Sequence[int], written: int, adapter: int = 0) -> None:
        """Keeps the prompt of the request that ended in `slot` (read through `adapter`), its
        keys and values in the least recently used row, unless it is short, kept already, or (in
        a sliding window) its request wrote `written` positions past the window."""
        prompt = tuple(prompt)
        if len(prompt) < MIN_REUSE or (self.window is not None and written > self.window):
            return
        self.clock += 1
        same = [row for row, kept in enumerate(self.prompts) if kept == prompt and self.adapters[row] == adapter]
        if same:
            self.used[same[0]] = self.clock
            return
        row = int(np.argmin(self.used))
        self.layers = self._copy(self.layers, cache.layers, np.int32(slot), np.int32(row))
        self.prompts[row], self.adapters[row], self.used[row] = prompt, adapter, self.clock

    def warm_up(self, cache: Cache) -> Cache:
        """Compiles both copies (leaving nothing kept) -> the cache, its slot 0 overwritten."""
        self.layers = self._copy(self.layers, cache.layers, np.int32(0), np.int32(0))
        return self.restore(cache, 0, 0)


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit`."""
    count = 0
    for x, y in zip(a, b):
        if x != y or count >= limit:
            break
        count += 1
    return count
