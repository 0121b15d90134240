"""The memory estimate before a run, its refusal, and a device out-of-memory error as one message."""

import jax
import jax.numpy as jnp
import pytest
import typer
from flax import nnx
from helpers import apps, plain

import cli
from core import run
from core.training import memory
from core.training.steps import build_model, make_steps
from tasks.nlp.sentiment import SentimentTask

FIXTURE = "tests/fixtures/reviews.csv"
SIZES = ["model.d_model=32", "model.num_heads=2", "model.mlp_dim=64", "model.num_layers=1", "model.max_len=16"]
COLUMNS = ["data.text_column=review", "data.label_column=stars"]


def _task(*overrides):
    config = run.make_config(SentimentTask, "tiny", [*COLUMNS, *SIZES, *overrides])
    task = SentimentTask(config=config, data=FIXTURE)
    featurizer = task.fit_featurizer(task.examples("train"))
    return task, featurizer, task.featurize_train(featurizer, task.examples("train")[:4])


def test_the_estimate_counts_the_training_state_by_hand_and_the_rest_as_xla_compiles_it():
    task, featurizer, sample = _task("train.batch_size=16")
    found = memory.estimate(task, featurizer, task.config, sample)
    model = build_model(task, featurizer, task.config)
    built = sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model))))
    assert found.parameters == found.trained == built
    assert found.weights == built * 4 and found.optimizer == built * 4 * 3  # float32; gradients and two moments
    assert jax.device_count() == 8
    assert found.devices == 8 and found.needed == found.total * 8  # simulated devices share the host
    # What XLA's compiled train step holds on a device (its 2 rows of 16): the state it is given
    # and its temporaries (gradients, what the backward pass keeps, the update).
    steps = make_steps(task, model, task.config, task.config.train.steps)
    batch = {key: value[:16] for key, value in task.featurize_train(featurizer, task.examples("train")[:64]).items()}
    compiled = steps.train_step.jitted.lower(steps.state, steps.frozen, batch).compile().memory_analysis()
    held = compiled.argument_size_in_bytes + compiled.temp_size_in_bytes
    assert 0.75 * held < found.total < 1.25 * held


def test_the_estimate_follows_the_knobs():
    task, featurizer, sample = _task("train.batch_size=32", "model.num_layers=4")
    base = memory.estimate(task, featurizer, task.config, sample)
    for knob, part, ratio in [
        ("train.batch_size=64", "activations", 2.0),
        ("train.grad_accum=2", "activations", 0.5),
        ("train.fsdp=2", "optimizer", 0.5),
        ("model.num_layers=8", "activations", 2.0),
        # XLA on CPU keeps a rematerialized step's intermediates all the same (core/training/memory.py).
        ("train.remat=true", "activations", 1.0),
    ]:
        other, featurizer, sample = _task("train.batch_size=32", "model.num_layers=4", knob)
        assert getattr(memory.estimate(other, featurizer, other.config, sample), part) == pytest.approx(
            ratio * getattr(base, part), rel=0.02
        )


def test_a_run_too_large_is_refused_before_anything_is_built(tmp_path):
    result = apps(
        "train", "sentiment", "--preset", "tiny", "--data", FIXTURE, *[a for c in COLUMNS for a in ("--set", c)],
        "--set", "model.d_model=65536", "--set", "model.mlp_dim=262144", "--workdir", tmp_path,
    )  # fmt: skip
    assert result.exit_code == 1
    message = plain(result.output)
    assert "This run cannot fit: memory estimate:" in message and "available on host" in message
    assert "train.batch_size" in message and "train.remat=true" in message and "train.fsdp=N" in message
    assert list(tmp_path.iterdir()) == []  # nothing of a run that never began, not even its lock


def test_a_device_out_of_memory_error_becomes_one_message(capsys):
    @cli.user_errors
    def command():
        return jnp.zeros((2**40,), jnp.float32).block_until_ready()  # 4 TiB: XLA's RESOURCE_EXHAUSTED

    with pytest.raises(typer.Exit) as stopped:
        command()
    assert stopped.value.exit_code == 1
    message = plain(capsys.readouterr().err)
    assert message.startswith("Error: The device ran out of memory (asked for 4096.00 GB more).")
    assert "train.batch_size" in message and "train.remat=true" in message and "Traceback" not in message

    @cli.user_errors
    def other():
        raise RuntimeError("not a memory error")

    with pytest.raises(RuntimeError, match="not a memory error"):
        other()
