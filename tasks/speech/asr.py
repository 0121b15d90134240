"""Speech recognition on log-mel spectrograms: a Transformer encoder trained with CTC.

The model is the core's default composition with a speech front end: 80-bin log-mel frames
(tasks/speech/audio.py) -> `core.model.frontends.ConvSubsampling` (4x fewer positions, 40 ms each) ->
the encoder stack (rotary positions) -> a linear CTC head over characters, blank id 0 ->
`core.training.losses.ctc_loss`. Decoding is greedy on device during training and validation, and
greedy or CTC prefix beam search (`core.generation.ctc`) in `apps eval` and `apps predict`.

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
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.checkpoints import pretrained
from core.checkpoints import whisper as core_whisper
from core.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, require, tiny_body, tiny_preset
from core.errors import UserError
from core.generation import ctc
from core.model.frontends import ConvSubsampling
from core.model.heads import Projection
from core.run import Predictor
from core.task import PredictOption, Task, final, scored_positions
from core.training import losses
from core.training.data import decoding_batches
from tasks.speech import audio, corpus
from tasks.speech.featurizer import SpeechFeaturizer, fit_featurizer
from tasks.speech.scoring import NORMALIZATION, grouped_error_rates
from tasks.speech.whisper import WhisperFeaturizer, transcribe


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
    # Whisper (tasks/speech/whisper.py): the language of the speech and the task of the prompt
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


class CTCOutputs(NamedTuple):
    """Per-position logits [B, T', V] (float32) and the front end's mask [B, T']."""

    logits: jax.Array
    mask: jax.Array


class CTCHead(nnx.Module):
    def __init__(self, d_model: int, vocab_size: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(d_model, vocab_size, rngs=rngs)

    def __call__(self, hidden: jax.Array, mask: jax.Array) -> CTCOutputs:
        return CTCOutputs(self.linear(hidden).astype(jnp.float32), mask)


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
        PredictOption(
            "language", str, "", "Whisper: the language spoken, as a code (de, fr, ...; default data.language)"
        ),
        PredictOption("task", str, "", "Whisper: transcribe, or translate into English (default data.whisper_task)"),
    )
    # A Whisper checkpoint transcribes as it is (apps predict speech --model whisper-tiny.en),
    # in Whisper's own 30 s windows (the fine-tuning presets' 10 s would cut long audio finer).
    zero_shot: ClassVar[bool] = True
    zero_shot_overrides: ClassVar[tuple[str, ...]] = ("data.max_seconds=30.0",)

    config: Config
    data: str | None = None

    def __post_init__(self):
        smoothing = self.config.optim.label_smoothing
        if not self.whisper:
            require(
                smoothing == 0, "optim.label_smoothing", smoothing, "must be 0: the CTC loss has no label smoothing"
            )

    @property
    def whisper(self) -> bool:
        """Whether the model is Whisper's encoder-decoder (tasks/speech/whisper.py): a Whisper
        checkpoint's architecture, or one built in its shape (`model.decoder_layers` set),
        rather than the CTC encoder."""
        return self.config.model.decoder_layers is not None

    @property
    def validation_decoding(self) -> dict[str, Any] | None:
        """Whisper's validation WER is of greedy transcripts (without the temperature fallback,
        which would cost a looping early checkpoint five samples per window and temperature);
        CTC's comes from `score`."""
        return {"beam_width": 1, "fallback": False} if self.whisper else None

    @property
    def evaluated_decodings(self) -> dict[str, dict[str, Any]]:
        """CTC scores its greedy paths on the device (`score`); Whisper generates both."""
        if self.whisper:
            return {"greedy": {"beam_width": 1}, "beam": {"beam_width": 5}}
        return {"beam": {"beam_width": 8}}

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
        if self.whisper:
            checkpoint = self.config.model.pretrained or self.config.data.whisper_tokenizer
            return WhisperFeaturizer.from_checkpoint(checkpoint, self.config.data)
        return fit_featurizer(train, self.config.data)

    def load_featurizer(self, directory: Path) -> SpeechFeaturizer | WhisperFeaturizer:
        if self.whisper:
            return self.fit_featurizer([])
        return SpeechFeaturizer.load(directory, self.config.data)

    def model(self, featurizer, config: Config, rngs: nnx.Rngs) -> nnx.Module:
        if self.whisper:
            vocab_size = pretrained.read_checkpoint(featurizer.checkpoint).vocab_size
            return core_whisper.build(config.model, featurizer.mel_bins, vocab_size, rngs)
        return super().model(featurizer, config, rngs)

    def embedder(self, featurizer: SpeechFeaturizer, rngs: nnx.Rngs) -> nnx.Module:
        options = self.config.data
        return ConvSubsampling(
            featurizer.num_mels,
            self.config.model.d_model,
            channels=options.conv_channels,
            layers=options.subsampling_layers,
            rngs=rngs,
        )

    def head(self, featurizer: SpeechFeaturizer, embedder: nnx.Module, rngs: nnx.Rngs) -> nnx.Module:
        return CTCHead(self.config.model.d_model, featurizer.vocab_size, rngs=rngs)

    def loss(self, outputs: CTCOutputs | Projection, batch: dict):
        if self.whisper:
            smoothing = self.config.optim.label_smoothing
            return losses.linear_cross_entropy(
                outputs.hidden, outputs.weight, batch["targets"], scored_positions(batch), smoothing
            )
        return losses.ctc_loss(outputs.logits, outputs.mask, batch["targets"], batch["target_mask"], batch["weights"])

    def metrics(self, outputs: CTCOutputs | Projection, batch: dict):
        if self.whisper:
            return {
                "nll": losses.linear_cross_entropy(
                    outputs.hidden, outputs.weight, batch["targets"], scored_positions(batch)
                )
            }
        total, _ = self.loss(outputs, batch)
        labels = (batch["target_mask"].sum(-1) * batch["weights"]).sum()
        return {"loss_per_label": (total, labels.astype(jnp.float32))}

    def decode(self, outputs: CTCOutputs | Projection, batch: dict) -> dict[str, jax.Array]:
        if self.whisper:
            return {}  # transcripts are generated (`generate`), not read off the teacher-forced pass
        # The best path's ids; merged and stripped of blanks on the host (`score`).
        return {"path": outputs.logits.argmax(-1).astype(jnp.int32), "length": outputs.mask.sum(-1)}

    def score(self, predictions, examples: Sequence[dict], featurizer: SpeechFeaturizer) -> dict[str, float]:
        if self.whisper:
            return {}
        texts = [
            featurizer.decode(ctc.collapse(path[:length]))
            for path, length in zip(predictions["path"], predictions["length"])
        ]
        return self.score_generated({"text": texts}, examples, featurizer)

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

    def generate(self, model, featurizer: SpeechFeaturizer, examples, options: dict, on_text=None) -> dict:
        """Transcripts of the examples: greedy (`beam_width` 1) or CTC prefix beam search over
        the model's log-probabilities. Clips go in batches of similar lengths, padded to a
        `core.training.data.bucket_width` of frames (few compiled shapes)."""
        width = options["beam_width"]
        if width < 1:
            raise UserError(f"--beam-width {width}: must be at least 1 (1 is greedy).")
        if not self.whisper and (options["language"] or options["task"]):
            raise UserError("--language and --task choose Whisper's prompt; a CTC model reads one language only.")
        if self.whisper:
            prompt = featurizer.decoding(options["language"], options["task"])
            batch_size, fallback = self.config.train.eval_batch_size, options.get("fallback", True)
            texts, _ = transcribe(model, featurizer, examples, prompt, width, batch_size, fallback)
            if on_text is not None and texts:
                on_text("  " + texts[0])
            return {"text": texts}
        arrays = featurizer(examples)
        graphdef, state = nnx.split(model)
        forward = _forward(graphdef)
        texts = [""] * len(examples)
        lengths, batch_size = arrays["mask"].sum(1), self.config.train.eval_batch_size
        for rows, padded, frames in decoding_batches(lengths, batch_size, arrays["mask"].shape[1]):
            batch = {key: arrays[key][padded, :frames] for key in ("inputs", "mask")}
            log_probs, kept = jax.device_get(forward(state, batch))
            for i, row in enumerate(rows):
                frame_log_probs = log_probs[i, : kept[i]]
                if width == 1:
                    ids = ctc.greedy(frame_log_probs)
                else:
                    ids = ctc.prefix_beam_search(frame_log_probs, width)
                texts[row] = featurizer.decode(ids)
        if on_text is not None and texts:
            on_text("  " + texts[0])
        return {"text": texts}

    def parse_inputs(self, lines: Sequence[str], options: dict) -> list[dict]:
        paths = [line.strip() for line in lines if line.strip()]
        if not paths:
            raise UserError("apps predict speech needs at least one audio file (as arguments or on stdin).")
        return [{"id": None, "audio": None, "path": path, "text": "", "voice": None} for path in paths]

    def parse_request(self, inputs: Sequence[str], options: dict) -> list[dict]:
        """Audio files' bytes in base64 (or as data URLs, "data:audio/wav;base64,..."), decoded in
        memory: a server never opens a path a request names."""
        examples = []
        for number, text in enumerate(inputs, 1):
            where = f"input {number}"
            try:
                data = base64.b64decode(text.split(",", 1)[1] if text.startswith("data:") else text, validate=True)
            except (ValueError, IndexError):
                raise UserError(f"{where}: not base64; send each audio file's bytes base64-encoded.") from None
            samples = audio.decode_audio(data, where, silence_allowed=True)
            examples.append({"id": None, "audio": samples, "path": where, "where": where, "text": "", "voice": None})
        return examples

    def render(self, predictions, examples, featurizer) -> list[dict[str, Any]]:
        return [{"file": e["path"], "transcript": text} for e, text in zip(examples, predictions["text"])]


def voice_groups(example: dict) -> tuple[str, ...]:
    """The groups an example's scores are also reported by: its variant when that is a held-out
    one, and its accent, held out (`en-029`) or seen (`seen-accents`). User data has none."""
    voice = example.get("voice")
    if not voice:
        return ()
    accent, _, variant = voice.partition("+")
    accent_group = accent if accent == corpus.ACCENT_HELD_OUT else "seen-accents"
    return (f"variant-{variant}", accent_group) if variant in corpus.VARIANTS_HELD_OUT else (accent_group,)


@functools.cache
def _forward(graphdef):
    """A jitted forward to per-frame log-probabilities and kept lengths, per model graph."""

    @jax.jit
    def forward(state, batch):
        outputs = nnx.merge(graphdef, state)(batch)
        return jax.nn.log_softmax(outputs.logits), outputs.mask.sum(-1)

    return forward


def as_float_samples(samples) -> np.ndarray:
    """Samples as float32 in [-1, 1]: integer PCM is divided by its type's full scale."""
    samples = np.asarray(samples)
    if np.issubdtype(samples.dtype, np.integer):
        return (samples / (np.iinfo(samples.dtype).max + 1)).astype(np.float32)
    return samples.astype(np.float32)


class Transcriber(Predictor):
    """A trained speech workdir, or a Whisper checkpoint as it is, loaded once, for Python
    prototypes:

    from tasks.speech.asr import Transcriber
    Transcriber("runs/speech").transcribe(["a.wav", "b.flac"], beam_width=8)  # [transcript]
    Transcriber(model="whisper-tiny.en").transcribe([samples_16khz, "c.wav"], beam_width=1)
    Transcriber(model="whisper-base", dtype="bfloat16")  # its linear layers' weights in bfloat16
    """

    def __init__(self, workdir: str | Path | None = None, *, model: str | None = None, dtype: str = "float32"):
        super().__init__(SpeechTask, workdir, model=model, dtype=dtype)

    def transcribe(self, clips: Sequence[str | Path | np.ndarray], beam_width: int = 8) -> list[str]:
        """The transcript of each clip: an audio file, or samples at 16 kHz: floats in [-1, 1],
        or integer PCM (int16 as WAV files hold it), scaled to [-1, 1]."""
        examples = [
            {"id": None, "audio": None, "path": str(c), "text": "", "voice": None}
            if isinstance(c, (str, Path))
            else {"id": None, "audio": as_float_samples(c), "where": f"clip {i}", "text": "", "voice": None}
            for i, c in enumerate(clips, 1)
        ]
        options = self.options({"beam_width": beam_width})
        return self.task.generate(self.model, self.featurizer, examples, options)["text"]
