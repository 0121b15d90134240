"""A trained run leaves the suite: `apps export`, and the same from Python.

    from core import export
    export.export(tasks.get("lm"), "runs/lm", "gguf", "smol.gguf", dtype="q8_0")
    export.export(tasks.get("speech"), "runs/speech", "ct2", "whisper-ct2", dtype="float16")

What a run leaves as depends on the checkpoint it started from:

- a pretrained decoder (lm, and translate and summarize with a decoder preset; fully or with
  LoRA, whose adapters are folded into the weights first): `hf`, a Hugging Face folder
  (config.json of the source architecture, model.safetensors, tokenizer.json,
  tokenizer_config.json with the chat template, generation_config.json) that transformers, vLLM
  and TGI load, in float32, bfloat16 or float16; or `gguf`, a GGUF file under the source GGUF's
  own metadata (configuration, tokenizer, chat template) that llama.cpp and Ollama load, in
  float32, float16, bfloat16 or Q8_0; or, for a LoRA run, `peft`: the adapters alone in PEFT's
  layout (core/export/decoders.py);
- Whisper (a speech run): `ct2`, a CTranslate2 folder that faster-whisper loads, in float32 or
  float16 (core/export/whisper.py);
- a BERT-family encoder (sentiment on MiniLM): `hf`, a Hugging Face folder of the encoder with
  the run's labels that is also a sentence-transformers model of the run's whole pipeline (mean
  pooling, the classifier), in float32, bfloat16 or float16 (core/export/encoders.py).

`export_checkpoint` writes a pretrained checkpoint as it is (a shipped GGUF as the Hugging Face
folder that a run's PEFT adapters go on).

The tensors come from the same weight tables that load a checkpoint (`core.checkpoints`), each
rule inverted, so the exported files read back into the very parameters. The file or folder is
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

from core.checkpoints import gguf_writer, hf_writer, pretrained
from core.checkpoints.rules import flat_params
from core.errors import UserError
from core.export import decoders, encoders, whisper
from core.loading import Loaded, checked_workdir, load, load_pretrained, run_config
from core.model import lora

FORMATS = {
    "hf": "a Hugging Face folder",
    "gguf": "a GGUF file",
    "ct2": "a CTranslate2 folder",
    "peft": "a LoRA run's adapters alone, in PEFT's layout",
}
DTYPE_CHECKS = {
    "hf": hf_writer.check_dtype,
    "gguf": gguf_writer.check_dtype,
    "ct2": whisper.check_dtype,
    "peft": hf_writer.check_dtype,
}
# What the runs of each kind of source checkpoint leave as: format -> its writer.
WRITERS = {
    "decoder": {"hf": decoders.write_hf, "gguf": decoders.write_gguf, "peft": decoders.write_peft},
    "whisper": {"ct2": whisper.write_ct2},
    "bert": {"hf": encoders.write_hf},
}


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
    """The run in `workdir` (its best checkpoint) written to `out` in `format` (`FORMATS`)."""
    workdir, out = checked_workdir(workdir), Path(out)
    _check_request(format, dtype, out, force, workdir)
    _source(task_type.name, str(workdir), run_config(task_type, workdir).model.pretrained, format)
    return written(load(task_type, workdir), str(workdir), format, out, dtype)


def export_checkpoint(
    task_type: type, name: str, format: str, out: str | Path, *, dtype: str = "float32", force: bool = False
) -> Exported:
    """The pretrained checkpoint `name` as it is, in `format`: a shipped GGUF as the Hugging Face
    folder that a run's PEFT adapters go on, say, or as a float32 GGUF."""
    out = Path(out)
    _check_request(format, dtype, out, force)
    return written(load_pretrained(task_type, name, whole_context=True), name, format, out, dtype)


def written(loaded: Loaded, where: str, format: str, out: Path, dtype: str) -> Exported:
    """`loaded` (a run, or a checkpoint loaded as one: `where` names it) written to `out`."""
    task = loaded.task
    checkpoint, kind = _source(task.name, where, task.config.model.pretrained, format)
    model = loaded.steps.model(loaded.params)
    adapters = 0 if format == "peft" else lora.merge(model)
    params = {path: np.asarray(value, np.float32) for path, value in flat_params(model).items()}
    # The run's rows are its training length; the weights keep the checkpoint's whole context.
    architecture = dataclasses.replace(task.config.model, max_len=checkpoint.model.max_len)
    with _staged(out) as path:
        WRITERS[kind][format](path, checkpoint, architecture, params, dtype, loaded.featurizer)
        inside = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files = {str(p.relative_to(path.parent if path.is_file() else path)): p.stat().st_size for p in inside}
    return Exported(out, format, dtype, task.config.model.pretrained, adapters, files)


def _check_request(format: str, dtype: str, out: Path, force: bool, workdir: Path | None = None) -> None:
    """Refuses an unknown format or dtype, an `out` that exists (without `force`), or that is or
    holds the run itself."""
    if format not in FORMATS:
        choices = ", ".join(f"{name} ({what})" for name, what in FORMATS.items())
        raise UserError(f"--format {format}: expected one of {choices}.")
    DTYPE_CHECKS[format](dtype)
    resolved = out.resolve()
    if workdir is not None and (resolved == workdir.resolve() or resolved in workdir.resolve().parents):
        raise UserError(f"--out {out} is or holds the run {workdir}: export elsewhere.")
    if out.exists() and not force:
        raise UserError(f"--out {out} exists: give --force to replace it, or choose another path.")


def _source(task: str, where: str, source: str | None, format: str) -> tuple[pretrained.Checkpoint, str]:
    """The checkpoint the run started from and its kind (`WRITERS`), which must write `format`."""
    what = "; ".join(f"{kind} runs as {', '.join(formats)}" for kind, formats in WRITERS.items())
    if source is None:
        raise UserError(
            f"{where}: its {task} run was trained from scratch (its own tokenizer and architecture); apps export "
            f"writes runs that fine-tuned a pretrained checkpoint: {what}."
        )
    checkpoint = pretrained.read_checkpoint(source)
    kind = "decoder" if pretrained.families()[checkpoint.reader].decodes else checkpoint.reader
    if kind not in WRITERS:
        raise UserError(
            f"{where}: its {task} run started from the {checkpoint.reader} checkpoint {source}, which apps export "
            f"does not write; it writes {what}."
        )
    if format not in WRITERS[kind]:
        raise UserError(f"--format {format}: a {kind} run leaves as {' or '.join(WRITERS[kind])}.")
    return checkpoint, kind


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
