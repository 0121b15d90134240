"""The jitted train and eval steps and the fit loop.

The hot loop is functional: the model is split once into a static graph and a pure dict of
parameters; each step merges them inside `jax.jit`, so one compiled program covers forward,
backward, gradient accumulation and the optimizer update. The training state is donated to the
step so XLA updates parameters in place.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from core import data as data_lib
from core import metrics as metrics_lib
from core import pretrained, sharding, transfer
from core.checkpoint import Checkpoints, write_json
from core.config import Config
from core.errors import UserError
from core.optim import optimizer
from core.task import Task
from core.transformer import Model, Transformer

State = dict[str, Any]
log = logging.getLogger("apps")


def build_model(task: Task, featurizer, config: Config, *, from_pretrained: bool = False) -> nnx.Module:
    """The task's own model (its `model` hook), else the default composition embedder ->
    body -> head. `from_pretrained` (a new run's start): the parameters that the checkpoint
    `config.model.pretrained` or the run `config.model.init_from` holds take its weights; a run
    being loaded restores its own."""
    rngs = nnx.Rngs(config.train.seed)
    model = task.model(featurizer, config, rngs)
    if model is None:
        embedder = task.embedder(featurizer, rngs)
        body = Transformer(config.model, remat=config.train.remat, rngs=rngs)
        model = Model(embedder, body, task.head(featurizer, embedder, rngs))
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
    predict, or {"params", "opt_state", "step"} with a `train_step` for training."""

    graphdef: Any
    state: State
    train_step: Callable[[State, dict], tuple[State, dict]] | None
    eval_step: Callable[[Any, dict], tuple[dict, dict]]
    mesh: Mesh


def make_steps(
    task: Task,
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
    params = nnx.to_pure_dict(params)

    def forward(params, batch, key):
        model = nnx.merge(graphdef, cast_for_compute(params, train.compute_dtype))
        return model(batch, dropout_key=key)

    def eval_step(params, batch):
        outputs = forward(params, batch, None)
        streamed = dict(task.metrics(outputs, batch))
        streamed["loss"] = task.loss(outputs, batch)
        return streamed, task.decode(outputs, batch)

    if not training:
        state = sharding.place_params(mesh, {"params": params})
        return Steps(graphdef, state, None, jax.jit(eval_step), mesh)

    tx = optimizer(config.optim, total_steps)
    # Optimizer moments follow their parameter's placement: the rule depends on shape alone.
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    state = sharding.place_params(mesh, state)
    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    base_key = jax.random.key(train.seed)

    def loss_sum(params, batch, key):
        return task.loss(forward(params, batch, key), batch)

    # loss_sum returns (sum, weight): the sum is differentiated, the weight rides along.
    grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

    def gradients(params, batch, key):
        if train.grad_accum == 1:
            (total, weight), grads = grad_fn(params, batch, key)
            return grads, total, weight
        # Microbatch a takes rows a, a + A, a + 2A, ...: every device keeps its own rows.
        steps = train.grad_accum
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // steps, steps, *x.shape[1:]).swapaxes(0, 1), batch)

        def body(carry, inputs):
            index, microbatch = inputs
            (total, weight), grads = grad_fn(params, microbatch, jax.random.fold_in(key, index))
            return jax.tree.map(jnp.add, carry, (grads, total, weight)), None

        zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(()), jnp.zeros(()))
        return jax.lax.scan(body, zeros, (jnp.arange(steps), micro))[0]

    def train_step(state, batch):
        params = state["params"]
        grads, total, weight = gradients(params, batch, jax.random.fold_in(base_key, state["step"]))
        # Sums over the global batch divided by its true weight: exact under any sharding.
        weight = jnp.maximum(weight, 1e-9)
        grads = jax.tree.map(lambda g: g / weight, grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": state["step"] + 1}
        return new_state, {"loss": total / weight, "grad_norm": optax.tree.norm(grads)}

    batch_sharding = sharding.batch_sharding(mesh)
    return Steps(
        graphdef=graphdef,
        state=state,
        train_step=jax.jit(
            train_step,
            in_shardings=(state_sharding, batch_sharding),
            out_shardings=(state_sharding, sharding.replicated(mesh)),
            donate_argnums=0,
        ),
        eval_step=jax.jit(eval_step),
        mesh=mesh,
    )


def evaluate_arrays(
    steps: Steps, params: Any, arrays: data_lib.Arrays, batch_size: int
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Streamed metrics over a whole split, and the decoded predictions of its real rows."""
    data_lib.check_batch_size(batch_size, "train.eval_batch_size")
    total, decoded = None, []
    place = lambda batch: sharding.global_batch(steps.mesh, batch)  # noqa: E731
    for batch in data_lib.prefetch(data_lib.eval_batches(arrays, batch_size), place):
        streamed, predictions = steps.eval_step(params, batch)
        total = metrics_lib.add(total, streamed)
        decoded.append(
            jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), predictions)
        )
    count = data_lib.size(arrays)
    predictions = {key: np.concatenate([d[key] for d in decoded])[:count] for key in decoded[0]}
    return metrics_lib.finish(total), predictions


class Logger:
    """Appends records to metrics.jsonl in the workdir; only process 0 writes."""

    def __init__(self, workdir: Path):
        self.path = workdir / "metrics.jsonl"
        self.active = jax.process_index() == 0

    def write(self, record: dict) -> None:
        if self.active:
            with self.path.open("a") as file:
                file.write(json.dumps(record, sort_keys=True) + "\n")


def fit(
    task: Task,
    config: Config,
    steps: Steps,
    train_arrays: data_lib.Arrays,
    validate: Callable[[Any], dict[str, float]],
    workdir: Path,
    console: Console,
) -> dict[str, float]:
    """Trains from the latest readable checkpoint in `workdir` (or from scratch) to `train.steps`.

    Calls `validate(params)` every `train.eval_every` steps and at the end, keeps the parameters
    with the best `task.best_metric` (in the task's direction) in `best/`, and saves the latest
    state every `train.checkpoint_every` steps. Returns the last validation metrics.
    """
    train = config.train
    checkpoints = Checkpoints(workdir)
    logger = Logger(workdir)
    best_path = workdir / "best.json"
    state, start = steps.state, 0
    restored = checkpoints.restore_training(state)
    if restored is not None:
        state, start = restored.value, restored.step
        console.print(f"Resuming from {restored.where} in {workdir}.")
    best = json.loads(best_path.read_text())["value"] if best_path.exists() else None
    selector, sign = task.best_metric, -1.0 if task.lower_is_better else 1.0
    counts = []  # (examples, tokens) of each global batch placed on the devices, in order

    def place(batch):
        # Tokens read: the inputs' and, for an encoder-decoder, the decoder's.
        tokens = sum(int(batch[key].sum()) for key in ("mask", "decoder_mask") if key in batch)
        counts.append((len(batch["weights"]) * jax.process_count(), tokens * jax.process_count()))
        return sharding.global_batch(steps.mesh, batch)

    batches = data_lib.train_batches(train_arrays, train.batch_size, train.seed, start, task.augment, task.trim)
    batches = data_lib.prefetch(batches, place)
    valid_metrics: dict[str, float] = {}
    saved = start if restored is not None else None  # the step of the newest checkpoint in `workdir`
    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        console=console,
        disable=jax.process_index() != 0,
        transient=False,
    )
    step = start

    def resume_advice() -> str:
        again = "run the same command again"
        if jax.process_count() > 1:
            again = f"restart all {jax.process_count()} processes with the same command"
        if saved is None:
            return f"No checkpoint was saved in {workdir} yet; {again} to start over."
        return f"The checkpoint of step {saved} in {workdir} is intact; {again} to resume from it."

    try:
        # Every step, validation and save runs collectives: a lost process fails whichever comes next.
        with sharding.lost_peers(resume_advice), progress:
            bar = progress.add_task("train", total=train.steps, completed=start, info="")
            # Throughput counts the steps alone: validation and checkpoint time is `paused`.
            window_start, paused, window_losses = time.perf_counter(), 0.0, []
            while step < train.steps:
                state, logs = steps.train_step(state, next(batches))
                step += 1
                window_losses.append(logs["loss"])
                if step % train.log_every == 0 or step == train.steps:
                    sharding.wait(window_losses)
                    losses = np.asarray(jax.device_get(window_losses))
                    if not np.all(np.isfinite(losses)):
                        raise UserError(f"The loss became {losses[-1]} at step {step}; lower optim.learning_rate.")
                    elapsed = time.perf_counter() - window_start - paused
                    window = counts[: len(losses)]
                    del counts[: len(losses)]
                    record = {
                        "step": step,
                        "loss": float(losses.mean()),
                        "grad_norm": float(logs["grad_norm"]),
                        "examples_per_s": sum(c[0] for c in window) / elapsed,
                        "tokens_per_s": sum(c[1] for c in window) / elapsed,
                    }
                    logger.write(record)
                    progress.update(
                        bar,
                        completed=step,
                        info=f"loss {record['loss']:.4f}  {record['examples_per_s']:,.0f} ex/s  "
                        f"{record['tokens_per_s']:,.0f} tok/s",
                    )
                    window_start, paused, window_losses = time.perf_counter(), 0.0, []
                evaluate_now = step % train.eval_every == 0 or step == train.steps
                save_now = step % train.checkpoint_every == 0 or step == train.steps
                if not (evaluate_now or save_now):
                    continue
                sharding.wait(state)  # the steps so far belong to the current window
                pause_start = time.perf_counter()
                if evaluate_now:
                    valid_metrics = validate(state["params"])
                    logger.write({"step": step, **{f"valid_{k}": v for k, v in valid_metrics.items()}})
                    value = valid_metrics[selector]
                    if best is None or sign * value > sign * best:
                        best = value
                        checkpoints.save_best(step, state["params"])
                        if logger.active:
                            write_json(best_path, {"step": step, "metric": selector, "value": best})
                    progress.console.print(
                        f"step {step}: " + "  ".join(f"valid {k} {v:.4f}" for k, v in valid_metrics.items())
                    )
                if save_now:
                    checkpoints.save(step, state)
                    saved = step
                paused += time.perf_counter() - pause_start
    except KeyboardInterrupt:
        raise UserError(f"Interrupted at step {step}. {resume_advice()}") from None
    finally:
        checkpoints.close()
    return valid_metrics
