"""Voice activity detection: the stretches of a recording that hold speech, before Whisper reads it.

Silero VAD (version 6, the ONNX file faster-whisper ships in its wheel, read with onnxruntime)
gives each 32 ms frame of 16 kHz audio a speech probability, reading it with the frame before's
last 4 ms and carrying its recurrent state through the recording (`probabilities`). Speech
begins at a frame at or above `threshold` and ends where a quiet that lasts `min_silence`
begins (quiet: below `threshold - 0.15`, so that a frame in between neither begins nor ends
it); each stretch keeps `pad` seconds of audio either side, and two stretches closer than twice
that meet halfway (`speech`). These are faster-whisper's defaults and its rules, as its
`vad_filter` applies them.

The stretches are decoded joined (`Kept.joined`), and the times found in the joined audio are
put back on the recording's clock (`Kept.original`), so that segments and words keep the
original audio's times.
"""

from __future__ import annotations

import bisect
import functools
import importlib.util
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import UserError
from tasks.speech import audio
from tasks.speech.windows import cut_windows

FRAME = 512  # samples a probability: 32 ms at 16 kHz
CONTEXT = 64  # samples of the frame before that each frame is read with
STATE = 128  # the recurrent state's width
ROWS = 10_000  # frames per call of the model (320 s), the state carried between calls
STEP = 0.02  # seconds between Whisper's timestamps
CARRIER = "faster-whisper==1.2.1"  # the wheel that ships the model, installed without its dependencies


@dataclass(frozen=True)
class Settings:
    """When a frame is speech and how much audio a stretch of speech keeps (see the module's text)."""

    threshold: float = 0.5
    min_silence: float = 2.0  # seconds of quiet that end a stretch of speech
    pad: float = 0.4  # seconds kept either side of a stretch


BATCHED = Settings(min_silence=0.16)  # faster-whisper's batched pipeline's: its chunks end at shorter pauses


def model_path() -> Path:
    """The Silero VAD model inside the carrier wheel (its package is never imported: it needs
    CTranslate2)."""
    spec = importlib.util.find_spec("faster_whisper")
    found = [Path(p) / "assets" / "silero_vad_v6.onnx" for p in (spec.submodule_search_locations or [])] if spec else []
    for path in found:
        if path.is_file():
            return path
    raise UserError(
        f"Voice activity detection reads Silero VAD from the {CARRIER} wheel, which is not installed: "
        f"pip install --no-deps {CARRIER} (make install does)."
    )


@functools.cache
def _session():
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1  # a small recurrent model: one thread is fastest
    options.log_severity_level = 4
    return onnxruntime.InferenceSession(str(model_path()), options, providers=["CPUExecutionProvider"])


def probabilities(samples: np.ndarray) -> np.ndarray:
    """Each 32 ms frame's probability of speech ([ceil(len / 512)], float32); the last frame
    padded with zeros."""
    padded = np.pad(np.asarray(samples, np.float32), (0, -len(samples) % FRAME))
    frames = padded.reshape(-1, FRAME)
    before = np.concatenate([np.zeros((min(len(frames), 1), CONTEXT), np.float32), frames[:-1, -CONTEXT:]])
    rows = np.concatenate([before, frames], axis=1)  # [frames, 576]
    h = c = np.zeros((1, 1, STATE), np.float32)
    found = []
    for first in range(0, len(rows), ROWS):
        p, h, c = _session().run(None, {"input": rows[first : first + ROWS], "h": h, "c": c})
        found.append(np.reshape(p, -1))
    return np.concatenate(found) if found else np.zeros(0, np.float32)


def speech(samples: np.ndarray, settings: Settings = Settings()) -> list[tuple[int, int]]:
    """The stretches of speech in a recording, as (first sample, end sample), in order and apart."""
    quiet_below = max(settings.threshold - 0.15, 0.01)
    min_quiet = settings.min_silence * audio.SAMPLE_RATE / FRAME  # in frames
    stretches, start, quiet_from = [], None, None
    for k, p in enumerate(probabilities(samples)):
        if p >= settings.threshold:
            start, quiet_from = k if start is None else start, None
        elif p < quiet_below and start is not None:
            quiet_from = k if quiet_from is None else quiet_from
            if k - quiet_from >= min_quiet:
                stretches.append([start * FRAME, quiet_from * FRAME])
                start = quiet_from = None
    if start is not None:
        stretches.append([start * FRAME, len(samples)])
    pad = int(settings.pad * audio.SAMPLE_RATE)
    for before, after in zip(stretches, stretches[1:]):
        gap = after[0] - before[1]
        before[1], after[0] = (
            (before[1] + gap // 2, after[0] - gap // 2) if gap < 2 * pad else (before[1] + pad, after[0] - pad)
        )
    if stretches:
        stretches[0][0] = max(0, stretches[0][0] - pad)
        stretches[-1][1] = min(len(samples), stretches[-1][1] + pad)
    return [(a, min(b, len(samples))) for a, b in stretches if min(b, len(samples)) > a]


@dataclass(frozen=True)
class Kept:
    """A recording's stretches of speech (samples), joined for decoding; its times put back."""

    stretches: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, samples: np.ndarray, settings: Settings = Settings()) -> Kept:
        return cls(tuple(speech(samples, settings)))

    def joined(self, samples: np.ndarray) -> np.ndarray:
        return np.concatenate([samples[a:b] for a, b in self.stretches] or [samples[:0]])

    @functools.cached_property
    def ends(self) -> list[int]:
        """Where each stretch ends in the joined audio (samples)."""
        return list(itertools.accumulate(b - a for a, b in self.stretches))

    def windows(self, joined: np.ndarray, window: int) -> list[slice]:
        """The joined audio in windows of at most `window` samples, cut where stretches meet, as
        faster-whisper's batched chunks are; a stretch longer than a window is cut at its quiet
        moments (`cut_windows`)."""
        cuts, start, last = [], 0, 0
        for end in self.ends:
            if end - start > window and last > start:
                cuts.append(slice(start, last))
                start = last
            last = end
        cuts.append(slice(start, len(joined)))
        return [
            slice(cut.start + piece.start, cut.start + piece.stop)
            for cut in cuts
            for piece in cut_windows(joined[cut], window)
        ]

    def original(self, seconds: float, end: bool = False) -> float:
        """A time in the joined audio on the recording's clock. Whisper's times come in 20 ms
        steps, so one within a step of where two stretches meet is read as that joint: a
        start (`end` false) as the later stretch's beginning, an end as the earlier's end."""
        if not self.stretches:
            return seconds
        sample, step = round(seconds * audio.SAMPLE_RATE), round(STEP * audio.SAMPLE_RATE)
        if end:
            k = min(bisect.bisect_left(self.ends, sample - step + 1), len(self.stretches) - 1)
        else:
            k = min(bisect.bisect_right(self.ends, sample + step - 1), len(self.stretches) - 1)
        first, last = self.stretches[k]
        found = min(max(first + sample - (self.ends[k] - (last - first)), first), last)
        return round(found / audio.SAMPLE_RATE, 3)
