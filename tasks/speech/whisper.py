"""Whisper in the speech task: its featurizer, windows over long audio, and transcription.

The speech task takes this path when its model is an encoder-decoder (`model.decoder_layers`
set: a Whisper checkpoint's `model.pretrained`, which the config adopts, or a model built from
scratch in Whisper's shape). The encoder reads `tasks.speech.audio.whisper_log_mel` of a 30 s
window (the clip padded with silence, as Whisper was trained), the decoder the prompt
(`core.whisper.Vocabulary.prompt`: start, language, task, no-timestamps) and then the
transcript's tokens, each predicted from those before; the loss counts the transcript's tokens
and its end.

Audio longer than one window is cut into windows of at most 30 s, each cut placed at the
quietest 100 ms of the window's last 5 s (so that a word is rarely split), covering every
sample once; the windows' transcripts are joined with a space. A window whose no-speech
probability (the `<|nospeech|>` token's, right after the start token) passes
`NO_SPEECH_THRESHOLD` gives no text, as Whisper does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core import whisper
from core.encoder_decoder import Start, generate_beams_from_source, generate_from_source
from core.errors import UserError
from tasks.common.tokenizer import PretrainedTokenizer
from tasks.speech import audio as audio_lib
from tasks.speech.featurizer import clip, describe

WINDOW_SAMPLES = audio_lib.WHISPER_FRAMES * audio_lib.HOP  # 30 s
SEARCH_SAMPLES = 5 * audio_lib.SAMPLE_RATE  # where a window's cut is looked for: its last 5 s
QUIET_SAMPLES = audio_lib.SAMPLE_RATE // 10  # the stretch whose energy a cut minimizes: 100 ms
NO_SPEECH_THRESHOLD = 0.6  # Whisper's own
# Whisper's decoder holds 448 positions and its transcribe() writes at most half of them.
MAX_NEW_TOKENS = 224


def cut_windows(samples: np.ndarray) -> list[slice]:
    """Windows of at most 30 s covering every sample once; each cut but the last falls at the
    start of the quietest 100 ms within the window's last 5 s."""
    cuts, start = [], 0
    while len(samples) - start > WINDOW_SAMPLES:
        end = start + WINDOW_SAMPLES
        region = samples[end - SEARCH_SAMPLES : end].astype(np.float64) ** 2
        energy = np.convolve(region, np.ones(QUIET_SAMPLES), mode="valid")  # [SEARCH - QUIET + 1]
        cut = end - SEARCH_SAMPLES + int(np.argmin(energy))
        cuts.append(slice(start, cut))
        start = cut
    return [*cuts, slice(start, len(samples))]


@dataclass
class WhisperFeaturizer:
    """The checkpoint's tokenizer and special tokens; the language and task of its prompt."""

    checkpoint: str
    tokenizer: PretrainedTokenizer
    vocabulary: whisper.Vocabulary
    mel_bins: int
    language: str | None
    task: str
    max_seconds: float

    @classmethod
    def from_checkpoint(cls, checkpoint: str, options) -> WhisperFeaturizer:
        vocabulary = whisper.vocabulary(checkpoint)
        language = options.language if vocabulary.multilingual else None
        featurizer = cls(
            checkpoint,
            PretrainedTokenizer.from_checkpoint(checkpoint),
            vocabulary,
            whisper.mel_bins(checkpoint),
            language,
            options.whisper_task,
            options.max_seconds,
        )
        featurizer.decoding()  # an unknown language or task fails here, before any audio is read
        return featurizer

    def save(self, directory: Path) -> None:
        """Nothing beyond the config: the checkpoint holds the tokenizer."""

    def decoding(self, language: str = "", task: str = "") -> Start:
        """How a window's decoding starts (`Vocabulary.decoding`): in `language` and for `task`
        where given, else the featurizer's own (English for an English-only model)."""
        return self.vocabulary.decoding(language or self.language or "en", task or self.task)

    def frames(self, samples: np.ndarray) -> np.ndarray:
        return audio_lib.whisper_log_mel(samples, self.mel_bins).astype(np.float16)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids up to the end token (special tokens dropped), without
        Whisper's leading space."""
        ids = [int(i) for i in ids]
        if self.vocabulary.end in ids:
            ids = ids[: ids.index(self.vocabulary.end)]
        return self.tokenizer.decode([i for i in ids if i < self.vocabulary.end]).strip()

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        """Teacher forcing: each clip's 30 s window and its transcript after the prompt."""
        prompt = list(self.decoding().prompt)
        rows = []
        for example in examples:
            samples = clip(example)
            if len(samples) > min(self.max_seconds, 30.0) * audio_lib.SAMPLE_RATE:
                raise UserError(
                    f"{describe(example)}: the clip is {len(samples) / audio_lib.SAMPLE_RATE:.1f} s long; Whisper "
                    f"trains on clips of at most {min(self.max_seconds, 30.0):g} s (one window): cut it first."
                )
            text = self.tokenizer.pieces([" " + example["text"].strip()])[0] if example["text"].strip() else []
            rows.append((self.frames(samples), [*prompt, *text, self.vocabulary.end]))
        width = max(len(ids) for _, ids in rows) - 1
        arrays = {
            "inputs": np.stack([frames for frames, _ in rows]),
            "mask": np.ones((len(rows), audio_lib.WHISPER_FRAMES), bool),
            "decoder_inputs": np.zeros((len(rows), width), np.int32),
            "decoder_mask": np.zeros((len(rows), width), bool),
            "targets": np.zeros((len(rows), width), np.int32),
            "target_mask": np.zeros((len(rows), width), bool),
            "weights": np.ones(len(rows), np.float32),
        }
        for row, (_, ids) in enumerate(rows):
            n = len(ids) - 1
            arrays["decoder_inputs"][row, :n] = ids[:-1]
            arrays["decoder_mask"][row, :n] = True
            arrays["targets"][row, :n] = ids[1:]
            arrays["target_mask"][row, len(prompt) - 1 : n] = True  # the transcript and its end
        return arrays


def transcribe(
    model, featurizer: WhisperFeaturizer, examples: Sequence[dict], start: Start, beam_width: int, batch_size: int
):
    """Each example's transcript after the prompt `start` (`Vocabulary.decoding`: language and
    task), greedy with `beam_width` 1, else beam search as Whisper's (the first W ended beams, by
    log-probability over length), and, per example, the windows' no-speech probabilities."""
    vocabulary = featurizer.vocabulary
    pieces = []  # (example index, frames)
    for index, example in enumerate(examples):
        samples = clip(example, silence_allowed=True)  # Whisper says itself that a window holds no speech
        pieces += [(index, featurizer.frames(samples[window])) for window in cut_windows(samples)]
    texts: list[list[str]] = [[] for _ in examples]
    no_speech: list[list[float]] = [[] for _ in examples]
    settings = {"max_new_tokens": MAX_NEW_TOKENS, "start": start, "stop_tokens": [vocabulary.end]}
    for first in range(0, len(pieces), batch_size):
        chunk = pieces[first : first + batch_size]
        frames = [frames for _, frames in chunk]
        if beam_width > 1:
            beams = generate_beams_from_source(
                model, frames, beam_size=beam_width, length_penalty=1.0, early_stopping=True, **settings
            )
            tokens, lengths, probe = beams.tokens[:, 0], beams.lengths[:, 0], beams.probe
        else:
            generated = generate_from_source(model, frames, **settings)
            tokens, lengths, probe = generated.tokens, generated.lengths, generated.probe
        for (index, _), ids, length, p in zip(chunk, tokens, lengths, probe):
            no_speech[index].append(float(p))
            if p <= NO_SPEECH_THRESHOLD:
                texts[index].append(featurizer.decode(ids[:length]))
    return [" ".join(t for t in parts if t) for parts in texts], no_speech
