"""What the fit loop does between steps, as small hooks that each do one job at their cadence.

Written after levanter's `Trainer`: the loop (`core.training.fit.fit`) only runs steps and hands each
one's `StepInfo` to `Hooks`, which runs every hook added with `every=N` after each N-th step and
after the last one, in the order they were added. The jobs: `Window` gathers each step's loss and
the throughput clock, `LogLoss` writes a record to metrics.jsonl and stops a run whose loss is
no longer finite, `ShowProgress` moves the rich bar, `KeepBest` validates and keeps the best
parameters, `SaveCheckpoint` saves the training state.

Throughput counts the steps alone: a hook added with `pauses=True` (validation, checkpoints)
stops the clock, after waiting for the steps so far, which belong to the current window.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from core.errors import UserError
from core.training import sharding
from core.training.checkpoints import Checkpoints, read_json, write_json


class StepInfo(NamedTuple):
    """A step just run: its number (counting from 1), the state after it and its logs."""

    step: int
    state: dict[str, Any]
    logs: dict[str, Any]


class Logger:
    """Appends records to metrics.jsonl in the workdir; only process 0 writes."""

    def __init__(self, workdir: Path):
        self.path = workdir / "metrics.jsonl"
        self.active = jax.process_index() == 0

    def write(self, record: dict) -> None:
        if self.active:
            with self.path.open("a") as file:
                file.write(json.dumps(record, sort_keys=True) + "\n")


class Window:
    """The steps since the last log record: their losses (still on the devices), the (examples,
    tokens) of each global batch placed on the devices, in order (the prefetch runs ahead of the
    steps), and the time they took without the pauses."""

    def __init__(self):
        self.counts: list[tuple[int, int]] = []
        self.restart()

    def restart(self) -> None:
        self.start, self.paused, self.losses = time.perf_counter(), 0.0, []

    def placed(self, examples: int, tokens: int) -> None:
        self.counts.append((examples, tokens))

    def add(self, info: StepInfo) -> None:
        """Keeps the step's loss, left on the devices so that the loop never waits for a step."""
        self.losses.append(info.logs["loss"])

    def losses_on_host(self) -> np.ndarray:
        sharding.wait(self.losses)
        return np.asarray(jax.device_get(self.losses))

    def rates(self, steps: int) -> tuple[float, float]:
        """Examples and tokens per second over the window's first `steps` batches, which it drops."""
        elapsed = time.perf_counter() - self.start - self.paused
        window = self.counts[:steps]
        del self.counts[:steps]
        return sum(c[0] for c in window) / elapsed, sum(c[1] for c in window) / elapsed

    @contextmanager
    def pause(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.paused += time.perf_counter() - start


@dataclass(frozen=True)
class Hook:
    """A job that runs after every `every`-th step and after the last; one that `pauses` takes
    time that is not the steps' own."""

    run: Callable[[StepInfo], None]
    every: int
    pauses: bool


class Hooks:
    """The hooks of a run of `last_step` steps, with the `window` whose clock they pause."""

    def __init__(self, last_step: int, window: Window):
        self.last_step = last_step
        self.window = window
        self.hooks: list[Hook] = []

    def add(self, run: Callable[[StepInfo], None], *, every: int, pauses: bool = False) -> None:
        self.hooks.append(Hook(run, every, pauses))

    def run(self, info: StepInfo) -> None:
        """Runs the hooks due after `info.step`; the clock stops at the first one that pauses."""
        due = [hook for hook in self.hooks if info.step % hook.every == 0 or info.step == self.last_step]
        first_pause = next((i for i, hook in enumerate(due) if hook.pauses), len(due))
        for hook in due[:first_pause]:
            hook.run(info)
        if first_pause == len(due):
            return
        sharding.wait(info.state)  # the steps so far belong to the current window
        with self.window.pause():
            for hook in due[first_pause:]:
                hook.run(info)


class LogLoss:
    """Writes the window's record (mean loss, the last gradient norm, throughput) and starts the
    next window; a loss that is not finite ends the run with advice."""

    def __init__(self, window: Window, logger: Logger):
        self.window = window
        self.logger = logger
        self.record: dict[str, Any] = {}

    def __call__(self, info: StepInfo) -> None:
        losses = self.window.losses_on_host()
        if not np.all(np.isfinite(losses)):
            raise UserError(f"The loss became {losses[-1]} at step {info.step}; lower optim.learning_rate.")
        examples_per_s, tokens_per_s = self.window.rates(len(losses))
        self.record = {
            "step": info.step,
            "loss": float(losses.mean()),
            "grad_norm": float(info.logs["grad_norm"]),
            "examples_per_s": examples_per_s,
            "tokens_per_s": tokens_per_s,
        }
        self.logger.write(self.record)
        self.window.restart()


class ShowProgress:
    """The rich progress bar of a run of `total` steps (process 0 alone draws it), showing the
    latest record of `log`."""

    def __init__(self, console: Console, total: int, log: LogLoss):
        self.total = total
        self.log = log
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=console,
            disable=jax.process_index() != 0,
            transient=False,
        )

    @contextmanager
    def shown(self, start: int) -> Iterator[None]:
        """Draws the bar, from step `start`, while the block runs."""
        with self.progress:
            self.bar = self.progress.add_task("train", total=self.total, completed=start, info="")
            yield

    def __call__(self, info: StepInfo) -> None:
        record = self.log.record
        self.progress.update(
            self.bar,
            completed=info.step,
            info=f"loss {record['loss']:.4f}  {rate(record['examples_per_s'])} ex/s  "
            f"{rate(record['tokens_per_s'])} tok/s",
        )


def rate(value: float) -> str:
    """A rate for the progress bar: whole numbers, or two figures below 10 (a pretrained model's
    0.27 rows a second is not 0)."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


class KeepBest:
    """Validates the parameters, logs and prints the metrics, and keeps the parameters whose
    `selector` metric is the best so far (the lowest if `lower_is_better`) in `best/`, with its
    value in best.json, which a resumed run reads back."""

    def __init__(
        self,
        validate: Callable[[Any], dict[str, float]],
        checkpoints: Checkpoints,
        logger: Logger,
        workdir: Path,
        selector: str,
        lower_is_better: bool,
        console: Console,
    ):
        self.validate = validate
        self.checkpoints = checkpoints
        self.logger = logger
        self.path = workdir / "best.json"
        self.selector, self.sign = selector, -1.0 if lower_is_better else 1.0
        self.console = console
        self.best = self._read_best() if self.path.exists() else None
        self.metrics: dict[str, float] = {}  # the latest validation's

    def _read_best(self) -> float:
        best = read_json(self.path, "delete it to let the resumed run choose its best step anew.")
        if not (isinstance(best, dict) and isinstance(best.get("value"), (int, float))):
            raise UserError(
                f"{self.path} holds no numeric best value: delete it to let the resumed run choose its best step anew."
            )
        return best["value"]

    def __call__(self, info: StepInfo) -> None:
        step = info.step
        self.metrics = self.validate(info.state["params"])
        self.logger.write({"step": step, **{f"valid_{k}": v for k, v in self.metrics.items()}})
        value = self.metrics[self.selector]
        if self.best is None or self.sign * value > self.sign * self.best:
            self.best = value
            self.checkpoints.save_best(step, info.state["params"])
            if self.logger.active:
                write_json(self.path, {"step": step, "metric": self.selector, "value": self.best})
        self.console.print(f"step {step}: " + "  ".join(f"valid {k} {v:.4f}" for k, v in self.metrics.items()))


class SaveCheckpoint:
    """Saves the training state; knows the step of the newest checkpoint in `workdir` (`saved`:
    None until one exists), which is what a stopped run can resume from."""

    def __init__(self, checkpoints: Checkpoints, workdir: Path, saved: int | None):
        self.checkpoints = checkpoints
        self.workdir = workdir
        self.saved = saved

    def __call__(self, info: StepInfo) -> None:
        self.checkpoints.save(info.step, info.state)
        self.saved = info.step

    def resume_advice(self) -> str:
        again = "run the same command again"
        if jax.process_count() > 1:
            again = f"restart all {jax.process_count()} processes with the same command"
        if self.saved is None:
            return f"No checkpoint was saved in {self.workdir} yet; {again} to start over."
        return f"The checkpoint of step {self.saved} in {self.workdir} is intact; {again} to resume from it."


class Preemption:
    """SIGTERM and SIGINT while training, as cluster schedulers send them (SLURM, Kubernetes)
    and a person types them: the first asks the run to stop after the step it is in, which it
    checkpoints (`requested`); a second exits at once. Installed only from the main thread (the
    only one Python delivers signals to), and the previous handlers come back on exit.

    The processes of a multi-process run must stop at one step, since saving is collective: the
    request rides in each training batch's "stop" column, whose maximum the train step reduces
    with its gradients (`core.training.fit.fit`), so a signal to any process stops all of them a few
    steps later (the batches placed ahead, then one step), with no collective of its own that
    a lost peer could hang."""

    def __init__(self, console: Console):
        self.console, self.signal = console, None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGTERM, signal.SIGINT):
                self.previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if self.signal is not None:
            sys.stderr.write(f"\n{name} again: exiting at once, without a checkpoint.\n")
            sys.stderr.flush()
            os._exit(128 + number)
        self.signal = name
        sys.stderr.write(f"\n{name}: stopping after this step, with a checkpoint ({name} again exits at once).\n")
        sys.stderr.flush()

    def requested(self) -> str | None:
        """The signal that asked this run to stop, if one did."""
        return self.signal
