"""The plain functions behind the CLI, for Python users too: train, evaluate, predict, embed, report.

from core import run
import tasks
run.train(tasks.get("sentiment"), workdir="runs/sentiment")
print(run.evaluate(tasks.get("sentiment"), "runs/sentiment", split="test"))
print(run.Predictor(tasks.get("sentiment"), "runs/sentiment").predict(["Lovely fabric, fits well"]))
print(run.report("runs/sentiment"))  # best step, its metrics, and runs/sentiment/curves.png

Reading a run back is `core.loading`'s, predicting `core.predict`'s; their public names are
here too, so that one import serves a prototype.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from rich.console import Console

from core import report as report_lib
from core.errors import UserError
from core.loading import (
    DATA_RECORD,
    Loaded,
    checked_workdir,
    data_record,
    load,
    load_featurizer,
    load_pretrained,
    make_config,
    recorded_data,
    saved_config,
)
from core.model import kernels
from core.options import predict_option_values
from core.predict import Predictor, predict
from core.training import data as data_lib
from core.training import host, memory, sharding, transfer
from core.training.checkpoints import undone_on_failure, write_json
from core.training.fit import fit
from core.training.steps import build_model, evaluate_arrays, make_steps

__all__ = [
    "Loaded",
    "Predictor",
    "embed",
    "evaluate",
    "load",
    "load_pretrained",
    "make_config",
    "predict",
    "report",
    "train",
]

log = logging.getLogger("apps")


def _examples(task, split: str) -> list[dict]:
    examples = task.examples(split)
    if not examples:
        raise UserError(f"The {split} split of {task.data or 'the default data'} is empty.")
    return examples


def train(
    task_type: type,
    *,
    workdir: str | Path,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    data: str | None = None,
    console: Console | None = None,
) -> dict[str, float]:
    """Trains (or resumes) a run in `workdir`; returns the final validation metrics."""
    host.keep_freed_memory()  # a training process owns its heap (see core/training/host.py)
    console = console or Console()
    workdir = checked_workdir(workdir)
    config = make_config(task_type, preset, overrides)
    data_lib.check_batch_size(config.train.batch_size, "train.batch_size", config.train.grad_accum)
    data_lib.check_batch_size(config.train.eval_batch_size, "train.eval_batch_size")
    with undone_on_failure(workdir):
        return _train(task_type(config=config, data=data), workdir, console)


def _train(task, workdir: Path, console: Console) -> dict[str, float]:
    config, config_path = task.config, workdir / "config.json"
    if config_path.exists():
        saved = saved_config(config_path, type(task))
        if saved != config:
            raise UserError(
                f"{workdir} holds a run with another configuration (see {config_path}). Resume it with the "
                "same --preset and --set options, or choose a new --workdir."
            )
        recorded = recorded_data(workdir, check=False)
        if (workdir / DATA_RECORD).exists() and data_record(task.data)["data"] != recorded:
            raise UserError(
                f"{workdir} holds a run trained on {recorded or 'the default data'}: resume it with "
                f"{f'--data {recorded}' if recorded else 'no --data'}, or choose a new --workdir."
            )
    started = time.perf_counter()
    train_examples = _examples(task, "train")
    # The featurizer's barrier is the first collective; `fit` names the checkpoint to resume from.
    with sharding.lost_peers(lambda: f"Restart all {jax.process_count()} processes with the same command."):
        featurizer = _featurizer(task, train_examples, workdir)
    # A few rows as the train step sees them (augmented: SpecAugment's masks, negative samples) give its shapes.
    sample = task.augment(task.featurize_train(featurizer, train_examples[:4]), np.random.default_rng(0), featurizer)
    estimate = memory.check(task, featurizer, config, sample)
    console.print(f"{task.name}: {estimate.describe()}.")
    # A heap that never shrinks fragments past the machine under a large run (core/training/host.py).
    large = estimate.where == "host" and estimate.available and estimate.needed > estimate.available / 8
    if large and host.give_back_freed_memory():
        console.print(f"{task.name}: over an eighth of the host's memory: freed memory goes back to the system.")
    if jax.process_index() == 0 and not config_path.exists():
        write_json(workdir / DATA_RECORD, data_record(task.data))
        write_json(config_path, config.to_dict())
    valid_examples = _examples(task, "valid")
    train_arrays, valid_arrays = task.featurize_train(featurizer, train_examples), featurizer(valid_examples)
    console.print(
        f"{task.name}: {len(train_examples)} train, {len(valid_examples)} valid examples; "
        f"featurized in {time.perf_counter() - started:.1f}s on {jax.device_count()} device(s)."
    )
    model = build_model(task, featurizer, config, from_pretrained=True)
    console.print(f"{task.name}: {kernels.chosen().describe()}.")
    if config.model.head_init == "probe":
        log.info(
            transfer.fit_probe(model, task, featurizer, train_arrays, config.train.eval_batch_size, config.train.seed)
        )
    steps = make_steps(task, model, config, config.train.steps)

    def validate(params) -> dict[str, float]:
        streamed, predictions = evaluate_arrays(steps, params, valid_arrays, config.train.eval_batch_size)
        scores = {**streamed, **task.score(predictions, valid_examples, featurizer)}
        if task.validation_decoding is not None:
            options = {**predict_option_values(task, {}), **task.validation_decoding}
            generated = task.generate(steps.decoder(params), featurizer, valid_examples, options)
            scores.update(task.score_generated(generated, valid_examples, featurizer))
        return scores

    metrics = fit(task, featurizer, config, steps, train_arrays, validate, workdir, console)
    if jax.process_index() == 0:
        # Only process 0 writes metrics.jsonl, so only it has the curves to draw.
        console.print(f"Curves drawn in {report_lib.report(workdir)['picture']}.")
    return metrics


def _featurizer(task, train_examples: list[dict], workdir: Path):
    """The run's featurizer: loaded from the workdir, or fitted once (by process 0 in a
    multi-process run, while the others wait) and saved there for every process to load."""
    directory = workdir / "featurizer"
    if jax.process_index() == 0 and not (workdir / "config.json").exists():
        # Left by a run killed before it began (its config is written once the memory check
        # passes; one that fails is undone): fitted again, since the options may have changed since.
        shutil.rmtree(directory, ignore_errors=True)
    if jax.process_index() == 0 and not directory.exists():
        # Fitted into a temporary folder and renamed: a killed run never leaves half a featurizer.
        temporary = workdir / "featurizer.tmp"
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        task.fit_featurizer(train_examples).save(temporary)
        temporary.rename(directory)
        log.info("Fitted the featurizer on %d train examples and saved it in %s.", len(train_examples), directory)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("featurizer saved")
    return load_featurizer(task, directory)


def evaluate(
    task_type: type,
    workdir: str | Path | None = None,
    *,
    split: str = "test",
    data: str | None = None,
    baselines: bool = True,
    model: str | None = None,
    preset: str | None = None,
) -> dict[str, Any]:
    """Scores the best checkpoint of the run in `workdir` on `split`, or a pretrained checkpoint
    `model` as it is (zero-shot, with `preset`'s data and lengths); writes `eval_<split>.json`
    into `workdir` when there is one, and returns it."""
    if model is None:
        if workdir is None:
            raise UserError("Evaluate a trained run (--workdir) or a pretrained checkpoint (--model).")
        loaded = load(task_type, workdir, data)
    else:
        if workdir is not None and (Path(workdir) / "config.json").exists():
            raise UserError(
                f"{workdir} holds a trained run, whose eval_*.json a checkpoint's scores would replace: "
                "give another --workdir."
            )
        loaded = load_pretrained(task_type, model, preset, data)
    task, featurizer = loaded.task, loaded.featurizer
    examples = _examples(task, split)
    streamed, predictions = evaluate_arrays(
        loaded.steps, loaded.params, featurizer(examples), task.config.train.eval_batch_size
    )
    result: dict[str, Any] = {**streamed, **task.score(predictions, examples, featurizer)}
    if task.evaluated_decodings:
        model = loaded.steps.decoder(loaded.params)
        defaults = predict_option_values(task, {})
        for name, settings in task.evaluated_decodings.items():
            generated = task.generate(model, featurizer, examples, {**defaults, **settings})
            result[name] = task.score_generated(generated, examples, featurizer)
    result.update(task.protocol(), split=split, examples=len(examples), checkpoint=loaded.checkpoint)
    if baselines:
        result["baselines"] = task.baselines(_examples(task, "train"), examples, featurizer)
    if jax.process_index() == 0 and workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        write_json(Path(workdir) / f"eval_{split}.json", result)
    return result


def embed(
    task_type: type, workdir: str | Path, lines: Sequence[str], per_position: bool = False
) -> dict[str, np.ndarray]:
    """Embeddings by example id of the inputs `lines` (as `apps predict` reads them) from the body
    of the run in `workdir`: [D] each, or [L, D] with `per_position`."""
    loaded = load(task_type, workdir)
    task = loaded.task
    examples = task.parse_inputs(lines, predict_option_values(task, {}))
    model = loaded.steps.model(loaded.params)
    vectors = task.embed(model, loaded.featurizer, examples, per_position)
    ids = [str(e.get("id", f"input {n}")) for n, e in enumerate(examples, 1)]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise UserError(f"Embeddings are keyed by id, and these ids repeat: {', '.join(repeated[:5])}.")
    return dict(zip(ids, vectors))


def report(workdir: str | Path) -> dict[str, Any]:
    """The best step of the run in `workdir` with its validation metrics; draws `workdir/curves.png`."""
    return report_lib.report(workdir)
