"""The optimizer: AdamW behind global-norm clipping, on a warm-up + cosine schedule.

Weight decay applies to matrices only (ndim >= 2); norms' scales and biases are not decayed.
With `layer_decay` < 1 (fine-tuning a pretrained body, as ELECTRA and BEiT do), each update is
scaled by its parameter's depth: the head moves at the full rate, the last block at
layer_decay, ..., the embeddings at layer_decay ** (L + 1), so that the general features of the
lower layers change least.
"""

from __future__ import annotations

import jax
import optax

from core.config import OptimConfig


def schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=config.learning_rate * config.end_lr_ratio,
    )


def _keys(path: tuple) -> list:
    """A pytree path's keys as plain values: "body", "blocks", 0, ..."""
    return [getattr(key, "key", key) for key in path]


def layer_scale(path: tuple, num_layers: int, decay: float) -> float:
    """The learning-rate factor of the parameter at `path` in a `Model`'s parameters: block i
    (under "blocks") decay ** (L - i); the embedder and the body's tables and embedding norm
    decay ** (L + 1); everything else (the final norm, the head) 1."""
    keys = _keys(path)
    if "blocks" in keys[:-1]:
        return decay ** (num_layers - keys[keys.index("blocks") + 1])
    if keys[0] == "embedder" or (keys[0] == "body" and keys[1] != "final_norm"):
        return decay ** (num_layers + 1)
    return 1.0


def scale_by_layer(decay: float) -> optax.GradientTransformation:
    """Multiplies each update by `layer_scale` of its parameter (L: the number of blocks)."""

    def update(updates, state, params=None):
        paths = [_keys(path) for path, _ in jax.tree_util.tree_flatten_with_path(updates)[0]]
        num_layers = 1 + max((keys[keys.index("blocks") + 1] for keys in paths if "blocks" in keys[:-1]), default=-1)
        return jax.tree.map_with_path(lambda path, u: u * layer_scale(path, num_layers, decay), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    layers = [] if config.layer_decay == 1.0 else [scale_by_layer(config.layer_decay)]
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            schedule(config, total_steps),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        ),
        *layers,
    )
