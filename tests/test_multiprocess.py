"""Two local processes (jax.distributed over 127.0.0.1, gloo collectives on CPU).

By hand: each feeds its own half of every global batch for a few steps, and they end with identical
parameters that match one process training on the same global batches. Through `apps train`: two
processes fit the featurizer once, agree on the best checkpoint, write one metrics log and match a
one-process run; when one of them is killed the other stops at once with a message naming the
checkpoint to resume from, and restarting both resumes from it.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

import jax
import numpy as np
import pytest

from core import run
from core.config import apply_overrides
from core.errors import LostPeer
from core.training import sharding
from core.training.data import train_batches
from core.training.steps import build_model, make_steps
from tasks.nlp.sentiment import SentimentTask, tiny

STEPS = 3
ROOT = Path(__file__).resolve().parents[1]


def train(featurizer_dir: Path, steps: int):
    config = apply_overrides(tiny(), ["model.dropout=0.1"])
    task = SentimentTask(config=config, data="synthetic")
    featurizer = task.load_featurizer(featurizer_dir)
    arrays = featurizer(task.examples("train"))
    compiled = make_steps(task, build_model(task, featurizer, config), config, steps)
    state = compiled.state
    for local in islice(train_batches(arrays, config.train.batch_size, config.train.seed), steps):
        state, _ = compiled.train_step(state, sharding.global_batch(compiled.mesh, local))
    return state["params"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    task = SentimentTask(config=tiny(), data="synthetic")
    task.fit_featurizer(task.examples("train")).save(tmp_path)
    port = free_port()
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "multiprocess_worker.py"),
                str(i),
                str(port),
                str(tmp_path),
                str(tmp_path / f"params{i}.npz"),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    for worker in workers:
        output, _ = worker.communicate(timeout=300)
        assert worker.returncode == 0, output.decode()[-3000:]
    first, second = (np.load(tmp_path / f"params{i}.npz") for i in range(2))
    single = [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(train(tmp_path, STEPS)))]
    assert len(first.files) == len(single)
    for index, expected in enumerate(single):
        np.testing.assert_array_equal(first[f"arr_{index}"], second[f"arr_{index}"])
        np.testing.assert_allclose(first[f"arr_{index}"], expected, atol=1e-5)


def test_lost_peer_errors_become_a_message(monkeypatch):
    failure = jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Connection closed by peer\nmore")
    # One process: nothing is converted, whatever the error says.
    with pytest.raises(jax.errors.JaxRuntimeError), sharding.lost_peers(lambda: "advice"):
        raise failure
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(LostPeer) as caught, sharding.lost_peers(lambda: "Restart them."):
        raise failure
    assert str(caught.value) == (
        "Process 0 of 2 lost contact with another process of the run, which stopped or became unreachable "
        "(UNKNOWN: Gloo all-reduce failed: Connection closed by peer). Restart them."
    )
    # Errors that do not come from a lost process keep their type and traceback.
    with pytest.raises(jax.errors.JaxRuntimeError), sharding.lost_peers(lambda: "advice"):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")


def launch(workdir: Path, process_id: int, port: int, options: list[str], log: Path) -> subprocess.Popen:
    """One process of `apps train sentiment --preset tiny` on synthetic data, two CPU devices each."""
    command = [sys.executable, "-m", "cli", "train", "sentiment", "--preset", "tiny", "--data", "synthetic"]
    command += ["--workdir", str(workdir), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    command += ["--process-id", str(process_id), *options]
    # Two devices per process: collectives run both between processes and inside each one.
    # A wide terminal keeps rich from wrapping the long paths that the assertions look for.
    environment = os.environ | {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "COLUMNS": "400",
    }
    with log.open("w") as output:
        return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=output, stderr=subprocess.STDOUT)


def train_two(workdir: Path, options: list[str], name: str) -> list[str]:
    """Runs both processes to the end; their outputs, after checking that both succeeded."""
    port = free_port()
    logs = [workdir.parent / f"{name}{i}.log" for i in range(2)]
    processes = [launch(workdir, i, port, options, logs[i]) for i in range(2)]
    try:
        for process in processes:
            process.wait(timeout=300)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    outputs = [log.read_text() for log in logs]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    return outputs


def records(workdir: Path) -> list[dict]:
    """The complete lines of metrics.jsonl (a running process may be writing the last one)."""
    path = workdir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines]


def check_best(workdir: Path) -> None:
    """best.json names the step kept in best/, with the value logged for that step."""
    best = json.loads((workdir / "best.json").read_text())
    assert [int(step.name) for step in (workdir / "best").iterdir()] == [best["step"]]
    valid = [r for r in records(workdir) if r["step"] == best["step"] and f"valid_{best['metric']}" in r]
    assert valid and valid[-1][f"valid_{best['metric']}"] == best["value"]


@pytest.mark.slow
def test_cli_trains_with_two_processes(tmp_path):
    workdir = tmp_path / "two"
    outputs = train_two(workdir, [], "train")
    # Process 0 fitted the featurizer once; process 1 waited and loaded it from the workdir.
    assert outputs[0].count("Fitted the featurizer") == 1 and "Fitted the featurizer" not in outputs[1]
    assert (workdir / "featurizer").is_dir() and not (workdir / "featurizer.tmp").exists()
    check_best(workdir)
    # Only process 0 writes the log: one record per logged step and validation, none twice.
    logged = [(r["step"], "valid_loss" in r) for r in records(workdir)]
    assert logged == [(5, False), (10, False), (10, True), (15, False), (20, False), (20, True)]

    # One process over the same global batches ends where the two did: with the same featurizer,
    # which a process 1 that had read a half-written one would not have.
    single = tmp_path / "one"
    run.train(SentimentTask, workdir=single, preset="tiny", data="synthetic")
    for ours, theirs in zip(records(workdir), records(single)):
        assert ours.keys() == theirs.keys() and ours["step"] == theirs["step"]
        for key in ours:
            if key == "loss" or key.startswith("valid_"):
                np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-4, err_msg=key)
    two, one = (run.load(SentimentTask, w).params for w in (workdir, single))
    for ours, theirs in zip(jax.tree.leaves(two), jax.tree.leaves(one)):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-5)


@pytest.mark.slow
def test_cli_stops_when_a_process_dies_and_resumes(tmp_path):
    workdir = tmp_path / "run"
    options = ["--set", "train.steps=100", "--set", "train.eval_every=40", "--set", "train.checkpoint_every=40"]
    logs = [tmp_path / f"killed{i}.log" for i in range(2)]
    port = free_port()
    processes = [launch(workdir, i, port, options, logs[i]) for i in range(2)]
    try:
        # Kill process 1 between checkpoints: once step 50 is logged both are past the save at 40.
        deadline = time.monotonic() + 240
        while not any(record["step"] >= 50 for record in records(workdir)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), logs[0].read_text()
            time.sleep(0.05)
        processes[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        processes[0].wait(timeout=90)
        stopped_after = time.monotonic() - killed
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    output = logs[0].read_text()
    assert processes[0].returncode == 1, output[-3000:]
    assert stopped_after < 60, stopped_after
    assert "Traceback" not in output and "Check failure" not in output, output[-3000:]
    message = " ".join(output[output.index("Error: ") :].split())
    assert "Process 0 of 2 lost contact with another process of the run" in message
    assert f"The checkpoint of step 40 in {workdir} is intact; restart all 2 processes" in message

    outputs = train_two(workdir, options, "resumed")
    for output in outputs:
        assert f"Resuming from checkpoints/ step 40 in {workdir}." in output
        assert "Fitted the featurizer" not in output
    assert sorted(int(step.name) for step in (workdir / "checkpoints").iterdir()) == [80, 100]
    check_best(workdir)


@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_at_one_step_and_the_resumed_run_matches(tmp_path):
    """SIGTERM to process 1 alone: both finish the same step, checkpoint it together and exit 1,
    each saying how to resume; both restarted end where an uninterrupted one-process run does."""
    workdir = tmp_path / "run"
    options = ["--set", "train.steps=60", "--set", "train.eval_every=60", "--set", "train.checkpoint_every=60"]
    options += ["--set", "train.log_every=1"]
    logs = [tmp_path / f"signalled{i}.log" for i in range(2)]
    port = free_port()
    processes = [launch(workdir, i, port, options, logs[i]) for i in range(2)]
    try:
        deadline = time.monotonic() + 240
        while not any(record["step"] >= 5 for record in records(workdir)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), logs[0].read_text()
            time.sleep(0.01)
        processes[1].send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(timeout=90)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    outputs = [" ".join(log.read_text().split()) for log in logs]
    saved = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
    assert [p.returncode for p in processes] == [1, 1] and len(saved) == 1 and 5 <= saved[0] < 60, outputs
    assert f"Stopped by SIGTERM at step {saved[0]}." in outputs[1]
    assert f"Stopped by a signal to another process of the run at step {saved[0]}." in outputs[0]
    for output in outputs:
        assert "Traceback" not in output and "restart all 2 processes" in output, output[-3000:]

    for output in train_two(workdir, options, "resumed"):
        assert f"Resuming from checkpoints/ step {saved[0]} in {workdir}." in output
    single = tmp_path / "one"
    run.train(
        SentimentTask, workdir=single, preset="tiny", data="synthetic", overrides=[o for o in options if o != "--set"]
    )
    resumed = {r["step"]: r["loss"] for r in records(workdir) if "loss" in r}
    straight = {r["step"]: r["loss"] for r in records(single) if "loss" in r}
    assert resumed.keys() == straight.keys()
    np.testing.assert_allclose([resumed[s] for s in straight], list(straight.values()), rtol=1e-4)
