"""The user's own recordings (`--data`), and the pocketsphinx baseline's cached transcripts.

`--data` takes:

- a manifest, `.csv`, `.tsv`, `.jsonl` or `.parquet`, with an audio path column
  (`data.audio_column`, default `audio`; relative paths are read from the manifest's folder) and
  a transcript column (`data.text_column`, default `text`), and optionally a `split` column
  (train / valid / test);
- a folder of audio files (`.wav`, `.flac`, `.ogg`, searched recursively), each with its
  transcript in a same-named `.txt` file beside it;
- the name of a hub dataset with an audio column (decoded by `datasets`), when online.

Without a split column, a CRC-32 of each clip's path puts 5% in test, 5% in valid and the rest
in train. Transcripts are normalized as the metrics read them (tasks/speech/scoring.py). Any
missing file, missing column or empty transcript stops the run before training, with every
offending line or file named (the first five): no clip is silently skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from core.errors import UserError
from tasks.common.splits import hash_split
from tasks.common.tables import read_file, read_hub, require_columns
from tasks.speech import audio as audio_lib
from tasks.speech.corpus import SHARES, cache_root
from tasks.speech.featurizer import clip, example_key
from tasks.speech.scoring import normalize, pocketsphinx_transcripts

MANIFESTS = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
SPLIT_NAMES = {"train": "train", "valid": "valid", "validation": "valid", "dev": "valid", "test": "test"}


def load_user_data(spec: str, options) -> dict[str, list[dict]]:
    """The examples of `--data spec` by split."""
    path = Path(spec)
    if path.is_dir():
        examples = _folder(path)
    elif path.suffix.lower() in MANIFESTS:
        examples = _manifest(path, options.audio_column, options.text_column)
    elif path.suffix.lower() in audio_lib.FORMATS or path.exists():
        raise UserError(
            f"--data {spec}: give a manifest ({', '.join(MANIFESTS)}) or a folder of audio files with "
            ".txt transcripts, not a single file."
        )
    else:
        examples = _hub(spec, options.audio_column, options.text_column)
    splits: dict[str, list[dict]] = {"train": [], "valid": [], "test": []}
    for example in examples:
        splits[example.pop("split")].append(example)
    return splits


def _file_example(path: Path, text: str, where: str, split: str) -> dict:
    stat = path.stat()
    return {
        "id": f"{path.resolve()}:{stat.st_mtime_ns}:{stat.st_size}",
        "audio": None,
        "path": str(path),
        "text": text,
        "voice": None,
        "where": where,
        "split": split,
    }


def _report(problems: list[str], what: str) -> None:
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"{len(problems)} {what}: {'; '.join(problems[:5])}{more}. Fix them before training.")


def _folder(folder: Path) -> list[dict]:
    clips = sorted(p for p in folder.rglob("*") if p.suffix.lower() in audio_lib.FORMATS and p.is_file())
    if not clips:
        raise UserError(f"--data {folder}: no {', '.join(audio_lib.FORMATS)} files in this folder.")
    missing = [str(p.with_suffix(".txt")) for p in clips if not p.with_suffix(".txt").is_file()]
    _report(missing, "clip(s) have no transcript file beside them")
    examples, empty = [], []
    for path in clips:
        text = normalize(path.with_suffix(".txt").read_text(encoding="utf-8", errors="replace"))
        if not text:
            empty.append(str(path.with_suffix(".txt")))
        name = str(path.relative_to(folder))
        examples.append(_file_example(path, text, str(path), hash_split(name, SHARES)))
    _report(empty, "transcript file(s) are empty")
    return examples


def _manifest(path: Path, audio_column: str, text_column: str) -> list[dict]:
    table = read_file(path)
    require_columns(table, {"data.audio_column": audio_column, "data.text_column": text_column}, str(path))
    # Line numbers as an editor shows them: CSV and TSV have a header line, JSON lines none.
    first = {".csv": 2, ".tsv": 2, ".jsonl": 1, ".json": 1}.get(path.suffix.lower())
    splits = table["split"] if "split" in table.column_names else None
    examples, problems = [], []
    for row, (name, text) in enumerate(zip(table[audio_column], table[text_column])):
        where = f"{path} line {row + first}" if first else f"{path} row {row + 1}"
        if not isinstance(name, str) or not name.strip():
            problems.append(f"{where}: no audio path")
            continue
        clip_path = Path(name) if Path(name).is_absolute() else path.parent / name
        if not clip_path.is_file():
            problems.append(f"{where}: no such file {clip_path}")
            continue
        text = normalize(text) if isinstance(text, str) else ""
        if not text:
            problems.append(f"{where}: empty transcript")
            continue
        split = hash_split(name, SHARES) if splits is None else SPLIT_NAMES.get(str(splits[row]).strip().lower())
        if split is None:
            problems.append(f"{where}: split {splits[row]!r} is not one of {', '.join(SPLIT_NAMES)}")
            continue
        examples.append(_file_example(clip_path, text, f"{where} ({name})", split))
    _report(problems, "manifest line(s) cannot be used")
    if not examples:
        raise UserError(f"--data {path} has no rows.")
    return examples


def _hub(name: str, audio_column: str, text_column: str) -> list[dict]:
    """A hub dataset's splits (train, validation or valid, test) with decoded audio."""
    import librosa

    local = f"a manifest ({', '.join(MANIFESTS)}) or a folder of audio files with .txt transcripts"
    dataset = read_hub(name, local)
    examples = []
    for split_name, table in dataset.items():
        split = SPLIT_NAMES.get(split_name)
        if split is None:
            continue
        require_columns(table, {"data.audio_column": audio_column, "data.text_column": text_column}, name)
        for row, record in enumerate(table):
            decoded = record[audio_column]
            samples = np.asarray(decoded["array"], np.float32)
            if samples.ndim > 1:
                samples = librosa.to_mono(samples)
            if decoded["sampling_rate"] != audio_lib.SAMPLE_RATE:
                samples = librosa.resample(samples, orig_sr=decoded["sampling_rate"], target_sr=audio_lib.SAMPLE_RATE)
            examples.append(
                {
                    "id": f"hub:{name}:{split_name}:{row}",
                    "audio": samples,
                    "path": None,
                    "text": normalize(record[text_column] or ""),
                    "voice": None,
                    "where": f"hub dataset {name!r}, {split_name} row {row + 1}",
                    "split": split,
                }
            )
    return examples


def pocketsphinx_cached(examples: list[dict]) -> list[str]:
    """pocketsphinx's transcripts of the examples' clips, cached on disk by the examples' ids
    (decoding runs at about a third of real time here, so each test set is decoded once)."""
    from rich.progress import Progress

    key = example_key(examples)
    path = None if key is None else cache_root() / "pocketsphinx" / f"{key}.json"
    if path is not None and path.exists():
        return json.loads(path.read_text())
    with Progress(transient=True) as progress:
        bar = progress.add_task("pocketsphinx", total=len(examples))
        transcripts = pocketsphinx_transcripts((clip(e) for e in examples), lambda: progress.advance(bar))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(transcripts))
    return transcripts
