"""A trained run leaves the suite: `apps export`, and the same from Python.

    from core import export
    export.export(tasks.get("lm"), "runs/lm", "gguf", "smol.gguf", dtype="q8_0")

A run that fine-tuned a pretrained decoder (lm, and translate and summarize with a decoder
preset; fully or with LoRA, whose adapters are folded into the weights first) leaves as

- `hf`: a Hugging Face folder (config.json of the source architecture, model.safetensors,
  tokenizer.json, tokenizer_config.json with the chat template, generation_config.json), which
  transformers, vLLM and TGI load; float32, bfloat16 or float16;
- `gguf`: a GGUF file under the source GGUF's own metadata (configuration, tokenizer, chat
  template), which llama.cpp and Ollama load; float32, float16, bfloat16 or Q8_0.

The tensors come from the same weight tables that load a checkpoint (`core.checkpoints`), each
rule inverted, so the exported file reads back into the very parameters. The file or folder is
written beside `out` and moved there whole: a failure leaves nothing half written, and an
existing `out` is replaced only with `force`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.checkpoints import gguf_files, gguf_writer, hf_decoders, hf_writer, pretrained
from core.checkpoints.rules import flat_params, fused_rows, split_params
from core.errors import UserError
from core.loading import Loaded, checked_workdir, load, run_config
from core.model import lora

FORMATS = {"hf": "a Hugging Face folder", "gguf": "a GGUF file"}
# GGUF's architectures -> Hugging Face's model_type of the same network.
HF_MODEL_TYPES = {"llama": "llama", "gemma3": "gemma3_text"}


@dataclass(frozen=True)
class Exported:
    """What `export` wrote: `path`, in `format` and `dtype`, from the run started from
    `source`, with `adapters` LoRA layers folded in; `files` by name with their bytes."""

    path: Path
    format: str
    dtype: str
    source: str
    adapters: int
    files: dict[str, int]


def export(
    task_type: type, workdir: str | Path, format: str, out: str | Path, *, dtype: str = "float32", force: bool = False
) -> Exported:
    """The run in `workdir` (its best checkpoint) written to `out` in `format` ("hf" or "gguf")."""
    if format not in FORMATS:
        raise UserError(f"--format {format}: expected {' or '.join(FORMATS)} ({', '.join(FORMATS.values())}).")
    (hf_writer if format == "hf" else gguf_writer).check_dtype(dtype)
    workdir, out = checked_workdir(workdir), Path(out)
    _check_out(out, workdir, force)
    _decoder_source(task_type.name, str(workdir), run_config(task_type, workdir).model.pretrained)
    return written(load(task_type, workdir), str(workdir), format, out, dtype)


def written(loaded: Loaded, where: str, format: str, out: Path, dtype: str) -> Exported:
    """`loaded` (a run, or a checkpoint loaded as one: `where` names it) written to `out`."""
    task = loaded.task
    source = task.config.model.pretrained
    checkpoint = _decoder_source(task.name, where, source)
    model = loaded.steps.model(loaded.params)
    adapters = lora.merge(model)
    params = {path: np.asarray(value, np.float32) for path, value in flat_params(model).items()}
    # The run's rows are its training length; the weights keep the checkpoint's whole context.
    architecture = dataclasses.replace(task.config.model, max_len=checkpoint.model.max_len)
    with _staged(out) as path:
        if format == "hf":
            _write_hf(path, checkpoint, architecture, params, source, dtype)
        else:
            _write_gguf(path, checkpoint, architecture, params, dtype)
        files = {p.name: p.stat().st_size for p in ([path] if path.is_file() else sorted(path.iterdir()))}
    return Exported(out, format, dtype, source, adapters, files)


def _check_out(out: Path, workdir: Path, force: bool) -> None:
    """Refuses an `out` that exists (without `force`), or that is or holds the run itself."""
    resolved = out.resolve()
    if resolved == workdir.resolve() or resolved in workdir.resolve().parents:
        raise UserError(f"--out {out} is or holds the run {workdir}: export elsewhere.")
    if out.exists() and not force:
        raise UserError(f"--out {out} exists: give --force to replace it, or choose another path.")


def _decoder_source(task: str, workdir: str, source: str | None) -> pretrained.Checkpoint:
    """The pretrained decoder the run started from; other runs have no format to go to yet."""
    if source is None:
        raise UserError(
            f"{workdir}: its {task} run was trained from scratch (its own tokenizer and architecture); "
            "apps export writes runs that fine-tuned a pretrained decoder: lm with --preset smollm2 or gemma3 (or "
            "--set model.pretrained=...), and translate or summarize with a decoder preset."
        )
    checkpoint = pretrained.read_checkpoint(source)
    if not pretrained.families()[checkpoint.reader].decodes:
        raise UserError(
            f"{workdir}: its {task} run started from the {checkpoint.reader} checkpoint {source}; apps export "
            "writes runs that fine-tuned a pretrained decoder (SmolLM2, Gemma 3, or a Llama, Qwen2 or Gemma 3 folder)."
        )
    return checkpoint


def _tensors(params: dict[str, np.ndarray], rules: list, architecture, where: str) -> dict[str, np.ndarray]:
    """The tensors of `rules`, refusing a model with parameters that no rule writes (a head of its own)."""
    written = {rule.target for rule in rules}
    left = sorted(p for p in params if p not in written and p.rsplit(".", 1)[-1] not in lora.ADAPTERS)
    if left:
        raise UserError(f"{where} has no place for the run's parameters {', '.join(left)}.")
    return split_params(params, rules, fused_rows(rules, architecture))


def _write_hf(path: Path, checkpoint, architecture, params: dict, source: str, dtype: str) -> None:
    model_type = HF_MODEL_TYPES.get(checkpoint.family, checkpoint.family)
    target = dataclasses.replace(checkpoint, family=model_type, model=architecture)
    rules = pretrained.families()[hf_decoders.HFDecoder.name].rules(target, set())
    tensors = _tensors(params, rules, architecture, f"A Hugging Face {model_type} folder")
    tokenizer_json, tokenizer_config, vocab_size = pretrained.tokenizer_files(source)
    path.mkdir()
    hf_writer.save_tensors(path / "model.safetensors", tensors, dtype)
    special = hf_writer.special_ids(tokenizer_json, tokenizer_config)
    config = hf_decoders.config_json(architecture, model_type, vocab_size, special)
    hf_writer.write_json(path / "config.json", {**config, "torch_dtype": dtype})
    hf_writer.write_tokenizer(path, tokenizer_json, tokenizer_config, architecture.max_len)


def _write_gguf(path: Path, checkpoint, architecture, params: dict, dtype: str) -> None:
    if checkpoint.reader != gguf_files.FAMILY.name:
        raise UserError(
            f"A GGUF file takes its metadata and tokenizer from the GGUF the run started from; {checkpoint.weights} "
            "is a Hugging Face folder: export --format hf, and convert that with llama.cpp's convert_hf_to_gguf.py."
        )
    target = dataclasses.replace(checkpoint, model=architecture)
    rules = gguf_files.FAMILY.rules(target, set())
    tensors = _tensors(params, rules, architecture, f"A GGUF {checkpoint.family} file")
    kind = gguf_files.ARCHITECTURES[checkpoint.family]
    tensors = {name: kind.restore(name, value, architecture) for name, value in tensors.items()}
    gguf_writer.write(path, gguf_files.reader(checkpoint.weights), tensors, dtype)


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A path in a fresh folder beside `out` to write to; moved onto `out` (replacing what is
    there) once written, removed with the folder on a failure."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    try:
        yield stage / out.name
        if out.exists() or out.is_symlink():
            out.rename(stage / "replaced")
        os.replace(stage / out.name, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
