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

from core.checkpoints import gguf_files, gguf_writer, hf_decoders, hf_writer, pretrained
from core.checkpoints.pretrained import Checkpoint
from core.checkpoints.rules import Rule, fused_rows
from core.config import ModelConfig
from core.errors import UserError
from core.export.tensors import placed

# GGUF's architectures -> Hugging Face's model_type of the same network.
HF_MODEL_TYPES = {"llama": "llama", "gemma3": "gemma3_text"}


def _hf_table(checkpoint: Checkpoint, model: ModelConfig) -> tuple[str, list[Rule]]:
    """The Hugging Face model_type of the source's network and that family's table for `model`."""
    model_type = HF_MODEL_TYPES.get(checkpoint.family, checkpoint.family)
    target = dataclasses.replace(checkpoint, family=model_type, model=model)
    return model_type, pretrained.families()[hf_decoders.HFDecoder.name].rules(target, set())


def write_hf(path: Path, checkpoint: Checkpoint, model: ModelConfig, params: dict, dtype: str, featurizer=None) -> None:
    model_type, rules = _hf_table(checkpoint, model)
    tensors = placed(params, rules, fused_rows(rules, model), f"A Hugging Face {model_type} folder")
    tokenizer_json, tokenizer_config, vocab_size = pretrained.tokenizer_files(model.pretrained)
    path.mkdir()
    hf_writer.save_tensors(path / "model.safetensors", tensors, dtype)
    special = hf_writer.write_tokenizer(path, tokenizer_json, tokenizer_config, model.max_len)
    config = hf_decoders.config_json(model, model_type, vocab_size, special)
    hf_writer.write_json(path / "config.json", {**config, "torch_dtype": dtype})


def write_peft(
    path: Path, checkpoint: Checkpoint, model: ModelConfig, params: dict, dtype: str, featurizer=None
) -> None:
    """The LoRA adapters alone, in PEFT's layout over the Hugging Face folder of the source's
    architecture: each fused projection's adapter becomes one per projection (the query, key
    and value share A and split B's columns; the gate and up projections likewise), so that
    PEFT's W x + B_q (A x) alpha / r is the run's update row for row."""
    if not model.lora_rank:
        raise UserError(
            "--format peft writes the adapters of a LoRA run (model.lora_rank > 0); this model has none: "
            "export hf or gguf."
        )
    _, rules = _hf_table(checkpoint, model)
    shapes = fused_rows(rules, model)
    tensors, modules = {}, set()
    for rule in rules:
        layer = rule.target.removesuffix(".kernel")
        if f"{layer}.lora_a" not in params:
            continue
        a, b = params[f"{layer}.lora_a"], params[f"{layer}.lora_b"]
        for name, part in rule.split(b, shapes).items():  # B [r, out] -> each projection's [out_i, r]
            stem = "base_model.model." + name.removesuffix(".weight")
            tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = a.T, part
            modules.add(name.removesuffix(".weight").rsplit(".", 1)[-1])
    path.mkdir()
    hf_writer.save_tensors(path / "adapter_model.safetensors", tensors, dtype)
    hf_writer.write_json(
        path / "adapter_config.json",
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": model.pretrained,
            "r": model.lora_rank,
            "lora_alpha": model.lora_alpha,
            "lora_dropout": 0.0,
            "target_modules": sorted(modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "inference_mode": True,
        },
    )


def write_gguf(
    path: Path, checkpoint: Checkpoint, model: ModelConfig, params: dict, dtype: str, featurizer=None
) -> None:
    if checkpoint.reader != gguf_files.FAMILY.name:
        raise UserError(
            f"A GGUF file takes its metadata and tokenizer from the GGUF the run started from; {checkpoint.weights} "
            "is a Hugging Face folder: export --format hf, and convert that with llama.cpp's convert_hf_to_gguf.py."
        )
    rules = gguf_files.FAMILY.rules(dataclasses.replace(checkpoint, model=model), set())
    tensors = placed(params, rules, fused_rows(rules, model), f"A GGUF {checkpoint.family} file")
    kind = gguf_files.ARCHITECTURES[checkpoint.family]
    tensors = {name: kind.restore(name, value, model) for name, value in tensors.items()}
    gguf_writer.write(path, gguf_files.reader(checkpoint.weights), tensors, dtype)
