"""Two local processes (jax.distributed over 127.0.0.1, gloo collectives on CPU) train a few
steps, each feeding its own half of every global batch, and end with identical parameters that
match one process training on the same global batches."""

import socket
import subprocess
import sys
from itertools import islice
from pathlib import Path

import jax
import numpy as np

from core import sharding
from core.config import apply_overrides
from core.data import train_batches
from core.train import build_model, make_steps
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
