"""What the tasks' presets are built from: a body of today's blocks, and every task's `tiny` preset.

A preset is a plain function in its task's module that returns a `Config`; these are the pieces
several tasks share.
"""

from __future__ import annotations

from typing import Any

from core.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig


def modern_blocks(
    d_model: int, num_layers: int, num_heads: int, mlp_dim: int, max_len: int, dropout: float, **more: Any
) -> ModelConfig:
    """A body of today's blocks (as in Llama): RMSNorm, SwiGLU, rotary positions."""
    sizes = dict(d_model=d_model, num_layers=num_layers, num_heads=num_heads, mlp_dim=mlp_dim, max_len=max_len)
    return ModelConfig(**sizes, dropout=dropout, norm="rmsnorm", mlp="swiglu", positions="rotary", **more)


def tiny_body(max_len: int, **more: Any) -> ModelConfig:
    """The body of a `tiny_preset`: one block of width 32, two heads, no dropout."""
    return ModelConfig(d_model=32, num_layers=1, num_heads=2, mlp_dim=64, max_len=max_len, dropout=0.0, **more)


def tiny_preset(
    task: str,
    model: ModelConfig,
    data: DataConfig,
    *,
    learning_rate: float = 3e-3,
    weight_decay: float = 0.01,
    eval_batch_size: int = 64,
    warmup_steps: int = 5,
    log_every: int = 5,
) -> Config:
    """Every task's `tiny` preset, for tests: 20 steps of 16 rows, validation and checkpoints
    every 10 steps."""
    return Config(
        task=task,
        preset="tiny",
        model=model,
        optim=OptimConfig(learning_rate=learning_rate, warmup_steps=warmup_steps, weight_decay=weight_decay),
        train=TrainConfig(
            batch_size=16,
            eval_batch_size=eval_batch_size,
            steps=20,
            eval_every=10,
            checkpoint_every=10,
            log_every=log_every,
        ),
        data=data,
    )
