"""Hugging Face folders written: tensors to model.safetensors in a chosen dtype, and the
tokenizer's files as transformers reads them.

A run keeps its tokenizer as a `tokenizers` JSON text and the keys of `Family.tokenizer_config`
(the special tokens, add_bos_token, the chat template, the stop ids). transformers'
`PreTrainedTokenizerFast` adds a beginning-of-text token only where tokenizer.json's post-processor
says so, so a vocabulary that begins texts with one (Gemma's) gets that post-processor here; the
stop ids become generation_config.json's eos_token_id, which ends `generate`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: a Hugging Face folder holds {', '.join(DTYPES)}.")


def save_tensors(path: Path, tensors: Mapping[str, np.ndarray], dtype: str) -> None:
    """model.safetensors of `tensors` in `dtype` ("format": "pt" in its header, which transformers asks for)."""
    import ml_dtypes
    import safetensors.numpy

    check_dtype(dtype)
    numpy_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    values = {name: np.ascontiguousarray(value.astype(numpy_dtype)) for name, value in tensors.items()}
    safetensors.numpy.save_file(values, str(path), metadata={"format": "pt"})


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def special_ids(tokenizer_json: str, config: Mapping[str, Any]) -> dict[str, int]:
    """{"bos_token": id, "eos_token": id, "pad_token": id} for the special tokens `config` names."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
    found = {
        key: tokenizer.token_to_id(config[key]) for key in ("bos_token", "eos_token", "pad_token") if key in config
    }
    return {key: value for key, value in found.items() if value is not None}


def write_tokenizer(folder: Path, tokenizer_json: str, config: Mapping[str, Any], max_len: int) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json and generation_config.json of a generating model;
    returns the special tokens' ids (`special_ids`), which config.json names too."""
    ids = special_ids(tokenizer_json, config)
    raw = json.loads(tokenizer_json)
    if config.get("add_bos_token") and "bos_token" in ids:
        bos = config["bos_token"]
        raw["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [ids["bos_token"]], "tokens": [bos]}},
        }
    (folder / "tokenizer.json").write_text(json.dumps(raw, ensure_ascii=False))
    kept = ("bos_token", "eos_token", "pad_token", "add_bos_token", "chat_template")
    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
            **{key: config[key] for key in kept if key in config},
        },
    )
    stops = list(config.get("stop_ids") or ([ids["eos_token"]] if "eos_token" in ids else []))
    generation = {f"{key}_id": value for key, value in ids.items() if key != "eos_token"}
    if stops:
        generation["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    write_json(folder / "generation_config.json", generation)
    return ids
