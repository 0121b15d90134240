"""The model built for a task, and its jitted train and eval steps.

The hot loop is functional: the model is split once into a static graph and a pure dict of
parameters; each step merges them inside `jax.jit`, so one compiled program covers forward,
backward, gradient accumulation and the optimizer update. The training state is donated to the
step so XLA updates parameters in place.

`core.training.fit` runs them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from core import metrics as metrics_lib
from core.checkpoints import pretrained
from core.config import Config, TrainConfig
from core.model import kernels, lora
from core.model.precision import products_in
from core.task import Trainable
from core.training import data as data_lib
from core.training import sharding, transfer
from core.training.optim import optimizer

State = dict[str, Any]
log = logging.getLogger("apps")


def build_model(task: Trainable, featurizer, config: Config, *, from_pretrained: bool = False) -> nnx.Module:
    """The task's model (its `model` hook). `from_pretrained` (a new run's start): the parameters
    that the checkpoint `config.model.pretrained` or the run `config.model.init_from` holds take
    its weights; a run being loaded restores its own. The run's kernels (`model.kernels`) are
    chosen here for the process (`core.model.kernels.select`)."""
    kernels.select(config.model.kernels)
    model = task.model(featurizer, config, nnx.Rngs(config.train.seed))
    if from_pretrained and config.model.pretrained is not None:
        log.info(pretrained.load(model, config.model.pretrained).summary())
    if from_pretrained and config.model.init_from is not None:
        log.info(transfer.init_from(model, config.model.init_from).summary())
    return model


def cast_for_compute(params: Any, dtype: str) -> Any:
    """The parameters in the compute dtype; the float32 masters stay in the optimizer state."""
    if dtype == "float32":
        return params
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


@dataclass
class Steps:
    """The compiled programs of one run and its sharded initial state: {"params"} for eval and
    predict, or {"params", "opt_state", "step"} with a `train_step` for training. `params` are
    the trained parameters; with LoRA the checkpoint's own weights are `frozen` apart
    (core/model/lora.py), which the steps read without being given them."""

    graphdef: Any
    state: State
    train_step: Callable[[State, dict], tuple[State, dict]] | None
    eval_step: Callable[[Any, dict], tuple[dict, dict]]
    mesh: Mesh
    frozen: Any = None
    # train.steps_per_dispatch > 1: train_steps(state, (batch, ...)) runs that many steps in one
    # call, their logs stacked; None otherwise.
    train_steps: Callable[[State, tuple], tuple[State, dict]] | None = None

    def model(self, params: Any) -> nnx.Module:
        """The model holding `params` (as the state and the checkpoints hold them) and the frozen part."""
        return nnx.merge(self.graphdef, lora.join(params, self.frozen))

    def decoder(self, params: Any) -> nnx.Module:
        """The model for generation, on this process's first device alone: decoding does not
        split its batch over devices, and over weights replicated on several each would do the
        same work (on simulated CPU devices sharing two cores, 3-8x the time). A run spread
        over several processes keeps its placement."""
        joined = lora.join(params, self.frozen)
        if jax.process_count() == 1:
            joined = jax.device_put(joined, jax.local_devices()[0])
        return nnx.merge(self.graphdef, joined)


class _Bound:
    """A compiled step with the frozen parameters bound as its second argument: called (and
    lowered, for inspection) as step(first, batch)."""

    def __init__(self, jitted: Callable, frozen: Any):
        self.jitted, self.frozen = jitted, frozen

    def __call__(self, first, batch):
        return self.jitted(first, self.frozen, batch)

    def lower(self, first, batch):
        return self.jitted.lower(first, self.frozen, batch)

    def compiled(self, first, batch) -> _Bound:
        """The step compiled ahead of time for these arguments' shapes (a benchmark times the
        compilation apart), still called as step(first, batch)."""
        return _Bound(self.lower(first, batch).compile(), self.frozen)


def make_steps(
    task: Trainable,
    model: nnx.Module,
    config: Config,
    total_steps: int,
    devices: list | None = None,
    *,
    training: bool = True,
) -> Steps:
    train = config.train
    mesh = sharding.make_mesh(train.fsdp, devices)
    graphdef, params = nnx.split(model)
    params, frozen = lora.split(nnx.to_pure_dict(params), config.model, type(model).transferred)
    frozen = sharding.place_params(mesh, frozen)
    forward = _forward(graphdef, train.compute_dtype)
    eval_step = _Bound(jax.jit(_in_products(_eval_step(task, forward), train.matmul_dtype, mesh)), frozen)

    if not training:
        state = sharding.place_params(mesh, {"params": params})
        return Steps(graphdef, state, None, eval_step, mesh, frozen)

    tx = optimizer(config.optim, total_steps)
    # Optimizer moments follow their parameter's placement: the rule depends on shape alone.
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    state = sharding.place_params(mesh, state)
    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    one_step = _train_step(task, forward, tx, train)
    frozen_sharding = jax.tree.map(lambda x: x.sharding, frozen)

    def jitted(step: Callable, batches: Any) -> _Bound:
        return _Bound(
            jax.jit(
                _in_products(step, train.matmul_dtype, mesh),
                in_shardings=(state_sharding, frozen_sharding, batches),
                out_shardings=(state_sharding, sharding.replicated(mesh)),
                donate_argnums=0,
            ),
            frozen,
        )

    batch_sharding = sharding.batch_sharding(mesh)
    train_step = jitted(one_step, batch_sharding)
    chunk = train.steps_per_dispatch
    train_steps = jitted(_scanned_steps(one_step), (batch_sharding,) * chunk) if chunk > 1 else None
    return Steps(graphdef, state, train_step, eval_step, mesh, frozen, train_steps)


def _scanned_steps(train_step: Callable) -> Callable:
    """steps(state, frozen, batches) -> the state after one `train_step` a batch of the tuple
    `batches`, in order, and their logs stacked: one program for several optimizer steps."""

    def steps(state, frozen, batches):
        stacked = jax.tree.map(lambda *rows: jnp.stack(rows), *batches)
        return jax.lax.scan(lambda carry, batch: train_step(carry, frozen, batch), state, stacked)

    return steps


def _forward(graphdef: Any, compute_dtype: str) -> Callable:
    """forward(params, frozen, batch, key) -> the model's outputs, computed in `compute_dtype`."""

    def forward(params, frozen, batch, key):
        model = nnx.merge(graphdef, cast_for_compute(lora.join(params, frozen), compute_dtype))
        return model(batch, dropout_key=key)

    return forward


def _in_products(step: Callable, dtype: str, mesh: Mesh) -> Callable:
    """`step` with its products in `dtype` (`products_in`) and traced within `mesh` (kernels
    that XLA does not partition map themselves over its batch axes), entered where jit traces it."""

    @functools.wraps(step)
    def in_products(*args):
        with products_in(dtype), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return step(*args)

    return in_products


def _eval_step(task: Trainable, forward: Callable) -> Callable:
    """eval_step(params, frozen, batch) -> (the streamed metrics and loss, the decoded predictions)."""

    def eval_step(params, frozen, batch):
        outputs = forward(params, frozen, batch, None)
        streamed = dict(task.metrics(outputs, batch))
        streamed["loss"] = task.loss(outputs, batch)
        return streamed, task.decode(outputs, batch)

    return eval_step


def _gradients(task: Trainable, forward: Callable, grad_accum: int) -> Callable:
    """gradients(params, frozen, batch, key) -> (the gradients of the loss sum with respect to
    `params`, the sum, its weight), summed over `grad_accum` microbatches of the batch."""

    def loss_sum(params, frozen, batch, key):
        return task.loss(forward(params, frozen, task.augment_on_device(batch), key), batch)

    # loss_sum returns (sum, weight): the sum is differentiated, the weight rides along.
    grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

    def gradients(params, frozen, batch, key):
        if grad_accum == 1:
            (total, weight), grads = grad_fn(params, frozen, batch, key)
            return grads, total, weight
        # Microbatch a takes rows a, a + A, a + 2A, ...: every device keeps its own rows.
        steps = grad_accum
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // steps, steps, *x.shape[1:]).swapaxes(0, 1), batch)

        def body(carry, inputs):
            index, microbatch = inputs
            (total, weight), grads = grad_fn(params, frozen, microbatch, jax.random.fold_in(key, index))
            return jax.tree.map(jnp.add, carry, (grads, total, weight)), None

        zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(()), jnp.zeros(()))
        return jax.lax.scan(body, zeros, (jnp.arange(steps), micro))[0]

    return gradients


def _train_step(task: Trainable, forward: Callable, tx: optax.GradientTransformation, train: TrainConfig) -> Callable:
    """train_step(state, frozen, batch) -> (the state after one optimizer update, {"loss", "grad_norm"},
    and "stop" when the batch has a "stop" column: whether any process asked the run to stop)."""
    gradients = _gradients(task, forward, train.grad_accum)
    base_key = jax.random.key(train.seed)

    def train_step(state, frozen, batch):
        # Each process's rows carry its stop request (`Preemption`): their maximum is one more
        # reduction in the step's own collectives, so every process learns of a signal to any.
        stop = batch.get("stop")
        batch = {key: value for key, value in batch.items() if key != "stop"}
        params = state["params"]
        grads, total, weight = gradients(params, frozen, batch, jax.random.fold_in(base_key, state["step"]))
        # Sums over the global batch divided by its true weight: exact under any sharding.
        weight = jnp.maximum(weight, 1e-9)
        grads = jax.tree.map(lambda g: g / weight, grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": state["step"] + 1}
        logs = {"loss": total / weight, "grad_norm": optax.tree.norm(grads)}
        return new_state, logs if stop is None else {**logs, "stop": jnp.max(stop)}

    return train_step


# Streamed metrics added in one call to the devices, not one per numerator and denominator.
_summed = jax.jit(lambda total, update: jax.tree.map(jnp.add, total, update))


def evaluate_arrays(
    steps: Steps, params: Any, arrays: data_lib.Arrays, batch_size: int
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Streamed metrics over a whole split, and the decoded predictions of its real rows. The
    batches' predictions stay on the devices until the last is dispatched: the host never waits
    for one batch before queueing the next."""
    data_lib.check_batch_size(batch_size, "train.eval_batch_size")
    total, on_devices = None, []
    place = lambda batch: sharding.global_batch(steps.mesh, batch)  # noqa: E731
    for batch in data_lib.prefetch(data_lib.eval_batches(arrays, batch_size), place):
        streamed, predictions = steps.eval_step(params, batch)
        total = streamed if total is None else _summed(total, streamed)
        on_devices.append(predictions)
    to_host = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))  # noqa: E731
    decoded = [jax.tree.map(to_host, predictions) for predictions in on_devices]
    count = data_lib.size(arrays)
    predictions = {key: np.concatenate([d[key] for d in decoded])[:count] for key in decoded[0]}
    return metrics_lib.finish(total), predictions
