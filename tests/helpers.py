"""What several test files share: the CLI through Typer's runner, text helpers, a run's logged
losses, a tiny body's settings and a pretrained decoder built from a checkpoint.

Imported as `from helpers import apps, plain`; tests/conftest.py has already set up JAX (eight
simulated CPU devices, strict rank promotion) before any test module imports this one.
"""

import json
from pathlib import Path

from typer.testing import CliRunner, Result

from cli import app

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
