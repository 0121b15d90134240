"""The task contract, run against every registered task on its synthetic split."""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest
from flax import nnx

import tasks
from core import metrics as metric_lib
from core.config import Config, apply_overrides
from core.training import data as data_lib
from core.training import sharding
from core.training.steps import build_model, make_steps

NAMES = sorted(tasks.REGISTRY)


@pytest.fixture(scope="module", params=NAMES)
def setup(request):
    task_type = tasks.get(request.param)
    task = task_type(config=task_type.presets["tiny"](), data="synthetic")
    train = task.examples("train")
    featurizer = task.fit_featurizer(train)
    return task_type, task, train, featurizer


def test_class_attributes(setup):
    task_type, *_ = setup
    assert {"tiny", task_type.default_preset} <= set(task_type.presets)
    assert task_type.metric_names and task_type.summary and task_type.default_data
    assert task_type.best_metric in task_type.metric_names and isinstance(task_type.lower_is_better, bool)
    for name, preset in task_type.presets.items():
        config = preset()
        assert isinstance(config, Config) and config.task == task_type.name and config.preset == name
        assert isinstance(config.data, task_type.data_type)


def check_batch(arrays: dict) -> None:
    """The documented keys of core/task.py, with their shapes and dtypes."""
    assert {"inputs", "mask", "targets", "weights"} <= set(arrays)
    rows = data_lib.size(arrays)
    assert all(len(v) == rows for v in arrays.values())
    mask = arrays["mask"]
    assert mask.dtype == bool and mask.ndim == 2 and mask.any(1).all()
    inputs = arrays["inputs"]
    assert inputs.shape[:2] == mask.shape and inputs.ndim in (2, 3)
    assert np.issubdtype(inputs.dtype, np.integer if inputs.ndim == 2 else np.floating)
    targets = arrays["targets"]
    # An encoder-decoder's targets follow the decoder's positions, others the inputs'.
    target_positions = arrays["decoder_mask"].shape if "decoder_mask" in arrays else mask.shape
    assert np.issubdtype(targets.dtype, np.integer) and targets.shape in ((rows,), target_positions)
    if "decoder_mask" in arrays:
        assert arrays["decoder_inputs"].shape == targets.shape and arrays["decoder_mask"].dtype == bool
    if "target_mask" in arrays:
        assert arrays["target_mask"].dtype == bool and arrays["target_mask"].shape == targets.shape
    assert arrays["weights"].dtype == np.float32 and arrays["weights"].shape == (rows,)
    assert set(np.unique(arrays["weights"])) <= {0.0, 1.0}


def test_splits_and_batches(setup):
    _, task, train, featurizer = setup
    for split in ("train", "valid", "test"):
        examples = train if split == "train" else task.examples(split)
        assert examples, split
        check_batch(featurizer(examples))
    check_batch(task.featurize_train(featurizer, train))
    assert {"dataset", "protocol"} <= set(task.protocol())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_lowers_the_loss(setup, dtype):
    task_type, _, train, featurizer = setup
    # No warm-up (whose first step has rate 0) and no dropout: every step learns, and the loss
    # of one batch of the synthetic training split, trained on 8 times, falls by a quarter or
    # more for every task (a fifth is the margin asserted). In bfloat16 the step takes the
    # accelerator's path: XLA's kernels, the layers scanned (core/model/kernels).
    overrides = [
        f"train.compute_dtype={dtype}",
        f"model.kernels={'xla' if dtype == 'bfloat16' else 'auto'}",
        "optim.warmup_steps=0",
        "optim.learning_rate=3e-3",
        "model.dropout=0.0",
    ]
    config = apply_overrides(task_type.presets["tiny"](), overrides)
    task = task_type(config=config, data="synthetic")
    compiled = make_steps(task, build_model(task, featurizer, config), config, 8)
    arrays = task.featurize_train(featurizer, train)
    local = next(
        data_lib.train_batches(
            arrays, 16, 0, augment=functools.partial(task.augment, featurizer=featurizer), trim=task.trim
        )
    )
    state, batch, losses = compiled.state, sharding.global_batch(compiled.mesh, local), []
    for step in range(8):
        state, logs = compiled.train_step(state, batch)
        assert np.isfinite(float(logs["loss"])) and np.isfinite(float(logs["grad_norm"])), (dtype, step)
        losses.append(float(logs["loss"]))
    assert losses[-1] < 0.8 * losses[0], losses
    for leaf in jax.tree.leaves(state["params"]):
        assert leaf.dtype == np.float32  # bf16 is for compute; the parameters stay float32


def test_forward_loss_metrics_decode_score(setup):
    """Forward, loss, metrics, decoding and generation on the accelerator's path (XLA's kernels,
    layers scanned); the CPU's own kernels run the same end to end through the CLI's tests."""
    task_type, task, train, featurizer = setup
    task = task_type(config=apply_overrides(task.config, ["model.kernels=xla"]), data="synthetic")
    model = build_model(task, featurizer, task.config)
    rows = {k: v[:8] for k, v in task.featurize_train(featurizer, train).items()}
    batch = task.augment(rows, np.random.default_rng(0), featurizer)  # a training batch, as the train step sees it
    total, weight = task.loss(model(task.augment_on_device(batch)), batch)
    assert np.isfinite(float(total)) and float(weight) > 0
    examples = task.examples("test")[:8]
    batch = jax.tree.map(np.asarray, featurizer(examples))
    outputs = model(batch)
    streamed = metric_lib.finish(task.metrics(outputs, batch))
    decoded = jax.tree.map(np.asarray, task.decode(outputs, batch))
    assert all(len(v) == data_lib.size(batch) for v in decoded.values())  # a row each (lm packs examples)
    scores = {**streamed, **task.score(decoded, examples, featurizer)}
    if task.evaluated_decodings:
        defaults = {option.name: option.default for option in task.predict_options}
        for settings in task.evaluated_decodings.values():
            generated = task.generate(model, featurizer, examples, {**defaults, **settings})
            scores.update(task.score_generated(generated, examples, featurizer))
    assert set(task.metric_names) <= set(scores)
    if not task.generates:
        rows = task.render(decoded, examples, featurizer)
        # Typed values, as `apps predict --format json` writes them: text, numbers, lists of them,
        # Python's own types (json refuses numpy's), never a number rendered as text.
        assert rows and json.loads(json.dumps(rows)) == rows
        assert all(type(value) in (str, int, float, list) for row in rows for value in row.values())


def test_every_preset_constructs(setup):
    task_type, _, train, _ = setup
    for preset in task_type.presets.values():
        task = task_type(config=preset(), data="synthetic")
        featurizer = task.fit_featurizer(train)
        # Built abstractly: every module and shape as the preset wires them, no weights drawn
        # (a pretrained preset's 135M random parameters would take a minute to draw on a CPU).
        model = nnx.eval_shape(functools.partial(build_model, task, featurizer, task.config))
        if hasattr(model, "encoder"):  # an encoder-decoder: the config's stacks, causal set per stack
            assert model.encoder.config == dataclasses.replace(task.config.model, causal=False)
            assert model.decoder.config.causal and model.decoder.cross_attention
        else:
            assert model.body.config == task.config.model
