"""LoRA training: which parameters a run trains, and adapters folded back into their weights.

With `model.lora_rank` > 0 the linear layers named in `model.lora_targets` carry adapters
(core/model/transformer.py `Dense`). A run then trains the adapters and the task's head, the parts
that the checkpoint does not fill; the front end and the body (`Model.transferred`) stay as the
checkpoint has them. `split` separates the two: the trained part is the training state (the
optimizer's moments and the checkpoints hold it alone, a few MB), the frozen part is passed to
the compiled steps beside it and never differentiated, so that no weight gradient of a frozen
matrix is computed. `merge` folds the adapters into the weights (W + A B * alpha / r), for an
export that any reader of the checkpoint's format loads.

Served, several runs' adapters share one base (`stacked`): each adapted layer holds all of them,
and each sequence of a batch takes its own (`per_row`), so requests to different adapters decode
in one step over one copy of the base weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

from core.config import ModelConfig

ADAPTERS = ("lora_a", "lora_b")


def trains(path: tuple, config: ModelConfig, frozen_parts: tuple[str, ...]) -> bool:
    """Whether the parameter at `path` (keys of the model's pure dict) is trained."""
    if not config.lora_rank:
        return True
    return path[-1] in ADAPTERS or path[0] not in frozen_parts


def split(params: dict, config: ModelConfig, frozen_parts: tuple[str, ...]) -> tuple[dict, dict]:
    """A model's pure parameter dict -> (the trained part, the frozen part), nested as it is;
    without LoRA everything trains and the frozen part is empty."""
    flat = flatten_dict(params)
    trained = {path: value for path, value in flat.items() if trains(path, config, frozen_parts)}
    frozen = {path: value for path, value in flat.items() if path not in trained}
    return unflatten_dict(trained), unflatten_dict(frozen)


def join(trained: Any, frozen: Any) -> Any:
    """The whole parameter dict from `split`'s two parts."""
    if not frozen:
        return trained
    return unflatten_dict({**flatten_dict(frozen), **flatten_dict(trained)})


def merge(model: nnx.Module) -> int:
    """Folds every adapter of `model` into its layer's kernel and zeroes the update (B = 0), in
    place: the outputs stay the same and the kernels alone hold them. Returns the layers folded."""
    folded = 0
    for _, module in nnx.iter_modules(model):
        if getattr(module, "lora_a", None) is not None:
            a, b = module.lora_a[...], module.lora_b[...]
            module.kernel[...] = module.kernel[...] + (a @ b * module.lora_scale).astype(module.kernel.dtype)
            module.lora_b[...] = jnp.zeros_like(b)
            folded += 1
    return folded


def stacked(base: nnx.Module, adapters: Sequence[nnx.Module]) -> nnx.Module:
    """A copy of `base` over the same weights whose adapted layers hold the adapters of every
    model in `adapters` (runs of `base`'s architecture, numbered from 1) side by side: lora_a
    [I, sum of ranks] (each adapter's A, for the adapters of that layer), lora_b [sum of ranks,
    O] (each one's B with its alpha / r folded in) and lora_ids, which adapter each column is
    of. `per_row` turns lora_ids into a batch's row masks, so that a step multiplies by every
    adapter at once and each row keeps its own adapter's columns: two products as wide as the
    ranks together, where a gathered A and B per row would copy them for every row (at 16 rows
    and two adapters of rank 16 on SmolLM2, 1.5x the step's time). `base`'s own adapters, if
    any, are not kept."""
    graphdef, state = nnx.split(base)
    model = nnx.merge(graphdef, state)  # new modules over the same arrays: `base` is left as it is
    found = [_adapters(m) for m in adapters]
    paths = set().union(*found)
    for path, module in nnx.iter_modules(model):
        if path not in paths:
            if getattr(module, "lora_a", None) is not None:
                module.lora_a = module.lora_b = None
            continue
        mine = [(index, adapted[path]) for index, adapted in enumerate(found, 1) if path in adapted]
        a = np.concatenate([a for _, (a, _) in mine], axis=1)
        b = np.concatenate([b for _, (_, b) in mine], axis=0)
        ids = np.concatenate([np.full(a.shape[1], index, np.int32) for index, (a, _) in mine])
        # A layer without adapters holds None there, which nnx takes as static: marked as data now.
        module.lora_a, module.lora_b = nnx.data(nnx.Param(jnp.asarray(a))), nnx.data(nnx.Param(jnp.asarray(b)))
        module.lora_ids, module.lora_scale = nnx.data(nnx.Variable(jnp.asarray(ids))), 1.0
    return model


def per_row(params: Any, ids: jax.Array) -> Any:
    """A `stacked` model's parameters (an nnx state) for a batch whose rows decode through the
    adapters `ids` [B] (0: none): each layer's lora_ids [C] becomes the rows' masks of its
    columns [B, C], 1 where a column is of the row's adapter."""

    def pick(path, leaf):
        if any(getattr(key, "key", None) == "lora_ids" for key in path):
            return (ids[:, None] == leaf[None, :]).astype(jnp.float32)
        return leaf

    return jax.tree_util.tree_map_with_path(pick, params)


def _adapters(model: nnx.Module) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """Each adapted layer's (A, B * alpha / r) by its module path."""
    return {
        path: (np.asarray(module.lora_a[...]), np.asarray(module.lora_b[...]) * module.lora_scale)
        for path, module in nnx.iter_modules(model)
        if getattr(module, "lora_a", None) is not None
    }
