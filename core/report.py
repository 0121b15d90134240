"""A run's report: the best validation step, its metrics, and the curves drawn into curves.png.

from core.report import report
print(report("runs/sentiment"))  # {"best_step": 300, "metric": "accuracy", ..., "picture": ...}

It reads only the workdir's `metrics.jsonl` (training and validation records, one JSON object a
line, as `core.training.steps.Logger` appends them) and `best.json`, so it works on a run that is still
training, and on one that was killed, without JAX or the task's code.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from core.errors import UserError

log = logging.getLogger("apps")

VALID_PREFIX = "valid_"
PICTURE_NAME = "curves.png"


def report(workdir: str | Path) -> dict[str, Any]:
    """Draws `workdir/curves.png` and returns the best step with its validation metrics.

    The best step is the one `best.json` names; without it (the run has not validated yet, or
    the file was removed) it is the last validation record, and `metric` and `value` are None.
    `metrics` holds the validation metrics of that step without their `valid_` prefix (the names
    `best.json` and `apps eval` use); it is empty when the run has no validation record yet.
    """
    workdir = Path(workdir)
    metrics_path = workdir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserError(
            f"{workdir} holds no run (no {metrics_path.name}): train one with `apps train TASK --workdir DIR`."
        )
    records = _read_records(metrics_path)
    training = _by_step(record for record in records if "loss" in record)
    validation = _by_step(record for record in records if any(key.startswith(VALID_PREFIX) for key in record))
    best = _read_best(workdir / "best.json")
    if best is not None:
        best_step, metric, value = best["step"], best["metric"], float(best["value"])
    elif validation:
        best_step, metric, value = validation[-1]["step"], None, None
    else:
        best_step, metric, value = None, None, None
    at_best = next((record for record in validation if record["step"] == best_step), {})
    metrics = {
        key.removeprefix(VALID_PREFIX): float(number)
        for key, number in at_best.items()
        if key.startswith(VALID_PREFIX) and _is_number(number)
    }
    if metric is not None and metric not in metrics:
        # metrics.jsonl lost the record best.json points at (a killed run cut it short); best.json
        # still knows the selecting metric's value.
        metrics[metric] = value
    picture = _draw(workdir / PICTURE_NAME, str(workdir), training, validation, best_step)
    return {"best_step": best_step, "metric": metric, "value": value, "metrics": metrics, "picture": picture}


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects with a step in `path`; any other line is skipped with a warning naming it.

    A killed run can leave its last line cut short, and a hand-edited file can hold a bad line;
    neither should hide the rest of the curves, so only a file with no usable record is an error.
    """
    lines = path.read_bytes().splitlines()
    if not any(line.strip() for line in lines):
        raise UserError(f"{path} is empty: the run has not logged a step yet.")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            last = " (the last, cut short as a killed run leaves it)" if number == len(lines) else ""
            log.warning(f"{path} line {number}{last} is not a JSON record with a step; skipped.")
            continue
        records.append(record)
    if not records:
        raise UserError(f"{path} holds no usable record: no line is a JSON object with an integer step.")
    return records


def _by_step(records) -> list[dict[str, Any]]:
    """One record per step, in step order; the later line wins.

    A resumed run restarts from its last checkpoint, which can be older than its last logged
    step, so the steps in between are logged twice; the second time is the run that continued.
    """
    return sorted({record["step"]: record for record in records}.values(), key=lambda record: record["step"])


def _read_best(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        best = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        best = None
    if not (
        isinstance(best, dict)
        and isinstance(best.get("step"), int)
        and isinstance(best.get("metric"), str)
        and _is_number(best.get("value"))
    ):
        raise UserError(
            f"{path} is not a JSON object with an integer step, a metric name and a numeric value; "
            "remove it to report the last validation step instead."
        )
    return best


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _draw(path: Path, title: str, training: list[dict], validation: list[dict], best_step: int | None) -> Path:
    """Training loss, each validation metric and the throughput against the step, one panel each."""
    # The figure and the Agg canvas are built directly rather than through pyplot, so drawing
    # needs no display and leaves the caller's pyplot backend and open figures alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = []
    if any("loss" in record for record in training):
        panels.append(lambda axes: _plot_loss(axes, training))
    names = sorted({key for record in validation for key in record if key.startswith(VALID_PREFIX)})
    for name in names:
        panels.append(lambda axes, name=name: _plot_validation(axes, validation, name, best_step))
    if any("tokens_per_s" in record or "examples_per_s" in record for record in training):
        panels.append(lambda axes: _plot_throughput(axes, training))
    columns = min(3, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / columns))
    width, height = 5 * columns, 3.6 * rows
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    figure.suptitle(title)
    # Margins fixed in inches rather than a layout engine's: "constrained" took half of a
    # run's 1-3 s drawing (a speech run's dozen panels), and the panels' labels are alike.
    figure.subplots_adjust(
        left=0.8 / width, right=1 - 0.8 / width, bottom=0.6 / height, top=1 - 0.8 / height, wspace=0.5, hspace=0.6
    )
    for index, draw in enumerate(panels, start=1):
        axes = figure.add_subplot(rows, columns, index)
        draw(axes)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
    # Written under another name and renamed, so a viewer never opens half a picture.
    temporary = path.with_name(path.name + ".tmp")
    figure.savefig(temporary, format="png", dpi=100)
    temporary.replace(path)
    return path


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    kept = [record for record in records if _is_number(record.get(key))]
    return [record["step"] for record in kept], [float(record[key]) for record in kept]


def _plot_loss(axes, training: list[dict]) -> None:
    axes.plot(*_series(training, "loss"), color="tab:blue")
    axes.set_title("training loss")
    axes.set_ylabel("loss")


def _plot_validation(axes, validation: list[dict], name: str, best_step: int | None) -> None:
    steps, values = _series(validation, name)
    axes.plot(steps, values, marker="o", markersize=3, color="tab:green")
    if best_step in steps:
        best_value = values[steps.index(best_step)]
        axes.axvline(best_step, color="tab:red", linestyle=":", linewidth=1)
        axes.plot([best_step], [best_value], marker="*", markersize=12, color="tab:red", linestyle="none")
        axes.annotate(
            f"best: step {best_step}, {best_value:.4g}",
            (best_step, best_value),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    axes.set_title(f"validation {name.removeprefix(VALID_PREFIX)}")
    axes.set_ylabel(name.removeprefix(VALID_PREFIX))


def _plot_throughput(axes, training: list[dict]) -> None:
    # Tokens and examples per second differ by the sequence length, so each gets its own axis.
    tokens = axes.plot(*_series(training, "tokens_per_s"), color="tab:purple", label="tokens/s")
    axes.set_ylabel("tokens/s")
    examples_axes = axes.twinx()
    examples = examples_axes.plot(*_series(training, "examples_per_s"), color="tab:orange", label="examples/s")
    examples_axes.set_ylabel("examples/s")
    lines = tokens + examples
    axes.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="lower right")
    axes.set_title("throughput")
