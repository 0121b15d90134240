"""The key/value cache that a causal body decodes with, and how a chunk of keys is written into it.

A decode step is a pure function of (parameters, cache, tokens): the cache is a plain pytree of
preallocated arrays (`Cache`: one `KeyValues` per layer, each row's length and, for a decoder with
cross-attention, the encoder's `Memory`), passed in and returned, so that a `jax.lax.while_loop`
or a donated step updates it in place. `core.transformer` fills it (`prefill`, `extend`) and
`core.attention` reads it; the layout below is chosen for those reads.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KeyValues(NamedTuple):
    """One layer's cache: keys (after rotary) [B, K, S, H] and values [B, K, H, S]; slot s holds
    position s.

    Laid out so that a decode step's attention reads the cache as it lies, as two matrix-vector
    products per head that each run along rows of memory: with [B, S, K, H] XLA copied both
    into these orders at every step and layer, which halved decoding speed at batch 8.
    """

    keys: jax.Array
    values: jax.Array


def write(cache: KeyValues, k: jax.Array, v: jax.Array, positions: jax.Array | None) -> KeyValues:
    """`cache` with keys and values k, v [B, T, K, H] in the slots of their `positions` [B, T]
    (None: the first T slots, as a prefill writes them)."""
    keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 3, 1)  # [B, K, T, H], [B, K, H, T]
    if positions is None:
        return KeyValues(
            jax.lax.dynamic_update_slice(cache.keys, keys.astype(cache.keys.dtype), (0, 0, 0, 0)),
            jax.lax.dynamic_update_slice(cache.values, values.astype(cache.values.dtype), (0, 0, 0, 0)),
        )
    # Each row writes at its own positions: a scatter, in place inside a loop or a donated step.
    rows = jnp.arange(k.shape[0])[:, None]
    return KeyValues(
        cache.keys.at[rows, :, positions].set(k.astype(cache.keys.dtype)),
        cache.values.at[rows, :, :, positions].set(v.astype(cache.values.dtype)),
    )


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
