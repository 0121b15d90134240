"""Starting a run from another run's weights (`apps train TASK --init-from RUN_DIR`).

The new model takes the front end's (`embedder.*`) and the body's (`body.*`) parameters of the
other run's best checkpoint; its head and its optimizer start fresh. The two runs may be of
different tasks (masked-residue pretraining, then classification) as long as their embedders
and bodies have the same parameters of the same shapes: any difference is reported by
parameter name before training starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

from core import pretrained
from core.checkpoint import Checkpoints
from core.errors import UserError
from core.pretrained import flatten

# The parts of a `core.transformer.Model` that carry over; the head is the task's own.
TRANSFERRED = ("embedder.", "body.")


def init_from(model: nnx.Module, run_dir: str) -> pretrained.Report:
    """Fills the embedder and body of `model` from the best checkpoint of the run in `run_dir`."""
    directory = Path(run_dir)
    if not (directory / "config.json").is_file():
        raise UserError(f"--init-from {run_dir}: no trained run there (no config.json).")
    source_task = json.loads((directory / "config.json").read_text()).get("task", "?")
    checkpoints = Checkpoints(directory, read_only=True)
    try:
        restored = checkpoints.read_params()
    finally:
        checkpoints.close()
    everything = flatten(restored.value)
    saved = {k: v for k, v in everything.items() if k.startswith(TRANSFERRED)}
    params = pretrained.flat_params(model)
    wanted = {k: v for k, v in params.items() if k.startswith(TRANSFERRED)}
    problems = [
        f"{name} is {list(saved[name].shape)} there, {list(wanted[name].shape)} here"
        for name in sorted(saved.keys() & wanted.keys())
        if saved[name].shape != wanted[name].shape
    ]
    problems += [f"this model has no {name}" for name in sorted(saved.keys() - wanted.keys())]
    problems += [f"that run has no {name}" for name in sorted(wanted.keys() - saved.keys())]
    if problems:
        raise UserError(
            f"--init-from {run_dir} (a {source_task} run) does not fit this model: "
            + "; ".join(problems)
            + ". Give this run the same model sizes (--preset or --set model.*) as that one."
        )
    pretrained.set_params(model, {name: np.asarray(saved[name]).astype(wanted[name].dtype) for name in wanted})
    return pretrained.Report(
        directory / restored.source / str(restored.step),
        filled=tuple(wanted),
        new=tuple(name for name in params if name not in wanted),
        unused=tuple(k for k in everything if k not in wanted),
    )
