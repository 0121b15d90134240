"""The fit loop: train steps from the latest checkpoint to `train.steps`.

`fit` only runs the steps; what happens between them (the metrics.jsonl record and its loss
guard, validation and the best checkpoint, checkpoints, the progress bar) is
`core.training.hooks`', each job a hook with its cadence. Batches are placed on the devices
ahead of the steps, and a stop request (a signal, preemption) is agreed by every process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from rich.console import Console

from core.config import Config, TrainConfig
from core.errors import UserError
from core.task import Task
from core.training import data as data_lib
from core.training import sharding
from core.training.checkpoints import Checkpoints
from core.training.hooks import (
    Hooks,
    KeepBest,
    Logger,
    LogLoss,
    Preemption,
    SaveCheckpoint,
    ShowProgress,
    StepInfo,
    Window,
)
from core.training.steps import Steps


def fit(
    task: Task,
    featurizer,
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
    state, start = steps.state, 0
    restored = checkpoints.restore_training(state)
    if restored is not None:
        state, start = restored.value, restored.step
        console.print(f"Resuming from {restored.where} in {workdir}.")
    window, preemption = Window(), Preemption(console)
    keep_best = KeepBest(validate, checkpoints, logger, workdir, task.best_metric, task.lower_is_better, console)
    save = SaveCheckpoint(checkpoints, workdir, start if restored is not None else None)
    hooks, progress = _hooks(train, window, logger, keep_best, save, console)
    batches = _placed_batches(task, featurizer, steps.mesh, train_arrays, train, start, window, preemption)
    step = start
    try:
        # Every step, validation and save runs collectives: a lost process fails whichever comes next.
        with sharding.lost_peers(save.resume_advice), progress.shown(start), preemption:
            window.restart()
            asked = None  # the previous step's verdict on a stop request, read once this one is queued
            while step < train.steps:
                state, each = _advance(steps, state, batches, step, train)
                for logs in each:
                    step += 1
                    hooks.run(StepInfo(step, state, logs))
                # Every process reads the same verdict after the same step, so all stop at one step
                # and save it together; reading the previous step's never leaves the devices idle.
                if asked is not None:
                    sharding.wait(asked)  # a lost peer's failure is raised at once, not hung on
                    if int(asked) and step < train.steps:
                        if save.saved != step:
                            save(StepInfo(step, state, logs))
                        by = preemption.requested() or "a signal to another process of the run"
                        raise UserError(f"Stopped by {by} at step {step}. {save.resume_advice()}")
                asked = logs["stop"]
    except KeyboardInterrupt:  # a SIGINT outside the steps (while compiling, say)
        raise UserError(f"Interrupted at step {step}. {save.resume_advice()}") from None
    finally:
        checkpoints.close()
    return keep_best.metrics


def _advance(steps: Steps, state, batches: Iterator[dict], step: int, train: TrainConfig) -> tuple[Any, list[dict]]:
    """The state after the next call to the devices, and the logs of each step it ran: a chunk of
    `train.steps_per_dispatch` steps where one starts at `step` and ends by `train.steps`
    (its logs brought to the host at once), else one step."""
    chunk = train.steps_per_dispatch
    if steps.train_steps is None or step % chunk or step + chunk > train.steps:
        state, logs = steps.train_step(state, next(batches))
        return state, [logs]
    state, stacked = steps.train_steps(state, tuple(next(batches) for _ in range(chunk)))
    stacked = jax.device_get(stacked)
    return state, [{key: value[index] for key, value in stacked.items()} for index in range(chunk)]


def _hooks(
    train: TrainConfig, window: Window, logger: Logger, keep_best: KeepBest, save: SaveCheckpoint, console: Console
) -> tuple[Hooks, ShowProgress]:
    """What runs between the steps, each at its cadence: the throughput window, the loss record,
    the progress bar, validation with the best checkpoint, and saving; and the progress bar."""
    log_loss = LogLoss(window, logger)
    progress = ShowProgress(console, train.steps, log_loss)
    hooks = Hooks(train.steps, window)
    hooks.add(window.add, every=1)
    hooks.add(log_loss, every=train.log_every)
    hooks.add(progress, every=train.log_every)
    hooks.add(keep_best, every=train.eval_every, pauses=True)
    hooks.add(save, every=train.checkpoint_every, pauses=True)
    return hooks, progress


def _placed_batches(
    task: Task,
    featurizer,
    mesh: Mesh,
    arrays: data_lib.Arrays,
    train: TrainConfig,
    start: int,
    window: Window,
    preemption: Preemption,
) -> Iterator[dict]:
    """The training batches from step `start` on, placed on the devices ahead of the steps; the
    `window` counts the examples and tokens of each, and a "stop" column carries whether this
    process was asked to stop by the time the batch was placed."""

    def place(batch):
        tokens = sum(int(batch[key].sum()) for key in task.token_masks)
        window.placed(len(batch["weights"]) * jax.process_count(), tokens * jax.process_count())
        stop = np.full(len(batch["weights"]), preemption.requested() is not None, np.int32)
        return sharding.global_batch(mesh, {**batch, "stop": stop})

    augment = functools.partial(task.augment, featurizer=featurizer)
    cut = train.steps_per_dispatch == 1  # a call of several steps stacks batches of one width
    batches = data_lib.train_batches(arrays, train.batch_size, train.seed, start, augment, task.trim, cut)
    return data_lib.prefetch(batches, place)
