"""Test set-up: eight simulated CPU devices, set before JAX starts, and strict rank promotion;
and the helpers several test files share, imported as `from conftest import apps, plain`.

(tests/multiprocess_worker.py sets its own device count: test_multiprocess.py, which it imports,
must not import this module.)
"""

import gc
import json
import logging
import os
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402
from typer.testing import CliRunner, Result  # noqa: E402

from cli import app  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# A small shared body for the core's tests: two blocks, four heads, sixteen positions.
TINY_BODY = dict(d_model=32, num_layers=2, num_heads=4, mlp_dim=64, max_len=16, dropout=0.0)

RUNNER = CliRunner()


def apps(*args, input: str | None = None, env: dict | None = None) -> Result:
    """`apps ARGS...` through Typer's runner; paths and numbers may be given as they are."""
    return RUNNER.invoke(app, [str(a) for a in args], input=input, env=env)


def plain(text: str) -> str:
    """The text with each run of whitespace one space: rich wraps long messages at any space."""
    return " ".join(text.split())


def logged_losses(workdir) -> dict[int, float]:
    """The training loss of each logged step, from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def table_rows(output: str) -> list[list[str]]:
    """The body rows of the rich tables in `output`, as lists of cell texts."""
    return [[cell.strip() for cell in line.strip("│ ").split("│")] for line in output.splitlines() if "│" in line]


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each test module starts without the programs the modules before it compiled: the whole
    suite runs in one process, whose memory would otherwise only grow (CI has 24 GiB)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def apps_log(caplog, monkeypatch):
    """`caplog`, listening on the "apps" logger itself from INFO up.

    The CLI stops that logger propagating to the root, where caplog listens; here it never
    propagates, so each record is captured once whether or not a CLI command ran before."""
    logger = logging.getLogger("apps")
    monkeypatch.setattr(logger, "propagate", False)
    caplog.set_level(logging.INFO, logger="apps")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def pretrained_decoder(name_or_path: str):
    """(checkpoint, model, load report) of a pretrained decoder: its token embedder, body and
    tied output, filled from the checkpoint."""
    from flax import nnx

    from core.checkpoints import pretrained
    from core.model.heads import TiedOutput, TokenEmbedder
    from core.model.transformer import Model, Transformer

    checkpoint = pretrained.read_checkpoint(name_or_path)
    rngs = nnx.Rngs(0)
    embedder = TokenEmbedder(checkpoint.vocab_size, checkpoint.model.d_model, rngs=rngs)
    model = Model(embedder, Transformer(checkpoint.model, rngs=rngs), TiedOutput(embedder))
    return checkpoint, model, pretrained.load(model, name_or_path)
