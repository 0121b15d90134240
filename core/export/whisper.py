"""Whisper runs written out as a CTranslate2 folder: the format the shipped checkpoints come
in, which faster-whisper (and CTranslate2 itself) load, and which the suite reads back.

A Hugging Face Whisper folder would reach transformers users too, but Whisper's deployments
run on faster-whisper, and CTranslate2's format is the one whose every variable the suite
already maps (core/checkpoints/whisper.py); a fine-tuned model keeps its source's spec, its
settings (heads, activation, alignment heads) and its position table, with the run's weights
in place of the source's. The folder's other files (config.json with the suppressed and
language ids, tokenizer.json, the vocabulary) are the source's.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from core.checkpoints import ctranslate2_files, pretrained
from core.checkpoints import whisper as whisper_files
from core.checkpoints.pretrained import Checkpoint
from core.config import ModelConfig
from core.errors import UserError
from core.export.tensors import placed

DTYPES = ("float32", "float16")
PROJECTION = "decoder/projection/weight"


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: a CTranslate2 folder holds {', '.join(DTYPES)} here.")


def write_ct2(
    path: Path, checkpoint: Checkpoint, model: ModelConfig, params: dict, dtype: str, featurizer=None
) -> None:
    check_dtype(dtype)
    family = pretrained.families()[checkpoint.reader]
    source = whisper_files.read(checkpoint.directory)
    rules = family.rules(checkpoint, set())
    tables = {rule.sources[0]: source.variables[rule.sources[0]] for rule in rules if rule.kind == "rows"}
    tensors = placed(params, rules, family.shapes(checkpoint), "A CTranslate2 Whisper folder", base=tables)
    variables = {**source.variables, **{name: value.astype(dtype) for name, value in tensors.items()}}
    if PROJECTION in variables and PROJECTION not in source.aliases:  # the output is the token table, tied
        variables[PROJECTION] = variables["decoder/embeddings/weight"]
    path.mkdir()
    ctranslate2_files.write(path / "model.bin", dataclasses.replace(source, variables=variables))
    for file in sorted(checkpoint.directory.iterdir()):
        if not file.name.startswith("model.bin"):
            shutil.copyfile(file, path / file.name)  # the content of a linked file (whisper-base's cache)
