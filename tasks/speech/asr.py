"""Speech recognition on log-mel spectrograms: a Transformer encoder trained with CTC, or Whisper.

The task takes one of two routes, chosen when it is made (`route`): a CTC encoder built here
(`tasks.speech.ctc`), or Whisper's encoder-decoder, pretrained or in its shape
(`tasks.speech.whisper`). The route supplies the featurizer, the model, the loss and the
decoding; the task the data, the scores, SpecAugment and the inputs.

Default data: the embedded corpus that eSpeak NG renders (tasks/speech/corpus.py): review
sentences (`base`) or digit strings (`--preset digits`), tested on held-out voices. `--data`
takes the user's recordings (tasks/speech/data.py), or names an embedded corpus (`digits`,
`sentences`: what a pretrained `--model` is scored on); `--data synthetic` a tiny digits corpus
for tests. WER and CER are scored with jiwer beside pocketsphinx (tasks/speech/scoring.py).

Batches hold `inputs` [B, T, 80] (normalized log-mel, float16 on the host), `mask` [B, T],
and the transcript's ids in `targets` [B, T] with `target_mask` (a transcript is padded to the
frame width: it never outnumbers its frames). SpecAugment: the `augment` hook draws, seeded by
the step, which frames and mel bins each training row loses (`keep_frames` [B, T],
`keep_bins` [B, 80]); the train step applies them on the device (`augment_on_device`).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, require
from core.errors import UserError
from core.model.heads import Projection
from core.options import PredictOption, RequestLimits
from core.presets import tiny_body, tiny_preset
from core.task import Task, final
from tasks.speech import audio, corpus, subtitles
from tasks.speech.ctc import CTCOutputs, CTCRoute
from tasks.speech.featurizer import SpeechFeaturizer
from tasks.speech.scoring import NORMALIZATION, grouped_error_rates
from tasks.speech.whisper import WhisperFeaturizer, WhisperRoute


@dataclass(frozen=True, kw_only=True)
class SpeechData(DataConfig):
    """The corpus, the output units, the context and SpecAugment.

    `corpus`: the embedded default read when --data is not given. `units`: characters of
    `alphabet` (after the normalization of tasks/speech/scoring.py), or sentencepiece
    `pieces` (unigram, `vocab_size`) trained on the training transcripts. `max_seconds`: the
    longest clip the model reads; a longer one is refused with its name (cut it first). For
    Whisper it is the encoder's window too (at most 30 s; tasks/speech/whisper.py), and longer
    audio is transcribed window by window.
    """

    corpus: Literal["sentences", "digits"] = "sentences"
    units: Literal["chars", "pieces"] = "chars"
    alphabet: str = "abcdefghijklmnopqrstuvwxyz' "
    vocab_size: int = 256
    max_seconds: float = 20.0
    subsampling_layers: int = 2
    conv_channels: int = 32
    freq_masks: int = 2
    freq_mask_bins: int = 15
    time_masks: int = 2
    time_mask_ratio: float = 0.05
    # --data manifests: the columns of the audio path and of the transcript.
    audio_column: str = "audio"
    text_column: str = "text"
    # Whisper (tasks/speech/whisper.py): the language of the speech (what fine-tuning teaches
    # and evaluation reads; prediction detects it unless told), the task of the prompt
    # (transcribe, or translate into English; a multilingual checkpoint's), and the checkpoint
    # whose tokenizer a Whisper-shaped model built from scratch writes with.
    language: str = "en"
    whisper_task: Literal["transcribe", "translate"] = "transcribe"
    whisper_tokenizer: str = "whisper-tiny.en"

    def __post_init__(self):
        require(self.max_seconds > 0, "data.max_seconds", self.max_seconds, "must be positive")
        require(self.subsampling_layers >= 1, "data.subsampling_layers", self.subsampling_layers, "must be >= 1")
        require(self.conv_channels > 0, "data.conv_channels", self.conv_channels, "must be positive")
        require(self.vocab_size > 2, "data.vocab_size", self.vocab_size, "must be above 2")
        require(0 <= self.time_mask_ratio < 1, "data.time_mask_ratio", self.time_mask_ratio, "must be in [0, 1)")
        require(len(set(self.alphabet)) == len(self.alphabet), "data.alphabet", self.alphabet, "repeats a character")


def tiny() -> Config:
    data = SpeechData(corpus="digits", conv_channels=8, max_seconds=10.0)
    return tiny_preset("speech", tiny_body(512), data, learning_rate=1e-3, eval_batch_size=16)


def base() -> Config:
    return Config(
        task="speech",
        preset="base",
        model=ModelConfig(
            d_model=144, num_layers=4, num_heads=4, mlp_dim=576, max_len=512, dropout=0.1, positions="rotary"
        ),
        optim=OptimConfig(learning_rate=2e-3, warmup_steps=300, weight_decay=0.01),
        train=TrainConfig(
            batch_size=32, eval_batch_size=64, steps=1800, eval_every=450, checkpoint_every=450, log_every=25
        ),
        data=SpeechData(),
    )


def digits() -> Config:
    """The base model on digit strings; shorter clips make steps cheaper, so there are more."""
    config = base()
    return dataclasses.replace(
        config,
        preset="digits",
        train=dataclasses.replace(config.train, steps=2000, eval_every=500, checkpoint_every=500),
        data=dataclasses.replace(config.data, corpus="digits"),
    )


def whisper_preset(name: str, checkpoint: str, batch_size: int, learning_rate: float) -> Config:
    """Fine-tuning a shipped Whisper checkpoint (its architecture comes from the file); SpecAugment
    is an option here (`data.freq_masks`, `data.time_masks`), off as Whisper was trained. The
    encoder's window is 10 s, which holds every embedded clip and trains five times faster than
    Whisper's 30 s (tiny.en on the embedded sentences: 5.1 s a step against 27, README), so that
    300 steps fit in 30 minutes here; clips up to 30 s take `data.max_seconds=30` (a longer clip
    is refused by name)."""
    return Config(
        task="speech",
        preset=name,
        model=ModelConfig(pretrained=checkpoint, max_len=448, dropout=0.0),
        optim=OptimConfig(learning_rate=learning_rate, warmup_steps=50, weight_decay=0.01),
        train=TrainConfig(
            batch_size=batch_size, eval_batch_size=16, steps=300, eval_every=100, checkpoint_every=100, log_every=10
        ),
        data=SpeechData(max_seconds=10.0, freq_masks=0, time_masks=0),
    )


def whisper_tiny() -> Config:
    return whisper_preset("whisper-tiny", "whisper-tiny.en", batch_size=16, learning_rate=1e-5)


def whisper_base() -> Config:
    return whisper_preset("whisper-base", "whisper-base", batch_size=8, learning_rate=1e-5)


@final
@dataclass(frozen=True, kw_only=True)
class SpeechTask(Task):
    name: ClassVar[str] = "speech"
    summary: ClassVar[str] = "Speech recognition (CTC) on log-mel spectrograms"
    default_data: ClassVar[str] = "English speech rendered by eSpeak NG (review sentences or digits)"
    model_summary: ClassVar[str] = "conv subsampling 4x + encoder + CTC"
    metric_names: ClassVar[tuple[str, ...]] = ("wer", "cer")
    best_metric: ClassVar[str] = "wer"
    lower_is_better: ClassVar[bool] = True
    presets: ClassVar[dict] = {
        "tiny": tiny,
        "base": base,
        "digits": digits,
        "whisper-tiny": whisper_tiny,
        "whisper-base": whisper_base,
    }
    default_preset: ClassVar[str] = "base"
    data_type: ClassVar[type] = SpeechData
    # Clips run from under a second to many: batches of similar lengths, cut to a bucket width.
    trim: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("inputs", "targets", "target_mask")}
    generates: ClassVar[bool] = True
    predict_options: ClassVar[tuple[PredictOption, ...]] = (
        PredictOption(
            "beam_width", int, 8, "beam search with this many beams (1: greedy); CTC prefix search, or Whisper's"
        ),
        PredictOption("language", str, "auto", "Whisper: the language spoken, a code (de, fr, ...), or auto: detected"),
        PredictOption("task", str, "", "Whisper: transcribe, or translate into English (default data.whisper_task)"),
        PredictOption(
            "timestamps", bool, True, "Whisper: each file's segments with their times, from its timestamp tokens"
        ),
        PredictOption("temperature", float, 0.0, "Whisper: the first decoding samples at it (0: greedy or beam)"),
        PredictOption(
            "prompt", str, "", "Whisper: text read as coming before the audio (names, spelling, style to follow)"
        ),
        PredictOption("word_timestamps", bool, False, "Whisper: each segment's words, their times and probabilities"),
        PredictOption(
            "batched",
            bool,
            False,
            "Whisper: long audio cut at quiet moments and decoded at once (faster; segments stop at the cuts)",
        ),
        PredictOption("vad", bool, False, "Whisper: only the stretches of speech decoded (Silero VAD), times kept"),
    )
    # Subtitles, one document per file (`apps predict speech --format srt`).
    formats: ClassVar[dict[str, Callable[[dict], str]]] = {"srt": subtitles.srt, "vtt": subtitles.vtt}
    # A Whisper checkpoint transcribes as it is (apps predict speech --model whisper-tiny.en),
    # in Whisper's own 30 s windows (the fine-tuning presets' 10 s would cut long audio finer).
    zero_shot: ClassVar[bool] = True
    zero_shot_overrides: ClassVar[tuple[str, ...]] = ("data.max_seconds=30.0",)

    config: Config
    data: str | None = None

    route: CTCRoute | WhisperRoute = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # The route, chosen once: Whisper's encoder-decoder (a Whisper checkpoint, or a model in
        # its shape: `model.decoder_layers` set), else the CTC encoder.
        whisper = self.config.model.decoder_layers is not None
        object.__setattr__(self, "route", WhisperRoute(self) if whisper else CTCRoute(self))

    @property
    def validation_decoding(self) -> dict[str, Any] | None:
        return self.route.validation_decoding

    @property
    def evaluated_decodings(self) -> dict[str, dict[str, Any]]:
        return self.route.evaluated_decodings

    @property
    def corpus(self) -> str | None:
        """The embedded corpus read: `data.corpus`, or one named by --data (digits, sentences,
        synthetic); None for the user's data."""
        if self.data is None:
            return self.config.data.corpus
        return self.data if self.data in corpus.SIZES else None

    def examples(self, split: str) -> list[dict]:
        if self.corpus is not None:
            return corpus.load_corpus(self.corpus)[split]
        from tasks.speech.data import load_user_data

        return load_user_data(self.data, self.config.data)[split]

    def protocol(self) -> dict[str, str]:
        if self.corpus is None:
            return {"dataset": self.data, "protocol": f"the data's own split or a 90/5/5 hash split; {NORMALIZATION}"}
        preset = self.corpus
        sizes = corpus.SIZES[preset]
        return {
            "dataset": f"{self.default_data}: {preset}, {sizes['train']} / {sizes['valid']} / {sizes['test']}",
            "protocol": (
                f"train and valid voices: accents {', '.join(corpus.ACCENTS_SEEN)} x {len(corpus.VARIANTS_SEEN)} "
                f"variants; test: held-out variants {', '.join(corpus.VARIANTS_HELD_OUT)}, half in the held-out "
                f"accent {corpus.ACCENT_HELD_OUT}; WER/CER (jiwer) after normalization: {NORMALIZATION}"
            ),
        }

    def fit_featurizer(self, train: Sequence[dict]) -> SpeechFeaturizer | WhisperFeaturizer:
        return self.route.fit_featurizer(train)

    def load_featurizer(self, directory: Path) -> SpeechFeaturizer | WhisperFeaturizer:
        return self.route.load_featurizer(directory)

    def model(self, featurizer, config: Config, rngs: nnx.Rngs) -> nnx.Module:
        return self.route.model(featurizer, config, rngs)

    def loss(self, outputs: CTCOutputs | Projection, batch: dict):
        return self.route.loss(outputs, batch)

    def metrics(self, outputs: CTCOutputs | Projection, batch: dict):
        return self.route.metrics(outputs, batch)

    def decode(self, outputs: CTCOutputs | Projection, batch: dict) -> dict[str, jax.Array]:
        return self.route.decode(outputs, batch)

    def score(self, predictions, examples: Sequence[dict], featurizer) -> dict[str, float]:
        return self.route.score(predictions, examples, featurizer)

    def score_generated(self, generated: dict, examples: Sequence[dict], featurizer: SpeechFeaturizer):
        return grouped_error_rates(
            [e["text"] for e in examples], generated["text"], [voice_groups(e) for e in examples]
        )

    def baselines(self, train, test: Sequence[dict], featurizer: SpeechFeaturizer) -> dict[str, dict[str, float]]:
        from tasks.speech.data import pocketsphinx_cached

        hypotheses = pocketsphinx_cached(test)
        return {
            "pocketsphinx": grouped_error_rates([e["text"] for e in test], hypotheses, [voice_groups(e) for e in test])
        }

    def augment(self, batch: dict, rng: np.random.Generator, featurizer) -> dict:
        """SpecAugment's masks for each row: `freq_masks` bands of up to `freq_mask_bins` mel bins
        and `time_masks` spans of up to `time_mask_ratio` of the row's frames."""
        options = self.config.data
        rows, frames, bins = batch["inputs"].shape
        lengths = batch["mask"].sum(1)
        keep_frames, keep_bins = np.ones((rows, frames), bool), np.ones((rows, bins), bool)
        for row in range(rows):
            for _ in range(options.freq_masks):
                width = int(rng.integers(0, options.freq_mask_bins + 1))
                start = int(rng.integers(0, bins - width + 1))
                keep_bins[row, start : start + width] = False
            for _ in range(options.time_masks):
                width = int(rng.integers(0, int(options.time_mask_ratio * lengths[row]) + 1))
                start = int(rng.integers(0, max(int(lengths[row]) - width, 0) + 1))
                keep_frames[row, start : start + width] = False
        return {**batch, "keep_frames": keep_frames, "keep_bins": keep_bins}

    def augment_on_device(self, batch: dict) -> dict:
        """The masks of `augment` applied to the frames: zero where a row loses a frame or a bin."""
        inputs = batch["inputs"]
        keep = batch["keep_frames"][:, :, None] & batch["keep_bins"][:, None, :]
        return {**batch, "inputs": jnp.where(keep, inputs, 0).astype(inputs.dtype)}

    def generate(self, model, featurizer, examples, options: dict, on_text=None) -> dict:
        """Transcripts of the examples, by the route's decoding (`beam_width` 1: greedy)."""
        if options["beam_width"] < 1:
            raise UserError(f"--beam-width {options['beam_width']}: must be at least 1 (1 is greedy).")
        found = self.route.transcribe(model, featurizer, examples, options)
        if on_text is not None and found["text"]:
            on_text("  " + found["text"][0])
        return found

    def parse_inputs(self, lines: Sequence[str], options: dict) -> list[dict]:
        paths = [line.strip() for line in lines if line.strip()]
        if not paths:
            raise UserError("apps predict speech needs at least one audio file (as arguments or on stdin).")
        return [{"id": None, "audio": None, "path": path, "text": "", "voice": None} for path in paths]

    def parse_request(
        self, inputs: Sequence[str], options: dict, limits: RequestLimits = RequestLimits()
    ) -> list[dict]:
        """Audio files' bytes in base64 (or as data URLs, "data:audio/wav;base64,..."), decoded in
        memory: a server never opens a path a request names. A file longer than the server's
        limit is refused from its header, before it is decoded."""
        examples = []
        for number, text in enumerate(inputs, 1):
            where = f"input {number}"
            try:
                data = base64.b64decode(text.split(",", 1)[1] if text.startswith("data:") else text, validate=True)
            except (ValueError, IndexError):
                raise UserError(f"{where}: not base64; send each audio file's bytes base64-encoded.") from None
            samples = audio.decode_audio(data, where, silence_allowed=True, max_seconds=limits.audio_seconds)
            examples.append({"id": None, "audio": samples, "path": where, "where": where, "text": "", "voice": None})
        return examples

    def render(self, predictions, examples, featurizer) -> list[dict[str, Any]]:
        """A row per file: its transcript and, from Whisper with timestamps, its language and
        segments ({"start", "end", "text"}, seconds into the file)."""
        timed = [
            {k: predictions[k][i] for k in ("language", "language_probability", "segments") if k in predictions}
            for i in range(len(examples))
        ]
        return [
            {"file": e["path"], "transcript": text, **more}
            for e, text, more in zip(examples, predictions["text"], timed)
        ]


def voice_groups(example: dict) -> tuple[str, ...]:
    """The groups an example's scores are also reported by: its variant when that is a held-out
    one, and its accent, held out (`en-029`) or seen (`seen-accents`). User data has none."""
    voice = example.get("voice")
    if not voice:
        return ()
    accent, _, variant = voice.partition("+")
    accent_group = accent if accent == corpus.ACCENT_HELD_OUT else "seen-accents"
    return (f"variant-{variant}", accent_group) if variant in corpus.VARIANTS_HELD_OUT else (accent_group,)
