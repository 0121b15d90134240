"""A preset's test figures over several seeds: their mean and spread, not one run's luck.

    apps seeds sentiment --seeds 3      # runs/seeds/sentiment/seed0..seed2, then the table

Each seed is a whole run (`train.seed` sets the initialization, the batch order and dropout)
in WORKDIR/seed<N>, trained and scored on the test split as `apps train` and `apps eval` do. A
seed whose `eval_test.json` exists is read back, not rerun, and an interrupted one resumes from
its last checkpoint, so the command can be stopped and restarted and regenerates the table from
what is there. The table gives each metric of each column (the model, each evaluated decoding,
each baseline) its mean, sample standard deviation, minimum and maximum over the seeds, and
every seed's value; it is also written to WORKDIR/seeds.json.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from core import run
from core.errors import UserError
from core.training.checkpoints import read_json, write_json

REPORT = "eval_test.json"


def across_seeds(
    task_type: type,
    seeds: Sequence[int],
    workdir: str | Path,
    *,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    data: str | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Trains and scores one run per seed (reusing finished ones) -> the rows of `spread` and,
    per seed, its test report and the wall time it took here (None when read back)."""
    if not seeds:
        raise UserError("Give at least one seed.")
    if any(key.strip().startswith("train.seed") for key in overrides):
        raise UserError("--set train.seed is what the seeds set: leave it out.")
    console = console or Console()
    workdir = Path(workdir)
    reports, seconds = {}, {}
    for seed in seeds:
        directory = workdir / f"seed{seed}"
        if (directory / REPORT).exists():
            seconds[seed] = None
            console.print(f"seed {seed}: read back from {directory / REPORT}.")
        else:
            console.print(f"seed {seed}: training in {directory}.")
            started = time.perf_counter()
            run.train(
                task_type,
                workdir=directory,
                preset=preset,
                overrides=[*overrides, f"train.seed={seed}"],
                data=data,
                console=console,
            )
            run.evaluate(task_type, directory, split="test", data=data)
            seconds[seed] = round(time.perf_counter() - started, 1)
        # Always the file: a fresh report and a read-back one then give the same table.
        reports[seed] = read_json(directory / REPORT, f"delete it and rerun to score seed {seed} again.")
    result = {
        "task": task_type.name,
        "preset": preset or task_type.default_preset,
        "overrides": list(overrides),
        "seeds": list(seeds),
        "seconds": {str(seed): value for seed, value in seconds.items()},
        "rows": spread(reports),
    }
    write_json(workdir / "seeds.json", result)
    return result


def columns(report: dict) -> dict[str, dict[str, float]]:
    """A test report's columns of numbers: the model's own metrics, each evaluated decoding's,
    each baseline's."""
    found = {"model": {key: value for key, value in report.items() if isinstance(value, float)}}
    for key, value in report.items():
        if key != "baselines" and isinstance(value, dict):
            found[key] = {name: number for name, number in value.items() if isinstance(number, float)}
    found.update(
        {
            name: {k: v for k, v in values.items() if isinstance(v, float)}
            for name, values in report.get("baselines", {}).items()
        }
    )
    return {name: values for name, values in found.items() if values}


def spread(reports: dict[int, dict]) -> list[dict[str, Any]]:
    """One row per (column, metric) found in every seed's report: mean, sample standard deviation
    (0 for one seed), minimum, maximum and each seed's value."""
    per_seed = {seed: columns(report) for seed, report in reports.items()}
    first = next(iter(per_seed.values()))
    rows = []
    for column, metrics in first.items():
        for metric in metrics:
            values = [per_seed[seed].get(column, {}).get(metric) for seed in per_seed]
            if any(value is None for value in values):
                continue  # a metric some seed's report lacks (an older version wrote it)
            rows.append(
                {
                    "column": column,
                    "metric": metric,
                    "mean": statistics.fmean(values),
                    "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                    "min": min(values),
                    "max": max(values),
                    **{f"seed {seed}": value for seed, value in zip(per_seed, values)},
                }
            )
    return rows
