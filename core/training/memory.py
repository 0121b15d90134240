"""How much memory a run needs, estimated before anything is allocated, and what to do when
the device runs out anyway.

`estimate` builds the task's model abstractly (`nnx.eval_shape`: shapes, no arrays), so the
parameter count is exact for every task and checkpoint family. Training holds per device:
the float32 parameters, their gradients and AdamW's two moments (of the trained parameters
alone under LoRA; a quarter of each with `train.fsdp=4`), a bfloat16 copy of the parameters
when the compute or the products are in bfloat16, and what backpropagation keeps for the
device's rows of a microbatch. That last part is not a formula per architecture: it is read
off the traced program itself (`kept_for_backward`: the residuals of the loss's
linearization, shapes alone), so every task's blocks, heads, attention kernel and losses count
as they run. Against XLA's compiled train step (its arguments and temporaries) the total came
within 0.78-1.08 on every task's presets here (SmolLM2 fine-tuning: 6.32 GB against 6.03 GB).

A device on CPU is the host: the simulated devices of one process share its RAM, so their
needs add up against the memory available there. `check` prints the figures in the run's
header and refuses a run whose estimate exceeds the device's memory; `explain` turns XLA's
RESOURCE_EXHAUSTED, wherever it comes from, into one message with the figures and the knobs.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from jax.extend.core import Literal

from core.config import Config
from core.errors import UserError
from core.model import kernels, lora
from core.model.precision import chosen_products, products_in
from core.training.steps import cast_for_compute

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
    products: str  # the dtype the products run in (`train.matmul_dtype`, "auto" resolved)

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
            f"memory estimate: {self.parameters:,} parameters{trained}; weights {self.weights / GB:.2f} GB "
            f"({self.products} products), "
            f"gradients and optimizer {self.optimizer / GB:.2f} GB, activations {self.activations / GB:.2f} GB: "
            f"{self.total / GB:.2f} GB{per}{room}"
        )


_last: Estimate | None = None


def estimate(task, featurizer, config: Config, sample: dict) -> Estimate:
    """The figures of training `task`'s model under `config` (see the module's text); `sample`:
    featurized training rows (`Task.featurize_train`), whose shapes (not values) give a batch's."""
    global _last
    abstract = _abstract(task, featurizer, config)
    flat = nnx.to_pure_dict(nnx.state(abstract))
    parameters = _count(flat)
    trained = _count(lora.split(flat, config.model, type(abstract).transferred)[0])
    train = config.train
    shard = max(train.fsdp, 1)
    products = _products(train)
    narrow = products == "bfloat16"
    weights = parameters * 4 / shard + (parameters * 2 / shard if narrow else 0)
    optimizer = trained * 4 * 3 / shard
    rows = max(1, -(-(train.batch_size // train.grad_accum) // jax.device_count()))
    activations = kept_for_backward(task, featurizer, config, abstract, sample, rows)
    free, where = available()
    devices = jax.local_device_count() if where == "host" else 1
    _last = Estimate(parameters, trained, weights, optimizer, activations, free, devices, where, products)
    return _last


def kept_for_backward(task, featurizer, config: Config, abstract: nnx.Module, sample: dict, rows: int) -> int:
    """Bytes of what backpropagation keeps for `rows` rows of the model `abstract` (`task`'s
    under `config`, built abstractly): the residuals of the loss's linearization with respect
    to the trained parameters, read off the traced program (shapes alone, nothing computed),
    less those that are the inputs themselves. Every task, attention kernel and dropout counts
    as it runs; XLA's compiled step holds these beside the gradients (tests/test_memory.py
    compares the two).

    `train.remat` keeps one vector per block and recomputes a block's intermediates in the
    backward pass: one block's share of the residuals beside the checkpoints. XLA on CPU does not
    realize that saving (SmolLM2's compiled step: 4.52 GB of temporaries without remat, 4.17
    with it), so there the residuals count as without remat."""
    if not config.train.remat:
        return _residuals(task, config, abstract, sample, rows)
    plain_config = dataclasses.replace(config, train=dataclasses.replace(config.train, remat=False))
    plain = _residuals(task, plain_config, _abstract(task, featurizer, plain_config), sample, rows)
    if kernels.chosen().platform == "cpu":
        return plain
    return _residuals(task, config, abstract, sample, rows) + plain // max(config.model.num_layers, 1)


def _products(train) -> str:
    """The dtype a run's products are in: bfloat16 compute multiplies in bfloat16 whatever
    `matmul_dtype` says."""
    return "bfloat16" if train.compute_dtype == "bfloat16" else chosen_products(train.matmul_dtype)


def _abstract(task, featurizer, config: Config) -> nnx.Module:
    return nnx.eval_shape(lambda: task.model(featurizer, config, nnx.Rngs(0)))


def _residuals(task, config: Config, abstract: nnx.Module, sample: dict, rows: int) -> int:
    graphdef, state = nnx.split(abstract)
    params, frozen = lora.split(nnx.to_pure_dict(state), config.model, type(abstract).transferred)
    batch = {
        key: jax.ShapeDtypeStruct((rows, *np.shape(value)[1:]), np.asarray(value).dtype)
        for key, value in sample.items()
    }

    def loss(params, frozen, batch):
        model = nnx.merge(graphdef, cast_for_compute(lora.join(params, frozen), config.train.compute_dtype))
        return task.loss(model(batch, dropout_key=jax.random.key(0)), batch)[0]

    # Traced in the run's products' dtype: what the attention and the output layer keep depends on it.
    with products_in(_products(config.train)):
        traced, shapes = jax.make_jaxpr(
            lambda params, frozen, batch: jax.vjp(lambda p: loss(p, frozen, batch), params), return_shape=True
        )(params, frozen, batch)
    outputs = traced.jaxpr.outvars[len(traced.jaxpr.outvars) - len(jax.tree.leaves(shapes[1])) :]
    inputs = set(traced.jaxpr.invars)
    kept = [var for var in outputs if not isinstance(var, Literal) and var not in inputs]
    return sum(int(np.prod(var.aval.shape)) * var.aval.dtype.itemsize for var in kept)


def _count(params) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))


def available() -> tuple[float | None, str]:
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


def check(task, featurizer, config: Config, sample: dict) -> Estimate:
    """The estimate, refused with its figures when it cannot fit the device's memory."""
    found = estimate(task, featurizer, config, sample)
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
