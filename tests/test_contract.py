"""The task contract, run against every registered task on its synthetic split."""

import jax
import numpy as np
import pytest

import tasks
from core import data as data_lib
from core import metrics as metric_lib
from core.config import Config
from core.task import BATCH_KEYS
from core.train import build_model

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
    for name, preset in task_type.presets.items():
        config = preset()
        assert isinstance(config, Config) and config.task == task_type.name and config.preset == name
        assert isinstance(config.data, task_type.data_type)


def test_splits_and_batches(setup):
    _, task, train, featurizer = setup
    for split in ("train", "valid", "test"):
        examples = train if split == "train" else task.examples(split)
        assert examples, split
        arrays = featurizer(examples)
        assert {"inputs", "mask", "targets", "weights"} <= set(arrays)
        assert set(arrays) >= set(k for k in BATCH_KEYS if k in arrays)
        rows = data_lib.size(arrays)
        assert all(len(v) == rows for v in arrays.values())
        assert arrays["mask"].dtype == bool and arrays["mask"].any(1).all()
    assert {"dataset", "protocol"} <= set(task.protocol())


def test_forward_loss_metrics_decode_score(setup):
    _, task, train, featurizer = setup
    model = build_model(task, featurizer, task.config)
    batch = {k: v[:8] for k, v in featurizer(train).items()}
    total, weight = task.loss(model(batch), batch)
    assert np.isfinite(float(total)) and float(weight) > 0
    examples = task.examples("test")[:8]
    batch = jax.tree.map(np.asarray, featurizer(examples))
    outputs = model(batch)
    streamed = metric_lib.finish(task.metrics(outputs, batch))
    decoded = jax.tree.map(np.asarray, task.decode(outputs, batch))
    assert all(len(v) == len(examples) for v in decoded.values())
    scores = {**streamed, **task.score(decoded, examples, featurizer)}
    assert set(task.metric_names) <= set(scores)
    rows = task.render(decoded, examples, featurizer)
    assert rows and all(isinstance(v, str) for row in rows for v in row.values())


def test_every_preset_constructs(setup):
    task_type, _, train, _ = setup
    for preset in task_type.presets.values():
        task = task_type(config=preset(), data="synthetic")
        model = build_model(task, task.fit_featurizer(train), task.config)
        assert model.body.config == task.config.model
