"""The speech task from Python: a trained run or a Whisper checkpoint loaded once, transcribing
clips (files or samples) to text, or to segments with their times."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from core.errors import UserError
from core.run import Predictor
from tasks.speech import audio
from tasks.speech.asr import SpeechTask


class Transcriber(Predictor):
    """A trained speech workdir, or a Whisper checkpoint as it is, loaded once, for Python
    prototypes:

    from tasks.speech.transcriber import Transcriber
    Transcriber("runs/speech").transcribe(["a.wav", "b.flac"], beam_width=8)  # [transcript]
    Transcriber(model="whisper-tiny.en").transcribe([samples_16khz, "c.wav"], beam_width=1)
    Transcriber(model="whisper-tiny.en").segments(["talk.flac"])  # [{"text", "language", "segments"}]
    Transcriber(model="whisper-base", dtype="bfloat16")  # its linear layers' weights in bfloat16
    """

    def __init__(self, workdir: str | Path | None = None, *, model: str | None = None, dtype: str = "float32"):
        super().__init__(SpeechTask, workdir, model=model, dtype=dtype)

    def transcribe(self, clips: Sequence[str | Path | np.ndarray], beam_width: int = 8, prompt: str = "") -> list[str]:
        """The transcript of each clip: an audio file, or samples at 16 kHz: floats in [-1, 1],
        or integer PCM (int16 as WAV files hold it), scaled to [-1, 1]. Text alone (Whisper
        decodes without timestamp tokens, as fine-tuning teaches it). `prompt`: Whisper's, a text
        read as coming before each clip (its spelling, names and style followed)."""
        options = self.options({"beam_width": beam_width, "timestamps": False, "prompt": prompt})
        return self.task.generate(self.model, self.featurizer, _examples(clips), options)["text"]

    def segments(
        self,
        clips: Sequence[str | Path | np.ndarray],
        beam_width: int = 8,
        batched: bool = False,
        vad: bool = False,
        prompt: str = "",
    ):
        """Each clip's transcript with its language and its segments, each {"start", "end",
        "text"} in seconds (Whisper's timestamp tokens: `tasks.speech.segments`); clips and
        `prompt` as `transcribe` takes them; `batched` and `vad` as `apps predict speech` takes them."""
        values = {"beam_width": beam_width, "timestamps": True, "batched": batched, "vad": vad, "prompt": prompt}
        options = self.options(values)
        found = self.task.generate(self.model, self.featurizer, _examples(clips), options)
        if "segments" not in found:
            raise UserError("Segments with times come from Whisper; a CTC model gives text alone (transcribe).")
        return [
            {k: found[k][i] for k in ("text", "language", "language_probability", "segments")}
            for i in range(len(clips))
        ]


def _examples(clips: Sequence[str | Path | np.ndarray]) -> list[dict]:
    return [
        {"id": None, "audio": None, "path": str(c), "text": "", "voice": None}
        if isinstance(c, (str, Path))
        else {"id": None, "audio": audio.as_float_samples(c), "where": f"clip {i}", "text": "", "voice": None}
        for i, c in enumerate(clips, 1)
    ]
