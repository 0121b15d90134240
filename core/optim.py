"""The optimizer: AdamW behind global-norm clipping, on a warm-up + cosine schedule.

Weight decay applies to matrices only (ndim >= 2); norms' scales and biases are not decayed.
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


def optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
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
    )
