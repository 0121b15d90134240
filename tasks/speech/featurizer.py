"""Examples -> batch arrays for speech: normalized log-mel frames and CTC label ids.

Fitted on the training split: the per-bin mean and deviation of the log-mel frames (of up to
`STATS_CLIPS` clips) and, for `data.units=pieces`, a sentencepiece model of the transcripts.
Label id 0 is CTC's blank; characters of `data.alphabet` follow (or the pieces, whose padding
id 0 is the blank).

A loaded featurizer knows its folder, and caches the frames of every list of examples with
stable ids (the corpus's utterances, the user's files with their size and time) in
`features/` beside it: a run computes each split's log-mel once, and its evaluations reuse them.

Refused, with the clip named: a clip longer than `data.max_seconds`, a transcript with a
character outside the alphabet, and a transcript longer than its frames can hold after
subsampling (CTC needs a frame per label and one more between repeated labels); such examples
are never silently dropped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import UserError
from core.model.frontends import subsampled_lengths
from tasks.speech import audio as audio_lib

STATS_CLIPS = 2000
# Lists of more examples than this get a progress bar while their frames are computed.
PROGRESS_FROM = 500


def describe(example: dict) -> str:
    """Where an example comes from, for messages: a manifest line, a file or a corpus id."""
    return example.get("where") or example.get("path") or str(example.get("id"))


def example_key(examples: Sequence[dict]) -> str | None:
    """A hash naming a list of examples (None if any lacks a stable id), for on-disk caches."""
    if any(e.get("id") is None for e in examples):
        return None
    return hashlib.sha1("\n".join(e["id"] for e in examples).encode()).hexdigest()[:16]


def clip(example: dict, silence_allowed: bool = False) -> np.ndarray:
    """An example's samples as float32 at 16 kHz: its rendered audio or its file (see
    `audio.load_audio` for `silence_allowed`)."""
    samples = example.get("audio")
    if samples is not None:
        samples = np.asarray(samples)
        scale = 1 / 32768 if samples.dtype == np.int16 else 1.0  # the rendered corpus keeps int16
        return audio_lib.check_audible(samples.astype(np.float32) * scale, describe(example), silence_allowed)
    return audio_lib.load_audio(example["path"], silence_allowed)


@dataclass
class SpeechFeaturizer:
    units: str
    alphabet: str
    mean: np.ndarray  # [80]
    std: np.ndarray  # [80]
    subsampling_layers: int
    max_seconds: float
    tokenizer: object | None = None  # tasks.nlp.tokenizer.Tokenizer for units "pieces"
    directory: Path | None = None  # set when loaded: the features cache sits beside it

    num_mels = audio_lib.NUM_MELS

    @property
    def vocab_size(self) -> int:
        # Pieces: the tokenizer's padding id 0 never labels anything and serves as the blank.
        return self.tokenizer.vocab_size if self.tokenizer is not None else 1 + len(self.alphabet)

    def save(self, directory: Path) -> None:
        state = {"units": self.units, "alphabet": self.alphabet, "mean": self.mean.tolist(), "std": self.std.tolist()}
        (directory / "speech.json").write_text(json.dumps(state))
        if self.tokenizer is not None:
            self.tokenizer.save(directory)

    @classmethod
    def load(cls, directory: Path, options) -> SpeechFeaturizer:
        state = json.loads((directory / "speech.json").read_text())
        tokenizer = None
        if state["units"] == "pieces":
            from tasks.common.tokenizer import Tokenizer

            tokenizer = Tokenizer.load(directory)
        return cls(
            units=state["units"],
            alphabet=state["alphabet"],
            mean=np.asarray(state["mean"], np.float32),
            std=np.asarray(state["std"], np.float32),
            subsampling_layers=options.subsampling_layers,
            max_seconds=options.max_seconds,
            tokenizer=tokenizer,
            directory=directory,
        )

    def encode(self, text: str, where: str) -> list[int]:
        if self.tokenizer is not None:
            return [int(i) for i in self.tokenizer.processor.encode(text)]
        unknown = sorted({c for c in text if c not in self.alphabet})
        if unknown:
            raise UserError(
                f"{where}: the transcript {text!r} has characters outside the vocabulary: "
                f"{', '.join(repr(c) for c in unknown)} (data.alphabet={self.alphabet!r}). Spell them out, or "
                "add them with --set data.alphabet=..."
            )
        return [self.alphabet.index(c) + 1 for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return "".join(self.alphabet[i - 1] for i in ids)

    def frames(self, examples: Sequence[dict]) -> list[np.ndarray]:
        """Normalized log-mel frames [T, 80] (float16) of each example, from the cache if there."""
        key = example_key(examples)
        path = None if key is None or self.directory is None else self.directory.parent / "features" / f"{key}.npz"
        if path is not None and path.exists():
            with np.load(path) as saved:
                return np.split(saved["frames"], np.cumsum(saved["lengths"])[:-1])
        frames = [((f - self.mean) / self.std).astype(np.float16) for f in raw_frames(examples, self.max_seconds)]
        if path is not None:
            path.parent.mkdir(exist_ok=True)
            temporary = path.with_name(path.stem + ".tmp.npz")
            np.savez(temporary, frames=np.concatenate(frames), lengths=np.array([len(f) for f in frames]))
            temporary.rename(path)
        return frames

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        frames = self.frames(examples)
        labels = [self.encode(e["text"], describe(e)) for e in examples]
        check_frames_hold_labels(examples, frames, labels, self.subsampling_layers)
        width = max(len(f) for f in frames)
        rows = len(examples)
        arrays = {
            "inputs": np.zeros((rows, width, self.num_mels), np.float16),
            "mask": np.zeros((rows, width), bool),
            "targets": np.zeros((rows, width), np.int32),
            "target_mask": np.zeros((rows, width), bool),
            "weights": np.ones(rows, np.float32),
        }
        for row, (f, ids) in enumerate(zip(frames, labels)):
            arrays["inputs"][row, : len(f)] = f
            arrays["mask"][row, : len(f)] = True
            arrays["targets"][row, : len(ids)] = ids
            arrays["target_mask"][row, : len(ids)] = True
        return arrays


def raw_frames(examples: Sequence[dict], max_seconds: float) -> list[np.ndarray]:
    """Log-mel frames of each example's clip, refusing clips longer than `max_seconds`."""
    from rich.progress import track
    from threadpoolctl import threadpool_limits

    results = []
    iterator = examples
    if len(examples) > PROGRESS_FROM:
        iterator = track(examples, description="log-mel features", transient=True)
    # A clip's products are small: one BLAS thread runs them ~100x faster than a pool hands them off.
    with threadpool_limits(1, user_api="blas"):
        for example in iterator:
            samples = clip(example)
            seconds = len(samples) / audio_lib.SAMPLE_RATE
            if seconds > max_seconds:
                raise UserError(
                    f"{describe(example)}: the clip is {seconds:.1f} s long, longer than the model's context of "
                    f"{max_seconds:g} s (data.max_seconds): cut it into shorter clips."
                )
            results.append(audio_lib.log_mel(samples))
    return results


def required_frames(labels: Sequence[int]) -> int:
    """Frames CTC needs for a label sequence: one per label, one more between equal neighbours."""
    return len(labels) + sum(1 for a, b in zip(labels, labels[1:]) if a == b)


def check_frames_hold_labels(examples, frames, labels, layers: int) -> None:
    short = []
    for example, f, ids in zip(examples, frames, labels):
        kept = int(subsampled_lengths(len(f), layers))
        if kept < required_frames(ids):
            short.append(f"{describe(example)} ({kept} frames for {required_frames(ids)} labels)")
    if short:
        raise UserError(
            f"{len(short)} clip(s) are too short for their transcripts after {2**layers}x subsampling (CTC needs "
            f"a frame per label, and one between repeated labels): {'; '.join(short[:5])}"
            f"{' ...' if len(short) > 5 else ''}. Remove or fix them, or lower data.subsampling_layers."
        )


def fit_featurizer(train: Sequence[dict], options) -> SpeechFeaturizer:
    """Mean and deviation of the log-mel bins over (up to `STATS_CLIPS` of) the training clips,
    and the sentencepiece model for `units=pieces`."""
    rng = np.random.default_rng(0)
    chosen = [train[i] for i in sorted(rng.permutation(len(train))[:STATS_CLIPS])]
    stacked = np.concatenate(raw_frames(chosen, options.max_seconds))
    tokenizer = None
    if options.units == "pieces":
        from tasks.common.tokenizer import Tokenizer

        tokenizer = Tokenizer.train((e["text"] for e in train), options.vocab_size)
    return SpeechFeaturizer(
        units=options.units,
        alphabet=options.alphabet,
        mean=stacked.mean(0),
        std=stacked.std(0) + 1e-5,
        subsampling_layers=options.subsampling_layers,
        max_seconds=options.max_seconds,
        tokenizer=tokenizer,
    )
