"""The train step and the fit loop: learning, determinism, parallelism equivalences, resume."""

import json
import re
from itertools import islice

import jax
import numpy as np
import pytest

from core import run
from core.config import apply_overrides
from core.errors import UserError
from core.model.shapes import bucket_width
from core.training import sharding
from core.training.data import train_batches
from core.training.hooks import Hooks, StepInfo, Window
from core.training.steps import build_model, make_steps
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


def compiled_step(fitted, overrides):
    """The train step of the tiny sentiment model, its state and one global batch."""
    featurizer, arrays = fitted
    config = apply_overrides(tiny(), overrides)
    task = SentimentTask(config=config, data="synthetic")
    compiled = make_steps(task, build_model(task, featurizer, config), config, 5)
    batch = sharding.global_batch(compiled.mesh, next(train_batches(arrays, config.train.batch_size, 0)))
    return compiled, batch


def test_fsdp_shards_parameters_and_moments(fitted):
    for fsdp, expected in ((1, set()), (2, {"fsdp"})):
        compiled, _ = compiled_step(fitted, [f"train.fsdp={fsdp}"])
        for part in ("params", "opt_state"):
            axes = {axis for leaf in jax.tree.leaves(compiled.state[part]) for axis in leaf.sharding.spec if axis}
            assert axes == expected, (fsdp, part, axes)
        kernel = compiled.state["params"]["body"]["blocks"][0]["mlp"]["up"]["kernel"]
        assert kernel.addressable_shards[0].data.size == kernel.size // fsdp


def test_remat_puts_checkpoints_in_the_step(fitted):
    counts = []
    for remat in (False, True):
        compiled, batch = compiled_step(fitted, [f"train.remat={remat}"])
        jaxpr = str(jax.make_jaxpr(compiled.train_step)(compiled.state, batch))
        counts.append(len(re.findall(r"\b(?:remat\d*|checkpoint)\[", jaxpr)))
    # One rematerialized call per block (the tiny preset has one), none without the switch.
    assert counts == [0, 1]


def test_bfloat16_puts_bfloat16_matmuls_in_the_step(fitted):
    # The program JAX hands XLA; XLA:CPU then computes bf16 dots in f32 (on GPUs they stay bf16).
    operand_types = []
    for dtype in ("float32", "bfloat16"):
        compiled, batch = compiled_step(fitted, [f"train.compute_dtype={dtype}"])
        program = compiled.train_step.lower(compiled.state, batch).as_text()
        dots = re.findall(r"dot_general.*: \((tensor<[^)]*)\)", program)
        operand_types.append({"bf16" in operands for operands in dots})
    assert operand_types[0] == {False}
    # Forward and backward: every product (the body's projections, attention, the head) takes
    # bf16 operands, not one of them.
    assert operand_types[1] == {True}


def test_bfloat16_compute_tracks_float32(fitted):
    base, _ = train_losses(fitted, ["model.dropout=0.0"])
    half, _ = train_losses(fitted, ["model.dropout=0.0", "train.compute_dtype=bfloat16"])
    np.testing.assert_allclose(base, half, rtol=0.03)


def test_bfloat16_products_track_float32_and_put_bfloat16_dots_in_float32_steps(fitted):
    """`train.matmul_dtype=bfloat16`: every dot of the body's step (the layers' and the
    attention's, forward and backward) takes bfloat16 operands, the activations stay float32 and
    the losses follow float32 training's."""
    base, _ = train_losses(fitted, ["model.dropout=0.0"])
    mixed, _ = train_losses(fitted, ["model.dropout=0.0", "train.matmul_dtype=bfloat16"])
    np.testing.assert_allclose(base, mixed, rtol=0.01)
    assert not np.array_equal(base, mixed)
    compiled, batch = compiled_step(fitted, ["train.matmul_dtype=bfloat16"])
    program = compiled.train_step.lower(compiled.state, batch).as_text()
    dots = re.findall(r"dot_general.*: \((tensor<[^)]*)\) -> (tensor<[^>]*>)", program)
    assert all("f32" in result for _, result in dots)
    low = [operands for operands, _ in dots if operands.count("bf16") == 2]
    # All but the 3 of the classifier's [32, 2] layer (forward and both gradients): heads keep float32.
    assert len(low) >= 12 and len(dots) - len(low) == 3


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
    with pytest.raises(UserError, match="Interrupted at step 8. The checkpoint of step 4 .* is intact"):
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


def test_trimmed_batches_group_lengths_and_resume_exactly():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 41, 1000)
    mask = np.arange(40)[None, :] < lengths[:, None]
    arrays = {"inputs": np.where(mask, 5, 0), "mask": mask, "weights": np.ones(1000, np.float32)}
    trim = {"mask": ("inputs",)}
    batches = list(islice(train_batches(arrays, 10, 3, trim=trim), 150))  # one epoch and a half
    for batch in batches:
        width, longest = batch["mask"].shape[1], batch["mask"].sum(1).max()
        # Cut to the longest row, rounded up to its bucket; nothing real is lost.
        assert width == bucket_width(longest, 40) and batch["inputs"].shape[1] == width
        assert batch["inputs"].sum() == 5 * batch["mask"].sum()
    # Sorted within windows: a batch's lengths are close (shuffled rows would spread over ~40).
    assert np.median([np.ptp(b["mask"].sum(1)) for b in batches]) <= 2
    # Every row once per epoch; resuming at step 120 gives the same batches.
    seen = np.concatenate([np.sort(b["mask"].sum(1)) for b in batches[:100]])
    np.testing.assert_array_equal(np.sort(seen), np.sort(lengths))
    resumed = list(islice(train_batches(arrays, 10, 3, start_step=120, trim=trim), 30))
    for a, b in zip(batches[120:], resumed):
        np.testing.assert_array_equal(a["mask"], b["mask"])


def test_bucket_widths_by_hand():
    widths = {n: bucket_width(n, 1000) for n in (1, 8, 9, 32, 33, 48, 49, 64, 65, 97, 200)}
    assert widths == {1: 8, 8: 8, 9: 16, 32: 32, 33: 48, 48: 48, 49: 64, 64: 64, 65: 96, 97: 128, 200: 256}
    assert bucket_width(100, 40) == 40  # never past the featurizer's width


def test_hooks_run_at_their_cadence_in_order_and_pausing_ones_stop_the_clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("core.training.hooks.time.perf_counter", lambda: now[0])
    window, calls = Window(), []
    hooks = Hooks(7, window)

    def job(name, seconds=0.0):
        def run(info):
            now[0] += seconds
            calls.append((name, info.step))

        return run

    hooks.add(job("log"), every=3)
    hooks.add(job("validate", seconds=10.0), every=5, pauses=True)
    hooks.add(job("save", seconds=1.0), every=2, pauses=True)
    for step in range(1, 8):
        hooks.run(StepInfo(step, {}, {}))
    assert calls == [
        *[("save", 2), ("log", 3), ("save", 4), ("validate", 5), ("log", 6), ("save", 6)],
        *[("log", 7), ("validate", 7), ("save", 7)],
    ]
    assert window.paused == 4 * 1.0 + 2 * 10.0  # four saves, two validations; no LogLoss restarts the window


def test_steps_run_several_to_a_call_as_one_at_a_time(tmp_path, monkeypatch):
    """train.steps_per_dispatch=4 over ten steps: two calls of four steps, then two single
    steps, with the losses, validation and final metrics of ten single steps (the batches kept
    at full width: the padding changes nothing but the order of float sums)."""
    from core.training import steps as steps_lib

    calls = []
    call = steps_lib._Bound.__call__
    monkeypatch.setattr(
        steps_lib._Bound,
        "__call__",
        lambda self, first, batch: calls.append((type(batch), "opt_state" in first)) or call(self, first, batch),
    )
    options = ["train.steps=10", "train.eval_every=4", "train.checkpoint_every=4", "train.log_every=1"]
    single = run.train(SentimentTask, workdir=tmp_path / "single", preset="tiny", overrides=options, data="synthetic")
    calls.clear()
    chunked = ["train.steps_per_dispatch=4", *options]
    several = run.train(SentimentTask, workdir=tmp_path / "several", preset="tiny", overrides=chunked, data="synthetic")
    assert calls.count((tuple, True)) == 2 and calls.count((dict, True)) == 2  # and evaluation's calls

    def records(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    one, four = records("single"), records("several")
    assert [sorted(r) for r in one] == [sorted(r) for r in four]
    for a, b in zip(one, four):
        for key in a:
            if key.startswith("valid_") or key in ("loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    assert several == pytest.approx(single, rel=1e-5, abs=1e-6)
    with pytest.raises(UserError, match=r"train.eval_every=6 must be a multiple of train.steps_per_dispatch=4"):
        apply_overrides(tiny(), ["train.steps_per_dispatch=4", "train.eval_every=6"])
