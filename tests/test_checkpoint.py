"""Crash safety and what checkpoints hold: a killed run resumes from its last complete
checkpoint and ends where an uninterrupted run ends; unreadable checkpoints are skipped with a
warning, never loaded; `best/` and evaluation hold parameters only; throughput counts steps alone."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import apps, logged_losses, plain

from core import run
from core.errors import UserError
from core.training import data as data_lib
from core.training import hooks as hooks_lib
from core.training.checkpoints import Checkpoints, undone_on_failure
from tasks.nlp.sentiment import SentimentTask

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ["train.steps=12", "train.eval_every=4", "train.checkpoint_every=4", "train.log_every=2"]


def train(workdir: Path, options=OPTIONS):
    return run.train(SentimentTask, workdir=workdir, preset="tiny", overrides=options, data="synthetic")


def latest_params(workdir: Path) -> list[np.ndarray]:
    loaded = run.load(SentimentTask, workdir, data="synthetic")
    checkpoints = Checkpoints(workdir, read_only=True)
    try:
        restored = checkpoints.restore_params(loaded.params, best=False)
    finally:
        checkpoints.close()
    assert restored.where == "checkpoints/ step 12" or restored.step == 300
    return [np.asarray(leaf) for leaf in jax.tree.leaves(restored.value)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight") / "run"
    train(workdir)
    return workdir


def truncate(directory: Path) -> int:
    files = [path for path in directory.rglob("*") if path.is_file()]
    for path in files:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return len(files)


def test_best_and_evaluation_hold_parameters_only(straight):
    best_step = json.loads((straight / "best.json").read_text())["step"]
    assert [p.name for p in (straight / "best" / str(best_step)).iterdir() if p.is_dir()] == ["params"]
    assert {p.name for p in (straight / "checkpoints" / "12").iterdir() if p.is_dir()} == {"params", "training"}
    loaded = run.load(SentimentTask, straight, data="synthetic")
    assert set(loaded.steps.state) == {"params"} and loaded.steps.train_step is None
    assert loaded.checkpoint == f"best/ step {best_step}"


def test_truncated_latest_checkpoint_is_skipped_and_the_run_resumes(straight, tmp_path, apps_log):
    workdir = tmp_path / "run"
    train(workdir)
    assert truncate(workdir / "checkpoints" / "12") > 0
    train(workdir)  # same command again: step 12 is unreadable, so it resumes from step 8
    assert "Skipped the checkpoint checkpoints/12" in apps_log.text
    assert len(list((workdir / "corrupt").iterdir())) == 1  # set aside, not deleted
    for ours, theirs in zip(latest_params(workdir), latest_params(straight)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def test_evaluation_falls_back_from_an_unreadable_best_and_says_so(tmp_path, apps_log):
    workdir = tmp_path / "run"
    train(workdir)
    best_step = json.loads((workdir / "best.json").read_text())["step"]
    truncate(workdir / "best" / str(best_step))
    result = run.evaluate(SentimentTask, workdir, split="valid", data="synthetic", baselines=False)
    assert result["checkpoint"] == "checkpoints/ step 12"
    assert f"Skipped the checkpoint best/{best_step}" in apps_log.text
    assert (workdir / "best" / str(best_step)).exists()  # evaluation never moves files


def test_throughput_counts_steps_alone(tmp_path, monkeypatch):
    # A clock that jumps 1,000 s during every checkpoint save: were saves counted, throughput
    # would fall below 16 * 2 / 1000 examples/s in the windows that hold one.
    offset = [0.0]
    monkeypatch.setattr(hooks_lib.time, "perf_counter", lambda clock=time.perf_counter: clock() + offset[0])
    save = Checkpoints.save

    def slow_save(self, step, state):
        offset[0] += 1000.0
        save(self, step, state)

    monkeypatch.setattr(Checkpoints, "save", slow_save)
    train(tmp_path / "run", [*OPTIONS, "train.log_every=3"])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["examples_per_s"] for r in records if "loss" in r]
    assert len(rates) == 4 and min(rates) > 1.0, rates


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_complete_checkpoint(tmp_path):
    options = ["train.steps=300", "train.checkpoint_every=50", "train.eval_every=50", "train.log_every=10"]
    command = [sys.executable, "-m", "cli", "train", "sentiment", "--preset", "tiny", "--data", "synthetic"]
    command += [arg for option in options for arg in ("--set", option)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def launch(workdir: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [*command, "--workdir", str(workdir)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )

    killed = tmp_path / "killed"
    process = launch(killed)
    deadline = time.monotonic() + 120
    while not (killed / "checkpoints" / "100").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read().decode()[-2000:]
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    saved = sorted(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit())
    assert 100 in saved and max(saved) < 300, saved

    resumed = launch(killed)
    output = resumed.communicate(timeout=300)[0].decode()
    assert resumed.returncode == 0 and f"Resuming from checkpoints/ step {max(saved)}" in output, output[-2000:]
    uninterrupted = launch(tmp_path / "straight")
    assert uninterrupted.wait(timeout=300) == 0
    assert logged_losses(killed) == pytest.approx(logged_losses(tmp_path / "straight"), rel=1e-6)
    for ours, theirs in zip(latest_params(killed), latest_params(tmp_path / "straight")):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def test_one_writer_per_workdir_and_a_dead_writers_lock_is_taken_over(tmp_path, apps_log):
    """A second `apps train` into a workdir that a live process trains stops, naming it; once
    that process is killed (no clean exit), the next run takes the lock over and says so; an
    exit, by an exception too, leaves the lock free and unnamed."""
    from core.training.checkpoints import writer_lock

    workdir = tmp_path / "run"
    command = [sys.executable, "-m", "cli", "train", "sentiment", "--preset", "tiny", "--data", "synthetic"]
    command += ["--set", "train.steps=100000", "--workdir", str(workdir)]
    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lock, deadline = workdir / "train.lock", time.monotonic() + 120
        while not (lock.exists() and lock.read_text()):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(UserError, match=rf"{workdir} is being trained by process {first.pid} on "):
            train(workdir, ["train.steps=100000"])
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with writer_lock(workdir):
        assert lock.read_text().startswith(f"process {os.getpid()} on ")
    assert f"was last trained by process {first.pid} on " in apps_log.text and lock.read_text() == ""
    with pytest.raises(RuntimeError), writer_lock(workdir):
        raise RuntimeError
    assert lock.read_text() == ""


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_run_checkpoints_its_step_and_resumes_as_if_never_stopped(tmp_path, number):
    """SIGTERM (a scheduler's preemption) or SIGINT: the run finishes its step, checkpoints it
    (between the regular checkpoints), says how to resume and exits 1; the resumed run ends
    where the uninterrupted one does."""
    options = ["train.steps=60", "train.checkpoint_every=60", "train.eval_every=60", "train.log_every=1"]
    command = [sys.executable, "-m", "cli", "train", "sentiment", "--preset", "tiny", "--data", "synthetic"]
    command += [arg for option in options for arg in ("--set", option)]
    stopped = tmp_path / "stopped"
    process = subprocess.Popen(
        [*command, "--workdir", str(stopped)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 120
    while not ((stopped / "metrics.jsonl").exists() and len((stopped / "metrics.jsonl").read_text().splitlines()) >= 5):
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read().decode()[-2000:]
        time.sleep(0.01)
    signalled = time.monotonic()
    process.send_signal(number)
    output = process.communicate(timeout=60)[0].decode()
    assert time.monotonic() - signalled < 30
    name = signal.Signals(number).name
    saved = [int(p.name) for p in (stopped / "checkpoints").iterdir() if p.name.isdigit()]
    assert process.returncode == 1 and len(saved) == 1 and 5 <= saved[0] < 60, output[-2000:]
    assert f"Stopped by {name} at step {saved[0]}" in " ".join(output.split()), output[-2000:]
    assert "to resume from it" in " ".join(output.split())
    train(stopped, options)
    train(tmp_path / "straight", options)
    assert logged_losses(stopped) == pytest.approx(logged_losses(tmp_path / "straight"), rel=1e-6)


def test_a_run_that_fails_before_its_first_step_leaves_the_workdir_as_it_was(tmp_path, apps_log):
    """A batch larger than the training split: a clear error and exit 1, no workdir left behind
    (nor the parents made for it), a folder the user made stays as it was, and the corrected
    command then trains there instead of being refused as another configuration."""
    command = ["train", "sentiment", "--preset", "tiny", "--data", "synthetic", "--set", "train.steps=2"]
    command += ["--set", "train.eval_every=2", "--set", "train.checkpoint_every=2"]
    nested, made = tmp_path / "new" / "run", tmp_path / "made"
    made.mkdir()
    (made / "notes.txt").write_text("mine")
    for workdir in (nested, made):
        result = apps(*command, "--set", "train.batch_size=4096", "--workdir", workdir)
        assert result.exit_code == 1, result.output
        assert re.search(r"The training split has \d+ examples, fewer than one batch of 4096\.", plain(result.output))
    assert not (tmp_path / "new").exists()
    assert [p.name for p in made.iterdir()] == ["notes.txt"] and (made / "notes.txt").read_text() == "mine"
    result = apps(*command, "--workdir", made)
    assert result.exit_code == 0, result.output
    assert (made / "train.lock").read_text() == "" and "without releasing" not in apps_log.text
    with pytest.raises(UserError, match=r"The training split has 1 example, fewer than one batch of 8\."):
        next(data_lib.train_batches({"weights": np.ones(1)}, 8, 0))


def test_a_failed_attempt_is_undone_but_a_resumable_run_keeps_its_files(straight, tmp_path, apps_log):
    """Ctrl-C before a step in a folder the user made removes only what the attempt added, and
    frees the lock unnamed; a resume that fails before its first step (a damaged best.json)
    touches none of the run's files."""
    made = tmp_path / "made"
    made.mkdir()
    (made / "notes.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt), undone_on_failure(made):
        (made / "config.json").write_text("{}")
        (made / "featurizer").mkdir()
        raise KeyboardInterrupt
    assert [p.name for p in made.iterdir()] == ["notes.txt"]
    copy = tmp_path / "run"
    shutil.copytree(straight, copy)
    (copy / "best.json").write_text('{"step": 4, "value": ')
    files = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    with pytest.raises(UserError, match="best.json is not valid JSON"):
        train(copy)
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == files
    assert (copy / "train.lock").read_text() == "" and "without releasing" not in apps_log.text
