"""Decoder runs written out: a Hugging Face folder of the source's architecture, or a GGUF file
under the source GGUF's metadata (core/export/__init__.py says when each is written).

Both go through a weight table of `core.checkpoints` built for the run's architecture (not read
from a file), so a GGUF source leaves as a Hugging Face folder and back: the Hugging Face
decoder family's table for the folder, the GGUF family's for the file, with llama.cpp's rotary
row order put back (`Architecture.restore`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from core.checkpoints import gguf_files, gguf_writer, hf_decoders, hf_writer, pretrained
from core.checkpoints.pretrained import Checkpoint
from core.checkpoints.rules import Rule, fused_rows, split_params
from core.config import ModelConfig
from core.errors import UserError
from core.model import lora

# GGUF's architectures -> Hugging Face's model_type of the same network.
HF_MODEL_TYPES = {"llama": "llama", "gemma3": "gemma3_text"}


def tensors_of(params: dict[str, np.ndarray], rules: list[Rule], model: ModelConfig, where: str) -> dict:
    """The tensors of `rules`, refusing a model with parameters that no rule writes (a head of its own)."""
    written = {rule.target for rule in rules}
    left = sorted(p for p in params if p not in written and p.rsplit(".", 1)[-1] not in lora.ADAPTERS)
    if left:
        raise UserError(f"{where} has no place for the run's parameters {', '.join(left)}.")
    return split_params(params, rules, fused_rows(rules, model))


def write_hf(path: Path, checkpoint: Checkpoint, model: ModelConfig, params: dict, dtype: str, featurizer=None) -> None:
    model_type = HF_MODEL_TYPES.get(checkpoint.family, checkpoint.family)
    target = dataclasses.replace(checkpoint, family=model_type, model=model)
    rules = pretrained.families()[hf_decoders.HFDecoder.name].rules(target, set())
    tensors = tensors_of(params, rules, model, f"A Hugging Face {model_type} folder")
    tokenizer_json, tokenizer_config, vocab_size = pretrained.tokenizer_files(model.pretrained)
    path.mkdir()
    hf_writer.save_tensors(path / "model.safetensors", tensors, dtype)
    special = hf_writer.special_ids(tokenizer_json, tokenizer_config)
    config = hf_decoders.config_json(model, model_type, vocab_size, special)
    hf_writer.write_json(path / "config.json", {**config, "torch_dtype": dtype})
    hf_writer.write_tokenizer(path, tokenizer_json, tokenizer_config, model.max_len)


def write_gguf(
    path: Path, checkpoint: Checkpoint, model: ModelConfig, params: dict, dtype: str, featurizer=None
) -> None:
    if checkpoint.reader != gguf_files.FAMILY.name:
        raise UserError(
            f"A GGUF file takes its metadata and tokenizer from the GGUF the run started from; {checkpoint.weights} "
            "is a Hugging Face folder: export --format hf, and convert that with llama.cpp's convert_hf_to_gguf.py."
        )
    rules = gguf_files.FAMILY.rules(dataclasses.replace(checkpoint, model=model), set())
    tensors = tensors_of(params, rules, model, f"A GGUF {checkpoint.family} file")
    kind = gguf_files.ARCHITECTURES[checkpoint.family]
    tensors = {name: kind.restore(name, value, model) for name, value in tensors.items()}
    gguf_writer.write(path, gguf_files.reader(checkpoint.weights), tensors, dtype)
