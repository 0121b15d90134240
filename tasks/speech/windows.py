"""Whisper's windows: long audio cut into them, each decoded with Whisper's fallback and its rule for silence.

Audio longer than one window is cut into windows (`cut_windows`), each cut placed at the
quietest 100 ms of the window's last 5 s (or last half, if shorter; so that a word is rarely
split), covering every sample once; the windows' transcripts are joined with a space
(`transcribe`, the text-only decoding of evaluation). A window holds no speech (`silent`) when
its no-speech probability (the `<|nospeech|>` token's, right after the start token) passes
`NO_SPEECH_THRESHOLD` and either the model doubts its words, as Whisper's own rule has it, or
its audio is near silence. A window whose text loops or that the model doubts is decoded again
at rising temperatures, as Whisper's transcribe() does (`decode_windows`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from core.generation.beam import gnmt_penalty
from core.generation.seq2seq import generate_beams_from_source, generate_from_source, previous_room
from core.generation.timestamps import Timestamps
from core.model.encoder_decoder import Start
from tasks.speech import audio as audio_lib
from tasks.speech.featurizer import clip

if TYPE_CHECKING:
    from tasks.speech.whisper import WhisperFeaturizer

WINDOW_SAMPLES = audio_lib.WHISPER_FRAMES * audio_lib.HOP  # 30 s, as Whisper was trained
SEARCH_SAMPLES = 5 * audio_lib.SAMPLE_RATE  # where a window's cut is looked for: its last 5 s
QUIET_SAMPLES = audio_lib.SAMPLE_RATE // 10  # the stretch whose energy a cut minimizes: 100 ms
NO_SPEECH_THRESHOLD = 0.6  # Whisper's own, as are the fallback's settings below
FALLBACK_TEMPERATURES = (0.2, 0.4, 0.6, 0.8, 1.0)
BEST_OF = 5
COMPRESSION_RATIO_THRESHOLD = 2.4
LOG_PROB_THRESHOLD = -1.0
QUIET_RMS = 10 ** (-50 / 20)  # a window's audio below -50 dBFS is near silence
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


class Decoded(NamedTuple):
    """A window's decoding: its tokens up to the end token (timestamp tokens included), its
    text, the mean log-probability per token (the end included), its no-speech probability."""

    tokens: list[int]
    text: str
    log_prob: float
    no_speech: float


class Decoding(NamedTuple):
    """How windows are decoded: after the prompt `start` (`Vocabulary.decoding`: language and
    task), `batch_size` at a time; greedy with `beam_width` 1, else beam search as Whisper's (the
    first W ended beams, by log-probability over length), or sampled at `temperature` above 0;
    with Whisper's temperature `fallback`; under its timestamp rules where `timestamps` are given;
    each recording's first window after the `previous` tokens, a prompt of earlier text
    (`WhisperFeaturizer.earlier`), as Whisper's `initial_prompt` (its later windows without:
    earlier windows' text is not carried on)."""

    start: Start
    beam_width: int
    batch_size: int
    fallback: bool = True
    temperature: float = 0.0
    timestamps: Timestamps | None = None
    previous: tuple[int, ...] = ()


def transcribe(model, featurizer: WhisperFeaturizer, examples: Sequence[dict], decoding: Decoding):
    """Each example's transcript, its windows (`cut_windows`) decoded as one batch
    (`decode_windows`), and, per example, the windows' no-speech probabilities."""
    pieces, firsts = [], []  # (example index, its window's samples); whether it is the example's first
    for index, example in enumerate(examples):
        samples = clip(example, silence_allowed=True)  # Whisper says itself that a window holds no speech
        windows = cut_windows(samples, featurizer.window_samples)
        pieces += [(index, samples[window]) for window in windows]
        firsts += [n == 0 for n in range(len(windows))]
    frames = [featurizer.frames(samples) for _, samples in pieces]
    decoded = decode_windows(model, featurizer, frames, decoding, firsts)
    texts: list[list[str]] = [[] for _ in examples]
    no_speech: list[list[float]] = [[] for _ in examples]
    for (index, samples), window in zip(pieces, decoded):
        no_speech[index].append(window.no_speech)
        if not silent(window, samples) and window.text:
            texts[index].append(window.text)
    return [" ".join(parts) for parts in texts], no_speech


def decode_windows(
    model, featurizer: WhisperFeaturizer, frames: list[np.ndarray], decoding: Decoding, firsts: Sequence[bool] = ()
) -> list[Decoded]:
    """Each window's decoding (`Decoding`; `firsts`: which windows begin their recording, and
    so follow `decoding.previous`).

    With `fallback`, as Whisper's transcribe(): a window whose text repeats itself (its gzip
    compression ratio above 2.4: greedy decoding caught in a loop) or whose tokens the model
    doubts (mean log-probability below -1) is decoded again by sampling at rising temperatures,
    0.2 to 1.0, the likeliest of 5 samples each, until one passes (or the last is kept). A
    window that holds no speech is not decoded again: it gives no text."""
    width = decoding.beam_width if decoding.temperature == 0 else 1
    previous = [decoding.previous if first else () for first in firsts] if firsts else [()] * len(frames)
    decoded = _decode(model, featurizer, frames, previous, decoding, beam_width=width, temperature=decoding.temperature)
    # A window the model finds empty and doubts is silence (Whisper's rule): not decoded again.
    retry = [
        i for i, w in enumerate(decoded) if not (w.no_speech > NO_SPEECH_THRESHOLD and w.log_prob < LOG_PROB_THRESHOLD)
    ]
    retry = retry if decoding.fallback else []
    hotter = [t for t in FALLBACK_TEMPERATURES if t > decoding.temperature]
    for step, warmer in enumerate(hotter):
        retry = [i for i in retry if doubtful(decoded[i].text, decoded[i].log_prob)]
        if not retry:
            break
        again = [(frames[i], previous[i]) for i in retry for _ in range(BEST_OF)]
        samples = _decode(model, featurizer, *map(list, zip(*again)), decoding, temperature=warmer, seed=step)
        for n, i in enumerate(retry):
            best = max(samples[n * BEST_OF : (n + 1) * BEST_OF], key=lambda sample: sample.log_prob)
            decoded[i] = best._replace(no_speech=decoded[i].no_speech)
    return decoded


def silent(window: Decoded, samples: np.ndarray) -> bool:
    """Whether a window holds no speech: its no-speech probability passes 0.6 and the model
    doubts its words (mean log-probability below -1), Whisper's own rule; or passes 0.6 over
    audio near silence (RMS below -50 dBFS), where Whisper writes "you" with confidence."""
    if window.no_speech <= NO_SPEECH_THRESHOLD:
        return False
    quiet = not len(samples) or float(np.sqrt(np.mean(np.square(samples, dtype=np.float64)))) < QUIET_RMS
    return window.log_prob < LOG_PROB_THRESHOLD or quiet


def doubtful(text: str, mean_log_prob: float) -> bool:
    """Whisper's test for decoding a window again: a text that repeats itself (compresses by
    more than 2.4 under gzip), or a mean log-probability per token below -1."""
    data = text.encode()
    return (bool(data) and len(data) / len(zlib.compress(data)) > COMPRESSION_RATIO_THRESHOLD) or (
        mean_log_prob < LOG_PROB_THRESHOLD
    )


def _decode(
    model, featurizer, frames: list, previous: list, decoding: Decoding, *, beam_width=1, temperature=0.0, seed=0
) -> list[Decoded]:
    """Each window's frames decoded after its `previous` tokens, `decoding.batch_size` at a
    time: beam search, or sampling (greedy at temperature 0), with the timestamp rules where given."""
    end = featurizer.vocabulary.end
    # Whisper keeps a prompt's latest tokens, as many as the decoder's positions leave beside
    # <|startofprev|>.
    room = previous_room(model, decoding.start, MAX_NEW_TOKENS) - 1
    previous = [tuple(p[:1]) + tuple(p[1:][-room:]) if p else () for p in previous]
    settings = {
        "max_new_tokens": MAX_NEW_TOKENS,
        "start": decoding.start,
        "stop_tokens": [end],
        "timestamps": decoding.timestamps,
    }
    decoded = []
    for first in range(0, len(frames), decoding.batch_size):
        chunk = frames[first : first + decoding.batch_size]
        settings["previous"] = previous[first : first + decoding.batch_size]
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
