"""What a slot engine holds for its life, reckoned before its cache is allocated: the weights,
the slots' cache and the kept prompts' rows (`core.generation.prompt_cache`), all allocated once
at start-up. A server states it per model and refuses, with the knobs, a cache that cannot fit
the memory available (`core.training.memory.available`: the device's, or the host's on a CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from core.errors import UserError
from core.training.memory import GB, available


@dataclass(frozen=True)
class Held:
    """Bytes an engine holds: its `weights`, the slots' `cache` and the `kept` prompts' rows."""

    weights: int
    cache: int
    kept: int

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.kept

    def describe(self) -> str:
        kept = f", {size(self.kept)} of kept prompts" if self.kept else ""
        return f"{size(self.weights)} of weights, {size(self.cache)} of cache{kept}"


def size(bytes_: int) -> str:
    """Bytes in GB to two places, or in MB below a tenth of a GB."""
    return f"{bytes_ / GB:.2f} GB" if bytes_ >= GB / 10 else f"{bytes_ / 2**20:.1f} MB"


def nbytes(tree: Any) -> int:
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def plan(model, weights: Any, slots: int, kept_rows: int, context: int, cache_dtype) -> Held:
    """What an engine of `slots` rows of `context` positions and `kept_rows` kept prompts holds
    beside its loaded `weights`; refused when its cache cannot fit what is still available."""
    row = nbytes(jax.eval_shape(lambda: model.body.init_cache(1, context, cache_dtype)).layers)
    held = Held(nbytes(weights), row * slots, row * kept_rows)
    free, where = available()
    if free is not None and held.cache + held.kept > free:
        raise UserError(
            f"{slots} slots of {context} positions and {kept_rows} kept prompts need "
            f"{size(held.cache + held.kept)} of cache, more than the {size(int(free))} available on "
            f"{where} beside the {size(held.weights)} of weights loaded: serve fewer slots (--max-batch), "
            "a shorter --context or fewer kept prompts (--prompt-cache)."
        )
    return held
