"""Whisper in the speech task: its featurizer and the task's route (`WhisperRoute`: the model,
loss and decoding of a Whisper run).

The speech task takes this route when its model is an encoder-decoder (`model.decoder_layers`
set: a Whisper checkpoint's `model.pretrained`, which the config adopts, or a model built from
scratch in Whisper's shape). The encoder reads `tasks.speech.audio.whisper_log_mel` of a
window (the clip padded with silence) of `data.max_seconds`, at most 30 s: Whisper was trained
on 30 s windows, and reads them best zero-shot; a shorter window costs less in proportion (its
attention, with the square), which fine-tuning on short clips can afford to learn. The decoder
reads the prompt (`core.checkpoints.whisper.Vocabulary.prompt`: start, language, task,
no-timestamps) and then the transcript's tokens, each predicted from those before; the loss
counts the transcript's tokens and its end.

Decoding: text alone window by window (`tasks.speech.windows`), or with timestamps, segments
(`tasks.speech.segments`) and words (`tasks.speech.words`), in each recording's language
(`tasks.speech.language`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flax import nnx

from core.checkpoints import pretrained, whisper
from core.config import Config
from core.errors import UserError
from core.model.encoder_decoder import Start
from core.model.heads import Projection
from core.task import scored_positions
from core.training import losses
from tasks.common.tokenizer import PretrainedTokenizer
from tasks.speech import audio as audio_lib
from tasks.speech.featurizer import clip, describe
from tasks.speech.windows import Decoding, transcribe

if TYPE_CHECKING:
    from tasks.speech.asr import SpeechTask


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

    def decoding(self, language: str = "", task: str = "", timestamps: bool = False) -> Start:
        """How a window's decoding starts (`Vocabulary.decoding`): in `language` and for `task`
        where given, else the featurizer's own (English for an English-only model), with
        timestamp tokens or without."""
        return self.vocabulary.decoding(language or self.language or "en", task or self.task, timestamps)

    def earlier(self, text: str) -> tuple[int, ...]:
        """Whisper's prompt of earlier `text` (none if blank): <|startofprev|>, then the
        text's tokens after a space (special tokens typed in it are read as text)."""
        if not text.strip():
            return ()
        if self.vocabulary.previous is None:
            raise UserError(f"{self.checkpoint}'s tokenizer has no <|startofprev|> token: it takes no prompt.")
        [ids] = self.tokenizer.pieces([" " + text.strip()])
        return (self.vocabulary.previous, *(i for i in ids if i < self.vocabulary.end))

    @property
    def alignment_heads(self) -> tuple[tuple[int, int], ...]:
        return _alignment_heads(self.checkpoint)

    @property
    def window_frames(self) -> int:
        """The encoder's window in 10 ms frames: `max_seconds`, at most 30 s, rounded to an even
        count (the stem's second convolution halves it)."""
        return 2 * max(1, round(min(self.max_seconds, 30.0) * 50))

    @property
    def window_samples(self) -> int:
        return self.window_frames * audio_lib.HOP

    def frames(self, samples: np.ndarray) -> np.ndarray:
        return audio_lib.whisper_log_mel(samples, self.mel_bins, self.window_frames).astype(np.float16)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids up to the end token (special tokens dropped), without
        Whisper's leading space."""
        ids = [int(i) for i in ids]
        if self.vocabulary.end in ids:
            ids = ids[: ids.index(self.vocabulary.end)]
        return self.tokenizer.decode([i for i in ids if i < self.vocabulary.end]).strip()

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        """Teacher forcing: each clip's window and its transcript after the prompt."""
        prompt = list(self.decoding().prompt)
        rows = []
        for example in examples:
            samples = clip(example)
            if len(samples) > self.window_samples:
                raise UserError(
                    f"{describe(example)}: the clip is {len(samples) / audio_lib.SAMPLE_RATE:.1f} s long; Whisper "
                    f"trains on clips of at most one window, {self.window_samples / audio_lib.SAMPLE_RATE:g} s "
                    "(data.max_seconds, at most 30): cut it first."
                )
            text = self.tokenizer.pieces([" " + example["text"].strip()])[0] if example["text"].strip() else []
            rows.append((self.frames(samples), [*prompt, *text, self.vocabulary.end]))
        width = max(len(ids) for _, ids in rows) - 1
        arrays = {
            "inputs": np.stack([frames for frames, _ in rows]),
            "mask": np.ones((len(rows), self.window_frames), bool),
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


@functools.cache
def _alignment_heads(checkpoint: str) -> tuple[tuple[int, int], ...]:
    return whisper.alignment_heads(checkpoint)


class WhisperRoute:
    """How the speech task trains, scores and decodes Whisper's encoder-decoder."""

    # Validation WER is of greedy transcripts (without the temperature fallback, which would
    # cost a looping early checkpoint five samples per window and temperature); evaluation
    # generates greedy and beam transcripts. Both read text alone, as fine-tuning teaches it
    # (the no-timestamps prompt); `apps predict` gives segments with times.
    # Both read the data's language (data.language), not a detected one.
    validation_decoding: ClassVar[dict[str, Any] | None] = {
        "beam_width": 1,
        "fallback": False,
        "timestamps": False,
        "language": "",
    }
    evaluated_decodings: ClassVar[dict[str, dict[str, Any]]] = {
        "greedy": {"beam_width": 1, "timestamps": False, "language": ""},
        "beam": {"beam_width": 5, "timestamps": False, "language": ""},
    }

    def __init__(self, task: SpeechTask):
        self.task = task

    def fit_featurizer(self, train: Sequence[dict]) -> WhisperFeaturizer:
        config = self.task.config
        return WhisperFeaturizer.from_checkpoint(config.model.pretrained or config.data.whisper_tokenizer, config.data)

    def load_featurizer(self, directory: Path) -> WhisperFeaturizer:
        return self.fit_featurizer([])

    def model(self, featurizer: WhisperFeaturizer, config: Config, rngs: nnx.Rngs) -> nnx.Module:
        vocab_size = pretrained.read_checkpoint(featurizer.checkpoint).vocab_size
        return whisper.build(config.model, featurizer.mel_bins, vocab_size, rngs)

    def loss(self, outputs: Projection, batch: dict):
        smoothing = self.task.config.optim.label_smoothing
        return losses.linear_cross_entropy(
            outputs.hidden, outputs.weight, batch["targets"], scored_positions(batch), smoothing
        )

    def metrics(self, outputs: Projection, batch: dict):
        nll = losses.linear_cross_entropy(outputs.hidden, outputs.weight, batch["targets"], scored_positions(batch))
        return {"nll": nll}

    def decode(self, outputs: Projection, batch: dict) -> dict:
        return {}  # transcripts are generated (`transcribe`), not read off the teacher-forced pass

    def score(self, predictions, examples: Sequence[dict], featurizer: WhisperFeaturizer) -> dict[str, float]:
        return {}

    def transcribe(self, model, featurizer: WhisperFeaturizer, examples, options: dict) -> dict[str, list]:
        """Each clip's transcript in the prompt's language (given, or `auto`: detected per clip,
        `tasks.speech.language`) and task: with `timestamps`, its language, the probability of
        a detected one, and its segments too (`tasks.speech.segments`)."""
        from tasks.speech import language

        asked = options["language"] or featurizer.language or "en"
        batch_size = self.task.config.train.eval_batch_size
        if asked == language.AUTO:
            found = language.detect(model, featurizer, examples, batch_size)
        else:
            found = [(asked, None)] * len(examples)
        results: dict[str, list] = {}
        for code, indices in language.by_language([code for code, _ in found]).items():
            group = self._decoded(model, featurizer, [examples[i] for i in indices], code, options)
            for key, values in group.items():
                results.setdefault(key, [None] * len(examples))
                for index, value in zip(indices, values):
                    results[key][index] = value
        if "segments" in results:
            results["language"] = [code for code, _ in found]
            results["language_probability"] = [probability for _, probability in found]
        return results

    def _decoded(self, model, featurizer: WhisperFeaturizer, examples, language: str, options: dict):
        """The clips' transcripts in one `language`, with their segments where timestamps are on."""
        from tasks.speech import segments

        timed = options.get("timestamps", False)
        decoding = Decoding(
            start=featurizer.decoding(language, options["task"], timed),
            beam_width=options["beam_width"],
            batch_size=self.task.config.train.eval_batch_size,
            fallback=options.get("fallback", True),
            temperature=options.get("temperature", 0.0),
            previous=featurizer.earlier(options.get("prompt", "")),
        )
        if not timed:
            return {"text": transcribe(model, featurizer, examples, decoding)[0]}
        found = segments.transcribe(
            model,
            featurizer,
            examples,
            decoding,
            batched=options.get("batched", False),
            words=options.get("word_timestamps", False),
            vad=options.get("vad", False),
        )
        return {
            "text": ["".join(s["text"] for s in timed).strip() for timed in found],
            "segments": [[segments.shown(s) for s in timed] for timed in found],
        }
