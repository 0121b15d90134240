"""LoRA training: which parameters a run trains, and adapters folded back into their weights.

With `model.lora_rank` > 0 the linear layers named in `model.lora_targets` carry adapters
(core/model/transformer.py `Dense`). A run then trains the adapters and the task's head, the parts
that the checkpoint does not fill; the front end and the body (`Model.transferred`) stay as the
checkpoint has them. `split` separates the two: the trained part is the training state (the
optimizer's moments and the checkpoints hold it alone, a few MB), the frozen part is passed to
the compiled steps beside it and never differentiated, so that no weight gradient of a frozen
matrix is computed. `merge` folds the adapters into the weights (W + A B * alpha / r), for an
export that any reader of the checkpoint's format loads.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
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
