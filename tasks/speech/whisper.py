"""Whisper in the speech task: its featurizer, windows over long audio, transcription, and the
task's route (`WhisperRoute`: the model, loss and decoding of a Whisper run).

The speech task takes this route when its model is an encoder-decoder (`model.decoder_layers`
set: a Whisper checkpoint's `model.pretrained`, which the config adopts, or a model built from
scratch in Whisper's shape). The encoder reads `tasks.speech.audio.whisper_log_mel` of a
window (the clip padded with silence) of `data.max_seconds`, at most 30 s: Whisper was trained
on 30 s windows, and reads them best zero-shot; a shorter window costs less in proportion (its
attention, with the square), which fine-tuning on short clips can afford to learn. The decoder
reads the prompt
(`core.checkpoints.whisper.Vocabulary.prompt`: start, language, task, no-timestamps) and then the
transcript's tokens, each predicted from those before; the loss counts the transcript's tokens
and its end.

Audio longer than one window is cut into windows, each cut placed at the quietest 100 ms of
the window's last 5 s (or last half, if shorter; so that a word is rarely split), covering every
sample once; the windows' transcripts are joined with a space. A window whose no-speech
probability (the `<|nospeech|>` token's, right after the start token) passes
`NO_SPEECH_THRESHOLD` gives no text, as Whisper does. A window whose text loops or that the
model doubts is decoded again at rising temperatures, as Whisper's transcribe() does (`transcribe`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np
from flax import nnx

from core.checkpoints import pretrained, whisper
from core.config import Config
from core.errors import UserError
from core.generation.beam import gnmt_penalty
from core.generation.seq2seq import generate_beams_from_source, generate_from_source
from core.generation.timestamps import Timestamps
from core.model.encoder_decoder import Start
from core.model.heads import Projection
from core.task import scored_positions
from core.training import losses
from tasks.common.tokenizer import PretrainedTokenizer
from tasks.speech import audio as audio_lib
from tasks.speech.featurizer import clip, describe

if TYPE_CHECKING:
    from tasks.speech.asr import SpeechTask

WINDOW_SAMPLES = audio_lib.WHISPER_FRAMES * audio_lib.HOP  # 30 s, as Whisper was trained
SEARCH_SAMPLES = 5 * audio_lib.SAMPLE_RATE  # where a window's cut is looked for: its last 5 s
QUIET_SAMPLES = audio_lib.SAMPLE_RATE // 10  # the stretch whose energy a cut minimizes: 100 ms
NO_SPEECH_THRESHOLD = 0.6  # Whisper's own, as are the fallback's settings below
FALLBACK_TEMPERATURES = (0.2, 0.4, 0.6, 0.8, 1.0)
BEST_OF = 5
COMPRESSION_RATIO_THRESHOLD = 2.4
LOG_PROB_THRESHOLD = -1.0
# Whisper's decoder holds 448 positions and its transcribe() writes at most half of them.
MAX_NEW_TOKENS = 224


def cut_windows(samples: np.ndarray, window: int = WINDOW_SAMPLES) -> list[slice]:
    """Windows of at most `window` samples covering every sample once; each cut but the last
    falls at the start of the quietest 100 ms within the window's last 5 s (or last half)."""
    search = min(SEARCH_SAMPLES, window // 2)
    cuts, start = [], 0
    while len(samples) - start > window:
        end = start + window
        region = samples[end - search : end].astype(np.float64) ** 2
        energy = np.convolve(region, np.ones(QUIET_SAMPLES), mode="valid")  # [search - QUIET + 1]
        cut = end - search + int(np.argmin(energy))
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

    def decoding(self, language: str = "", task: str = "", timestamps: bool = False) -> Start:
        """How a window's decoding starts (`Vocabulary.decoding`): in `language` and for `task`
        where given, else the featurizer's own (English for an English-only model), with
        timestamp tokens or without."""
        return self.vocabulary.decoding(language or self.language or "en", task or self.task, timestamps)

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


class Decoded(NamedTuple):
    """A window's decoding: its tokens up to the end token (timestamp tokens included), its
    text, the mean log-probability per token (the end included), its no-speech probability."""

    tokens: list[int]
    text: str
    log_prob: float
    no_speech: float


def transcribe(
    model,
    featurizer: WhisperFeaturizer,
    examples: Sequence[dict],
    start: Start,
    beam_width: int,
    batch_size: int,
    fallback: bool = True,
    temperature: float = 0.0,
):
    """Each example's transcript after the prompt `start` (`Vocabulary.decoding`: language and
    task), its windows (`cut_windows`) decoded as one batch (`decode_windows`), and, per
    example, the windows' no-speech probabilities."""
    pieces = []  # (example index, frames)
    for index, example in enumerate(examples):
        samples = clip(example, silence_allowed=True)  # Whisper says itself that a window holds no speech
        windows = cut_windows(samples, featurizer.window_samples)
        pieces += [(index, featurizer.frames(samples[window])) for window in windows]
    frames = [f for _, f in pieces]
    decoded = decode_windows(model, featurizer, frames, start, beam_width, batch_size, fallback, None, temperature)
    texts: list[list[str]] = [[] for _ in examples]
    no_speech: list[list[float]] = [[] for _ in examples]
    for (index, _), window in zip(pieces, decoded):
        no_speech[index].append(window.no_speech)
        if window.no_speech <= NO_SPEECH_THRESHOLD and window.text:
            texts[index].append(window.text)
    return [" ".join(parts) for parts in texts], no_speech


def decode_windows(
    model,
    featurizer: WhisperFeaturizer,
    frames: list[np.ndarray],
    start: Start,
    beam_width: int,
    batch_size: int,
    fallback: bool = True,
    timestamps: Timestamps | None = None,
    temperature: float = 0.0,
) -> list[Decoded]:
    """Each window's decoding after the prompt `start`, greedy with `beam_width` 1, else beam
    search as Whisper's (the first W ended beams, by log-probability over length), or sampled
    at `temperature` above 0, with Whisper's timestamp rules where `timestamps` are given.

    With `fallback`, as Whisper's transcribe(): a window whose text repeats itself (its gzip
    compression ratio above 2.4: greedy decoding caught in a loop) or whose tokens the model
    doubts (mean log-probability below -1) is decoded again by sampling at rising temperatures,
    0.2 to 1.0, the likeliest of 5 samples each, until one passes (or the last is kept). A
    window that holds no speech is not decoded again: it gives no text."""
    width = beam_width if temperature == 0 else 1
    decoded = _decode(
        model, featurizer, frames, start, batch_size, beam_width=width, temperature=temperature, timestamps=timestamps
    )
    retry = [i for i, window in enumerate(decoded) if window.no_speech <= NO_SPEECH_THRESHOLD] if fallback else []
    hotter = [t for t in FALLBACK_TEMPERATURES if t > temperature]
    for step, warmer in enumerate(hotter):
        retry = [i for i in retry if doubtful(decoded[i].text, decoded[i].log_prob)]
        if not retry:
            break
        again = [frames[i] for i in retry for _ in range(BEST_OF)]
        samples = _decode(
            model, featurizer, again, start, batch_size, temperature=warmer, seed=step, timestamps=timestamps
        )
        for n, i in enumerate(retry):
            best = max(samples[n * BEST_OF : (n + 1) * BEST_OF], key=lambda sample: sample.log_prob)
            decoded[i] = best._replace(no_speech=decoded[i].no_speech)
    return decoded


def doubtful(text: str, mean_log_prob: float) -> bool:
    """Whisper's test for decoding a window again: a text that repeats itself (compresses by
    more than 2.4 under gzip), or a mean log-probability per token below -1."""
    data = text.encode()
    return (bool(data) and len(data) / len(zlib.compress(data)) > COMPRESSION_RATIO_THRESHOLD) or (
        mean_log_prob < LOG_PROB_THRESHOLD
    )


def _decode(
    model,
    featurizer,
    frames: list,
    start: Start,
    batch_size: int,
    *,
    beam_width: int = 1,
    temperature=0.0,
    seed=0,
    timestamps: Timestamps | None = None,
) -> list[Decoded]:
    """Each window's frames decoded, in batches: beam search, or sampling (greedy at
    temperature 0), with the timestamp rules where given."""
    end = featurizer.vocabulary.end
    settings = {"max_new_tokens": MAX_NEW_TOKENS, "start": start, "stop_tokens": [end], "timestamps": timestamps}
    decoded = []
    for first in range(0, len(frames), batch_size):
        chunk = frames[first : first + batch_size]
        if beam_width > 1:
            beams = generate_beams_from_source(
                model, chunk, beam_size=beam_width, length_penalty=1.0, early_stopping=True, **settings
            )
            tokens, lengths, probe = beams.tokens[:, 0], beams.lengths[:, 0], beams.probe
            # A beam's score is its log-probability over the length penalty (core.generation.beam).
            log_probs = beams.scores[:, 0] * gnmt_penalty(lengths, 1.0)
        else:
            generated = generate_from_source(model, chunk, temperature=temperature, seed=seed, **settings)
            tokens, lengths, log_probs, probe = generated
        for ids, length, log_prob, p in zip(tokens, lengths, log_probs, probe):
            ended = bool(length > 0 and ids[length - 1] == end)
            kept = [int(i) for i in ids[: int(length) - ended]]
            # Whisper's mean counts the text's tokens and one for the end, reached or not.
            decoded.append(Decoded(kept, featurizer.decode(kept), float(log_prob) / (len(kept) + 1), float(p)))
    return decoded


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

        timed, temperature = options.get("timestamps", False), options.get("temperature", 0.0)
        prompt = featurizer.decoding(language, options["task"], timed)
        batch_size, fallback, width = (
            self.task.config.train.eval_batch_size,
            options.get("fallback", True),
            options["beam_width"],
        )
        if not timed:
            found = transcribe(model, featurizer, examples, prompt, width, batch_size, fallback, temperature)
            return {"text": found[0]}
        batched = options.get("batched", False)
        found = segments.transcribe(
            model, featurizer, examples, prompt, width, batch_size, fallback, batched, temperature
        )
        return {
            "text": ["".join(s["text"] for s in timed).strip() for timed in found],
            "segments": [[{**s, "text": s["text"].strip()} for s in timed] for timed in found],
        }
