"""How much memory a run needs, estimated before anything is allocated, and what to do when
the device runs out anyway.

`estimate` builds the task's model abstractly (`nnx.eval_shape`: shapes, no arrays), so the
parameter count is exact for every task and checkpoint family. Training holds per device:
the float32 parameters, their gradients and AdamW's two moments (of the trained parameters
alone under LoRA; a quarter of each with `train.fsdp=4`), a bfloat16 copy of the parameters
when the compute or the products are in bfloat16, and the activations that backpropagation keeps. The last is
an estimate: per position and layer, the block's inputs, normalized inputs, queries, keys,
values, attention output and the MLP's hidden units (with `train.remat`, one vector per layer
and one layer's worth recomputed), for `model.max_len` positions of each device's rows of a
microbatch, plus the attention scores where XLA's attention materializes them (the blockwise
kernel on CPU does not). Evaluation holds the parameters and the forward pass of one batch.

A device on CPU is the host: the simulated devices of one process share its RAM, so their
needs add up against the memory available there. `check` prints the figures in the run's
header and refuses a run whose estimate exceeds the device's memory; `explain` turns XLA's
RESOURCE_EXHAUSTED, wherever it comes from, into one message with the figures and the knobs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from core.config import Config
from core.errors import UserError
from core.model import lora
from core.model.transformer import Block

GB = 1024**3

KNOBS = (
    "lower train.batch_size (train.grad_accum keeps the effective batch: it splits each batch into microbatches) "
    "or train.eval_batch_size for eval and predict, set train.remat=true (recompute activations in the backward "
    "pass), shard parameters and optimizer state over devices with train.fsdp=N, or compute in "
    "train.compute_dtype=bfloat16"
)


@dataclass(frozen=True)
class Estimate:
    """Bytes one device needs, by part, and the memory it has (None where unknown)."""

    parameters: int  # the parameter count
    trained: int  # of which trained (all, or the adapters under LoRA)
    weights: float
    optimizer: float  # gradients and AdamW's moments
    activations: float
    available: float | None
    devices: int  # the devices that share the `available` memory
    where: str

    @property
    def total(self) -> float:
        return self.weights + self.optimizer + self.activations

    @property
    def needed(self) -> float:
        """What all the devices sharing the memory need together."""
        return self.total * self.devices

    def describe(self) -> str:
        per = f" per device, {self.needed / GB:.2f} GB for the {self.devices} sharing it" if self.devices > 1 else ""
        room = f" of {self.available / GB:.1f} GB available on {self.where}" if self.available else ""
        trained = f" ({self.trained:,} trained)" if self.trained != self.parameters else ""
        return (
            f"memory estimate: {self.parameters:,} parameters{trained}; weights {self.weights / GB:.2f} GB, "
            f"gradients and optimizer {self.optimizer / GB:.2f} GB, activations {self.activations / GB:.2f} GB: "
            f"{self.total / GB:.2f} GB{per}{room}"
        )


_last: Estimate | None = None


def estimate(task, featurizer, config: Config, *, training: bool = True) -> Estimate:
    """The figures of `task`'s model under `config` (see the module's text), for training or for
    evaluation and decoding."""
    global _last
    abstract = nnx.eval_shape(lambda: task.model(featurizer, config, nnx.Rngs(0)))
    flat = nnx.to_pure_dict(nnx.state(abstract))
    parameters = _count(flat)
    trained = _count(lora.split(flat, config.model, getattr(type(abstract), "transferred", ()))[0])
    train, model = config.train, config.model
    devices = jax.local_device_count()
    shard = max(train.fsdp, 1)
    compute = 2 if train.compute_dtype == "bfloat16" else 4
    narrow = "bfloat16" in (train.compute_dtype, train.matmul_dtype)
    weights = parameters * 4 / shard + (parameters * 2 / shard if narrow else 0)
    optimizer = trained * 4 * 3 / shard if training else 0.0
    batch = train.batch_size // train.grad_accum if training else train.eval_batch_size
    rows = max(1, -(-batch // jax.device_count()))
    layers = sum(isinstance(module, Block) for _, module in nnx.iter_modules(abstract))
    head = model.head_size or model.d_model // model.num_heads
    width = model.num_heads * head
    kv = (model.num_kv_heads or model.num_heads) * head
    per_position = 4 * model.d_model + 2 * width + 2 * kv + 3 * model.mlp_dim
    if model.attention == "xla" or (model.attention != "blockwise" and jax.default_backend() != "cpu"):
        per_position += model.num_heads * model.max_len  # the score matrix, one row per position
    positions = rows * model.max_len
    if not training:
        kept = per_position  # a forward pass keeps one layer's intermediates at a time
    elif train.remat:
        kept = layers * model.d_model + per_position
    else:
        kept = layers * per_position
    activations = positions * kept * compute
    available, where = _available()
    _last = Estimate(
        parameters, trained, weights, optimizer, activations, available, devices if where == "host" else 1, where
    )
    return _last


def _count(params) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))


def _available() -> tuple[float | None, str]:
    """The bytes one device may use and where: a GPU's limit, or on CPU the host's available RAM."""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        return (float(limit) if limit else None), f"{device.device_kind} {device.id}"
    try:
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info)
        return float(fields["MemAvailable"].split()[0]) * 1024, "host"
    except (OSError, KeyError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        return (float(pages * os.sysconf("SC_PAGE_SIZE")) or None), "host"


def check(task, featurizer, config: Config, *, training: bool = True) -> Estimate:
    """The estimate, refused with its figures when it cannot fit the device's memory."""
    found = estimate(task, featurizer, config, training=training)
    if found.available is not None and found.needed > found.available:
        raise UserError(
            f"This run cannot fit: {found.describe()}. To make it fit, {KNOBS}; or build a smaller model "
            "(model.d_model, model.mlp_dim, model.num_layers)."
        )
    return found


def explain(error: BaseException) -> UserError | None:
    """A device out-of-memory error (XLA's RESOURCE_EXHAUSTED) as one message with the figures
    and the knobs that help; None for any other error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "Out of memory" not in text:
        return None
    asked = re.search(r"(\d{4,})\s*(?:bytes|B\b)", text)  # CPU and GPU both give the request in bytes
    what = f" (asked for {int(asked.group(1)) / GB:.2f} GB more)" if asked else ""
    figures = f" This run's {_last.describe()}." if _last is not None else ""
    return UserError(f"The device ran out of memory{what}.{figures} To make it fit, {KNOBS}.")
