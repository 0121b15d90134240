"""Sentence embeddings with a pretrained encoder, as sentence-transformers computes them: the mean
of the last hidden states over each text's tokens, divided by its L2 norm when the checkpoint's
sentence-transformers pipeline (its modules.json) ends in a Normalize module, as
all-MiniLM-L6-v2's does.

from tasks.nlp import embed
vectors = embed.embed(["A sentence.", "Another one."])  # [2, 384], all-MiniLM-L6-v2
embed.write("vectors.npz", texts, vectors)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.checkpoints import pretrained
from core.errors import UserError
from core.model.heads import TokenEmbedder, mean_pool
from core.model.transformer import Transformer
from tasks.common.tokenizer import PretrainedTokenizer

DEFAULT_MODEL = "all-MiniLM-L6-v2"


class Encoder(nnx.Module):
    """A checkpoint's token embedder and body: token ids and their mask -> mean-pooled [B, D]."""

    def __init__(self, checkpoint: pretrained.Checkpoint):
        rngs = nnx.Rngs(0)
        self.embedder = TokenEmbedder(checkpoint.vocab_size, checkpoint.model.d_model, rngs=rngs)
        self.body = Transformer(checkpoint.model, rngs=rngs)

    def __call__(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
        x, mask = self.embedder(ids, mask)
        return mean_pool(self.body(x, mask), mask)


def normalizes(directory: Path) -> bool:
    """Whether the checkpoint's sentence-transformers modules end in a Normalize module."""
    path = directory / "modules.json"
    if not path.is_file():
        return False
    try:
        modules = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not valid JSON: {error}.") from None
    return any(str(module.get("type", "")).endswith(".Normalize") for module in modules)


def embed(texts: Sequence[str], model: str = DEFAULT_MODEL, *, max_len: int = 256, batch_size: int = 64) -> np.ndarray:
    """Embeddings [N, D] of `texts` with the checkpoint `model` (a folder or a shipped name);
    texts longer than `max_len` tokens are cut, as sentence-transformers cuts them."""
    if not texts:
        raise UserError("Nothing to embed: give at least one text.")
    checkpoint = pretrained.read_checkpoint(model)
    if not 0 < max_len <= checkpoint.model.max_len:
        raise UserError(f"--max-len {max_len} must be in 1..{checkpoint.model.max_len}, the checkpoint's positions.")
    tokenizer = PretrainedTokenizer.from_checkpoint(model)
    encoder = Encoder(checkpoint)
    pretrained.load(encoder, model)
    forward = nnx.jit(lambda encoder, ids, mask: encoder(ids, mask))
    # Batches cut to their longest text: one compiled shape per distinct length.
    vectors = []
    for start in range(0, len(texts), batch_size):
        ids, mask = tokenizer.encode(list(texts[start : start + batch_size]), max_len)
        width = int(mask.sum(1).max())
        vectors.append(np.asarray(forward(encoder, jnp.asarray(ids[:, :width]), jnp.asarray(mask[:, :width]))))
    result = np.concatenate(vectors)
    if normalizes(checkpoint.directory):
        result = result / np.maximum(np.linalg.norm(result, axis=-1, keepdims=True), 1e-12)
    return result


def output_path(path: str | Path) -> Path:
    """`path`, checked to be an .npz, with its folder made."""
    path = Path(path)
    if path.suffix != ".npz":
        raise UserError(f"--output {path}: the embeddings are written as .npz; name the file so.")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write(path: str | Path, texts: Sequence[str], vectors: np.ndarray) -> Path:
    """An .npz with `texts` [N] and `embeddings` [N, D]."""
    path = output_path(path)
    np.savez(path, texts=np.array(list(texts)), embeddings=vectors.astype(np.float32))
    return path


def write_by_id(path: str | Path, vectors: dict[str, np.ndarray]) -> Path:
    """A trained run's embeddings (`core.run.embed`: input id -> array) into an .npz, one array
    per id, in float32."""
    path = output_path(path)
    np.savez(path, **{key: value.astype(np.float32) for key, value in vectors.items()})
    return path
