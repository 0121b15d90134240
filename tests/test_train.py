"""The train step and the fit loop: learning, determinism, parallelism equivalences, resume."""

import dataclasses
import json
from itertools import islice

import jax
import numpy as np
import pytest

from core import run, sharding
from core.config import apply_overrides
from core.data import train_batches
from core.errors import UserError
from core.train import build_model, make_steps
from tasks.nlp.sentiment import SentimentTask, tiny


@pytest.fixture(scope="module")
def fitted():
    task = SentimentTask(config=tiny(), data="synthetic")
    examples = task.examples("train")
    featurizer = task.fit_featurizer(examples)
    return featurizer, featurizer(examples)


def train_losses(fitted, overrides=(), steps=6, devices=None, batch=None):
    featurizer, arrays = fitted
    config = apply_overrides(tiny(), ["model.dropout=0.1", *overrides])
    task = SentimentTask(config=config, data="synthetic")
    compiled = make_steps(task, build_model(task, featurizer, config), config, steps, devices)
    state, losses = compiled.state, []
    batches = [batch] * steps if batch else islice(train_batches(arrays, config.train.batch_size, 0), steps)
    for local in batches:
        state, logs = compiled.train_step(state, sharding.global_batch(compiled.mesh, local))
        losses.append(float(logs["loss"]))
    return np.asarray(losses), jax.device_get(state["params"])


def assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, atol=atol)


def test_overfits_one_batch(fitted):
    batch = {k: v[:16] for k, v in fitted[1].items()}
    losses, _ = train_losses(
        fitted, ["model.dropout=0.0", "optim.learning_rate=1e-2", "optim.warmup_steps=0"], 40, batch=batch
    )
    assert losses[0] > 0.5 and losses[-1] < 0.02


def test_same_seed_same_losses(fitted):
    first, params = train_losses(fitted)
    second, params_again = train_losses(fitted)
    np.testing.assert_array_equal(first, second)
    assert_trees_close(params, params_again, 0)


def test_eight_devices_equal_one(fitted):
    assert jax.device_count() == 8
    many, params_many = train_losses(fitted)
    one, params_one = train_losses(fitted, devices=jax.devices()[:1])
    np.testing.assert_allclose(many, one, rtol=1e-5)
    assert_trees_close(params_many, params_one, 1e-5)


@pytest.mark.parametrize("overrides", [["train.fsdp=2"], ["train.remat=True"], ["train.grad_accum=2"]])
def test_switches_keep_the_same_step(fitted, overrides):
    # Without dropout, accumulation over microbatches is the same as one large batch.
    base, params = train_losses(fitted, ["model.dropout=0.0"])
    other, params_other = train_losses(fitted, ["model.dropout=0.0", *overrides])
    np.testing.assert_allclose(base, other, rtol=1e-5)
    assert_trees_close(params, params_other, 1e-5)


def test_bfloat16_compute_tracks_float32(fitted):
    base, _ = train_losses(fitted, ["model.dropout=0.0"])
    half, _ = train_losses(fitted, ["model.dropout=0.0", "train.compute_dtype=bfloat16"])
    np.testing.assert_allclose(base, half, rtol=0.03)


def test_resume_equals_uninterrupted(tmp_path, monkeypatch):
    options = [
        "train.steps=12",
        "train.eval_every=4",
        "train.checkpoint_every=4",
        "train.log_every=1",
        "model.dropout=0.1",
    ]
    run.train(SentimentTask, workdir=tmp_path / "straight", preset="tiny", overrides=options, data="synthetic")

    # Interrupt the second run during its evaluation at step 8 (Ctrl-C): step 4 is the last checkpoint.
    original, calls = SentimentTask.score, []

    def interrupt(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(SentimentTask, "score", interrupt)
    with pytest.raises(UserError, match="Interrupted at step 8.*step 8|Interrupted at step 8"):
        run.train(SentimentTask, workdir=tmp_path / "resumed", preset="tiny", overrides=options, data="synthetic")
    monkeypatch.setattr(SentimentTask, "score", original)
    run.train(SentimentTask, workdir=tmp_path / "resumed", preset="tiny", overrides=options, data="synthetic")

    def losses(name):
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if "loss" in r}

    straight, resumed = losses("straight"), losses("resumed")
    assert sorted(straight) == list(range(1, 13)) and set(straight) <= set(resumed)
    for step in range(1, 13):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6), step


def test_batch_size_must_split_over_devices(tmp_path):
    with pytest.raises(UserError, match="multiple of 8"):
        run.train(SentimentTask, workdir=tmp_path, preset="tiny", overrides=["train.batch_size=12"], data="synthetic")


def test_every_preset_constructs(fitted):
    featurizer, _ = fitted
    for name, preset in SentimentTask.presets.items():
        config = preset()
        task = SentimentTask(config=config, data="synthetic")
        model = build_model(task, dataclasses.replace(featurizer, max_len=config.model.max_len), config)
        assert model.body.config == config.model, name
