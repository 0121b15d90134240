"""The key/value cache that a causal body decodes with, and how a chunk of keys is written into it.

A decode step is a pure function of (parameters, cache, tokens): the cache is a plain pytree of
preallocated arrays (`Cache`: one `KeyValues` per layer, each row's length and, for a decoder with
cross-attention, the encoder's `Memory`), passed in and returned, so that a `jax.lax.while_loop`
or a donated step updates it in place. `core.model.transformer` fills it (`prefill`, `extend`) and
`core.model.attention` reads it; the layout below is chosen for those reads.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KeyValues(NamedTuple):
    """One layer's cache: keys (after rotary) [B, K, S, H] and values [B, K, H, S]; slot s holds
    the latest position p with p mod S = s. A layer that sees the whole prefix has a slot for every
    position of the context (slot s, position s); a sliding-window layer has only as many slots as
    its window, a ring that each new position overwrites the oldest slot of (`held`).

    Laid out so that a decode step's attention reads the cache as it lies, as two matrix-vector
    products per head that each run along rows of memory: with [B, S, K, H] XLA copied both
    into these orders at every step and layer, which halved decoding speed at batch 8.

    `first`: the row that a chunk's first row reads and writes (None: row 0), so that a slot
    engine fills one slot's row where it lies (`core.generation.slot_programs`): a row copied out
    of the cache and back cost an `extend` of 64 tokens about as much as its products.
    """

    keys: jax.Array
    values: jax.Array
    first: jax.Array | None = None

    def rows(self, count: int) -> KeyValues:
        """The `count` rows from `first` on, as a chunk of as many rows reads them."""
        if self.first is None:
            return KeyValues(self.keys[:count], self.values[:count])
        return KeyValues(*(jax.lax.dynamic_slice_in_dim(a, self.first, count, axis=0) for a in self[:2]))


def write(cache: KeyValues, k: jax.Array, v: jax.Array, positions: jax.Array | None, lengths: jax.Array) -> KeyValues:
    """`cache` with keys and values k, v [B, T, K, H] at `positions` [B, T] (None: 0..T-1, as a
    prefill writes them) in slots p mod S of its B rows from `first`; `lengths` [B] is each row's
    length once written. Only the positions a later query can see are written: none at or past a
    row's length (a prefill's padding) and none S or more behind it (a ring's older positions,
    which the newer ones take the slots of)."""
    keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 3, 1)  # [B, K, T, H], [B, K, H, T]
    S, T = cache.keys.shape[2], k.shape[1]
    first = 0 if cache.first is None else cache.first
    if positions is None and T <= S:
        # A prefill that fits: one slice (padding lands past the row's length, where nothing reads it).
        return KeyValues(
            jax.lax.dynamic_update_slice(cache.keys, keys.astype(cache.keys.dtype), (first, 0, 0, 0)),
            jax.lax.dynamic_update_slice(cache.values, values.astype(cache.values.dtype), (first, 0, 0, 0)),
            cache.first,
        )
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T), k.shape[:2])
    # Each row writes at its own slots: a scatter, in place inside a loop or a donated step. Two
    # positions of a row never share a slot, so the order of the writes does not matter.
    kept = (positions < lengths[:, None]) & (positions >= lengths[:, None] - S)
    slots = jnp.where(kept, positions % S, S)  # S: out of range, dropped
    rows = first + jnp.arange(k.shape[0])[:, None]
    return KeyValues(
        cache.keys.at[rows, :, slots].set(k.astype(cache.keys.dtype), mode="drop"),
        cache.values.at[rows, :, :, slots].set(v.astype(cache.values.dtype), mode="drop"),
        cache.first,
    )


def held(lengths: jax.Array, slots: int) -> jax.Array:
    """The position each of `slots` slots holds in rows of `lengths` [B] -> [B, S]: the latest
    p < length with p mod S = s; negative where no position has been written there yet."""
    last = lengths[:, None] - 1
    return last - jnp.mod(last - jnp.arange(slots)[None, :], slots)


class Memory(NamedTuple):
    """An encoder's outputs as a decoder's cross-attention reads them: every layer's keys and
    values of the memory (`KeyValues`, slot s holding source position s) and its mask [B, S]."""

    layers: tuple[KeyValues, ...]
    mask: jax.Array


class Cache(NamedTuple):
    """Every layer's `KeyValues` and `lengths` [B]: the positions each row holds so far; for a
    decoder with cross-attention, also the `Memory` it attends to (None: a decoder-only body,
    whose cache then holds nothing more than before)."""

    layers: tuple[KeyValues, ...]
    lengths: jax.Array
    memory: Memory | None = None
