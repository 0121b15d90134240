"""Starting a run from another run's weights (`apps train TASK --init-from RUN_DIR`).

The new model takes the front end's (`embedder.*`) and the body's (`body.*`) parameters of the
other run's best checkpoint; its head and its optimizer start fresh. The two runs may be of
different tasks (masked-residue pretraining, then classification) as long as their embedders
and bodies have the same parameters of the same shapes: any difference is reported by
parameter name before training starts.

With `model.head_init="probe"` the fresh head does not start random: `fit_probe` fits it as a
logistic regression on the loaded trunk's features, the first stage of LP-FT (Kumar et al.,
2022, "Fine-Tuning can Distort Pretrained Features"). A random head's first gradients pull the
pretrained features towards itself; a fitted one lets fine-tuning start from what they hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.checkpoints.rules import Report, flat_params, flatten, set_params
from core.errors import UserError
from core.model.heads import LinearProbe
from core.training import data as data_lib
from core.training.checkpoints import Checkpoints


def init_from(model: nnx.Module, run_dir: str) -> Report:
    """Fills the parts of `model` that it declares `transferred` (a `Model`'s embedder and body)
    from the best checkpoint of the run in `run_dir`."""
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
    transferred = tuple(f"{part}." for part in model.transferred)  # declared by the model
    saved = {k: v for k, v in everything.items() if k.startswith(transferred)}
    params = flat_params(model)
    wanted = {k: v for k, v in params.items() if k.startswith(transferred)}
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
    set_params(model, {name: np.asarray(saved[name]).astype(wanted[name].dtype) for name in wanted})
    return Report(
        directory / restored.source / str(restored.step),
        filled=tuple(wanted),
        new=tuple(name for name in params if name not in wanted),
        unused=tuple(k for k in everything if k not in wanted),
    )


# At most this many training rows feed the probe: a logistic regression fits them in seconds.
PROBE_ROWS = 20_000


@nnx.jit
def _probe_rows(model: nnx.Module, batch: dict) -> tuple:
    x, mask = model.embedder(batch["inputs"], batch["mask"])
    return model.head.probe_rows(model.body(x, mask), mask, batch)


def fit_probe(model: nnx.Module, task, featurizer, arrays: dict[str, np.ndarray], batch_size: int, seed: int) -> str:
    """Sets the head's linear layer to `linear_probe` of the loaded trunk's features of up to
    PROBE_ROWS training rows, as training sees them (the task's `augment` applied once) but
    without dropout. Returns a line for the log."""
    head = model.head
    if not isinstance(head, LinearProbe):
        raise UserError(
            f"model.head_init=probe fits a linear head on pooled features; {task.name}'s head "
            f"({type(head).__name__}) is not one."
        )
    total = min(data_lib.size(arrays), PROBE_ROWS)
    parts = []
    for start in range(0, total, batch_size):
        rows = data_lib.take(arrays, np.arange(start, min(start + batch_size, total)))
        batch = task.augment(rows, np.random.default_rng((seed, start)), featurizer)
        parts.append([np.asarray(part) for part in _probe_rows(model, {k: jnp.asarray(v) for k, v in batch.items()})])
    features, targets, weights = (np.concatenate(column) for column in zip(*parts))
    kernel, bias, accuracy = linear_probe(features, targets, weights, head.linear.bias.shape[0])
    dtype = head.linear.kernel.dtype
    set_params(model, {"head.linear.kernel": kernel.astype(dtype), "head.linear.bias": bias.astype(dtype)})
    return (
        f"Head fitted as a logistic-regression probe on the loaded features of {int((weights > 0).sum())} "
        f"training rows (training accuracy {accuracy:.3f})."
    )


def linear_probe(
    features: np.ndarray, targets: np.ndarray, weights: np.ndarray, num_classes: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """A logistic regression (scikit-learn, L2, C=1) on standardized `features` [N, D] of the
    rows with weight > 0, as the kernel [D, C] and bias [C] of a linear layer over the raw
    features (the standardization folded in), and its training accuracy. Classes that the rows
    lack get no weight and the lowest bias."""
    # Imported here: scikit-learn's import starts threads, and `core.training.host.keep_freed_memory` must
    # run before any thread does (importing the suite leaves the allocator alone).
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    kept = weights > 0
    features, targets, weights = features[kept].astype(np.float64), targets[kept], weights[kept]
    if len(np.unique(targets)) < 2:
        raise UserError("model.head_init=probe needs at least two classes among the training rows.")
    scaler = StandardScaler().fit(features, sample_weight=weights)
    standardized = scaler.transform(features)
    probe = LogisticRegression(max_iter=1000).fit(standardized, targets, sample_weight=weights)
    coef = probe.coef_ / scaler.scale_
    intercept = probe.intercept_ - coef @ scaler.mean_
    if len(probe.classes_) == 2:  # one row, for the second class against the first
        coef, intercept = np.concatenate([np.zeros_like(coef), coef]), np.concatenate([[0.0], intercept])
    kernel, bias = np.zeros((features.shape[1], num_classes)), np.full(num_classes, intercept.min() - 30.0)
    kernel[:, probe.classes_], bias[probe.classes_] = coef.T, intercept
    return kernel, bias, probe.score(standardized, targets, sample_weight=weights)
