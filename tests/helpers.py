"""What several test files share: the CLI through Typer's runner, text helpers, a run's logged
losses, a tiny body's settings, a pretrained decoder built from a checkpoint and its check
against what transformers gave on the same file, the operand types of a compiled program's products.

Imported as `from helpers import apps, plain`; tests/conftest.py has already set up JAX (eight
simulated CPU devices, strict rank promotion) before any test module imports this one.
"""

import json
import re
from pathlib import Path

import jax
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
    tied output, filled from the checkpoint. Built abstractly and then filled: drawing random
    weights that the checkpoint replaces would cost Gemma 3 a quarter of a minute."""
    from flax import nnx

    from core.checkpoints import pretrained
    from core.model.heads import TiedOutput, TokenEmbedder
    from core.model.transformer import Model, Transformer

    checkpoint = pretrained.read_checkpoint(name_or_path)

    def build():
        rngs = nnx.Rngs(0)
        embedder = TokenEmbedder(checkpoint.vocab_size, checkpoint.model.d_model, rngs=rngs)
        return Model(embedder, Transformer(checkpoint.model, rngs=rngs), TiedOutput(embedder))

    model = nnx.eval_shape(build)
    report = pretrained.load(model, name_or_path)
    assert not report.new, f"{name_or_path} leaves parameters unfilled: {report.new}"
    return checkpoint, model, report


def check_against_reference(model, reference) -> None:
    """Every position's logits on the reference's vocabulary columns, their log-sum-exp and
    argmax, and 16 greedy tokens, for each of the reference's three prompts, as transformers gave
    them reading the same file in float32 (tests/fixtures/decoder_reference.md). The prompts run
    as one batch, padded on the right (a causal model's positions never see what follows them):
    one compiled forward pass and one generation."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from core.generation import generate

    prompts = [reference[f"ids_{i}"] for i in range(3)]
    tokens = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for row, ids in enumerate(prompts):
        tokens[row, : len(ids)] = ids
    mask = np.arange(tokens.shape[1])[None, :] < np.array([len(ids) for ids in prompts])[:, None]
    forward = nnx.jit(lambda model, tokens, mask: model({"inputs": tokens, "mask": mask}).logits())
    batch = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(mask)))
    greedy = generate.generate(model, prompts, max_new_tokens=16)
    columns = reference["columns"]
    for i, ids in enumerate(prompts):
        logits = batch[i, : len(ids)]
        np.testing.assert_allclose(logits[:, columns], reference[f"logits_{i}"], atol=2e-3, rtol=1e-3)
        np.testing.assert_allclose(jax.nn.logsumexp(logits, -1), reference[f"logsumexp_{i}"], atol=2e-3)
        np.testing.assert_array_equal(logits.argmax(-1), reference[f"argmax_{i}"])
        np.testing.assert_array_equal(greedy.tokens[i], reference[f"greedy_{i}"])


def compiled_dot_operands(function, *args) -> list[tuple[str, ...]]:
    """The element types of each dot's operands in the program XLA compiles for `function`."""
    types, dots = {}, []
    for line in jax.jit(function).lower(*args).compile().as_text().splitlines():
        definition = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[", line)
        if definition:
            types[definition.group(1)] = definition.group(2)
        dot = re.search(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", line)
        if dot:
            dots.append(dot.groups())
    return [tuple(types[name] for name in operands) for operands in dots]
