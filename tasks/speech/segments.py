"""Whisper's transcripts with times: segments read from its timestamp tokens, over audio of any length.

A window decoded with timestamps (`core.generation.timestamps`) reads `<|0.00|> Hello
there.<|1.52|><|1.52|> How are you?<|3.10|>`: each segment's text lies between two timestamp
tokens, 20 ms a step after the window's start (`split`). Long audio is read as Whisper's own
transcribe() reads it (`transcribe`): a window of 30 s from `seek`, then the next window from the
end of the last complete segment, so that a sentence cut by the window's end is decoded whole in
the next; a window that ends on a lone timestamp (its last segment closed, nothing begun) was
read to its end. Each file's windows run one after another, the files' windows side by side in
one batch. `batched` instead cuts the audio into windows at quiet moments first
(`tasks.speech.windows.cut_windows`) and decodes all of them at once, as faster-whisper's
`BatchedInferencePipeline` does: faster on long audio, with segments that cannot cross a cut.
With `vad`, only the stretches of speech are decoded, joined (`tasks.speech.vad`), and the times
found are put back on the recording's clock; `batched` with `vad` cuts where stretches meet, as
faster-whisper's pipeline cuts at its voice-activity chunks.

A window that holds no speech (`tasks.speech.windows.silent`) gives no segment; the
temperature fallback runs per window, as without timestamps (`tasks.speech.windows.decode_windows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from core.generation import abandon
from core.generation.timestamps import PRECISION, Timestamps
from tasks.speech import audio
from tasks.speech import vad as vad_lib
from tasks.speech import words as word_times
from tasks.speech.featurizer import clip
from tasks.speech.windows import Decoding, cut_windows, decode_windows, silent

if TYPE_CHECKING:
    from tasks.speech.whisper import WhisperFeaturizer

# {"start": seconds, "end": seconds, "text": ...}: times in the whole audio, the text as Whisper
# writes it (English words after a space: the segments' texts joined are the transcript).
Segment = dict[str, Any]
FRAME = audio.HOP / audio.SAMPLE_RATE  # seconds a frame of features: 10 ms


def split(tokens: Sequence[int], featurizer: WhisperFeaturizer, offset: float, duration: float):
    """A window's `tokens` (up to its end token) as segments, at `offset` seconds into the audio,
    and the seconds of the window read (`duration`, the window's audio, unless its last
    segment is incomplete: up to the last complete one's end). Segments without text are left out."""
    begin = featurizer.vocabulary.timestamp_begin
    timed = [token >= begin for token in tokens]
    alone = ends_alone(tokens, begin)
    cuts = [i for i in range(1, len(tokens)) if timed[i - 1] and timed[i]]
    pieces, read = [], duration
    if cuts:
        bounds = [0, *cuts, *([len(tokens)] if alone else [])]
        pieces = [tokens[a:b] for a, b in zip(bounds, bounds[1:])]
        times = [((piece[0] - begin) * PRECISION, (piece[-1] - begin) * PRECISION) for piece in pieces]
        if not alone:
            read = (tokens[bounds[-1] - 1] - begin) * PRECISION
    else:  # one segment: from the window's start to its last timestamp (the window's end if none)
        last = max((t for t in tokens if t >= begin), default=begin)
        pieces, times = [list(tokens)], [(0.0, (last - begin) * PRECISION if last > begin else duration)]
    segments = []
    for piece, (start, end) in zip(pieces, times):
        end = min(end, duration)  # a last timestamp past the audio, in a window padded after the recording's end
        # As Whisper writes it, its leading space kept: the segments' texts joined are the transcript.
        words = [t for t in piece if t < featurizer.vocabulary.end]
        text = featurizer.tokenizer.decode(words)
        if text.strip():
            segments.append(
                {"start": round(offset + start, 3), "end": round(offset + end, 3), "text": text, "tokens": words}
            )
    return segments, read


def ends_alone(tokens: Sequence[int], begin: int) -> bool:
    """Whether a window's tokens end on a lone timestamp: its last segment closed, none begun."""
    return len(tokens) >= 2 and tokens[-2] < begin <= tokens[-1]


def transcribe(
    model,
    featurizer: WhisperFeaturizer,
    examples: Sequence[dict],
    decoding: Decoding,
    batched: bool = False,
    words: bool = False,
    vad: bool = False,
) -> list[list[Segment]]:
    """Each example's segments, its windows read one after another from the last complete
    segment's end, or, `batched`, cut first and decoded at once (see the module's text); with
    `words`, each segment's words with their times (`tasks.speech.words`), and the next window
    from the last word's end, as Whisper's transcribe() goes on with word timestamps; with
    `vad`, only the stretches of speech decoded (`tasks.speech.vad`), the times the recording's."""
    decoding = decoding._replace(
        timestamps=Timestamps(begin=featurizer.vocabulary.timestamp_begin, end=featurizer.vocabulary.end)
    )
    clips = [clip(example, silence_allowed=True) for example in examples]
    settings = vad_lib.BATCHED if batched else vad_lib.Settings()
    kept = [vad_lib.Kept.of(samples, settings) for samples in clips] if vad else []
    clips = [k.joined(samples) for k, samples in zip(kept, clips)] if vad else clips
    lengths = [len(samples) // audio.HOP for samples in clips]  # in 10 ms frames
    width = featurizer.window_frames
    found: list[list[Segment]] = [[] for _ in clips]
    last_speech = [0.0] * len(clips)  # each recording's, for the words' corrections

    def decoded(windows: list[tuple[int, int, int]]):  # (example, first frame, frames)
        abandon.check()  # a served request that gave up stops at its next round of windows
        hop = audio.HOP
        frames = [featurizer.frames(clips[i][first * hop : (first + size) * hop]) for i, first, size in windows]
        results = decode_windows(model, featurizer, frames, decoding, [first == 0 for _, first, _ in windows])
        spoken = [
            not silent(r, clips[i][first * hop : (first + size) * hop]) for r, (i, first, size) in zip(results, windows)
        ]
        split_up = [
            split(r.tokens, featurizer, w[1] * FRAME, w[2] * FRAME) if s else ([], 0.0)
            for r, w, s in zip(results, windows, spoken)
        ]
        if words:
            _words(model, featurizer, frames, windows, [segments for segments, _ in split_up], last_speech)
        for (i, first, size), result, (segments, read) in zip(windows, results, split_up):
            found[i] += segments
            if words and segments and not ends_alone(result.tokens, decoding.timestamps.begin):
                ended = max((w["end"] for s in segments for w in s["words"]), default=0.0) - first * FRAME
                read = ended if ended > 0 else read
            yield i, (min(size, round(read / FRAME)) or size) if segments else size

    if batched:
        for _ in decoded(_cut(clips, kept, width * audio.HOP)):
            pass
    else:
        seeks = [0] * len(clips)  # each recording's next window, in frames
        while active := [i for i in range(len(clips)) if seeks[i] < lengths[i]]:
            for i, read in decoded([(i, seeks[i], min(width, lengths[i] - seeks[i])) for i in active]):
                seeks[i] += read
    return [[restored(s, k) for s in segments] for segments, k in zip(found, kept)] if vad else found


def _cut(clips: list[np.ndarray], kept: list[vad_lib.Kept], window: int) -> list[tuple[int, int, int]]:
    """The windows of `batched` decoding (recording, first frame, frames): cut at quiet moments,
    or with `kept` stretches of speech where they meet."""
    cuts = [
        (i, cut)
        for i, samples in enumerate(clips)
        for cut in (kept[i].windows(samples, window) if kept else cut_windows(samples, window))
    ]
    windows = [(i, cut.start // audio.HOP, (cut.stop - cut.start) // audio.HOP) for i, cut in cuts]
    return [w for w in windows if w[2] > 0]


def restored(segment: Segment, kept: vad_lib.Kept) -> Segment:
    """A segment found in a recording's joined stretches of speech, on the recording's clock."""
    times = {"start": kept.original(segment["start"]), "end": kept.original(segment["end"], end=True)}
    if "words" in segment:
        times["words"] = [
            {**w, "start": kept.original(w["start"]), "end": kept.original(w["end"], end=True)}
            for w in segment["words"]
        ]
    return segment | times


def _words(model, featurizer, frames, windows, found: list[list[Segment]], last_speech: list[float]) -> None:
    """Aligns the words of each window (`(recording, first frame, frames)`) that found segments
    and deals them to those segments (`tasks.speech.words`)."""
    aligned = [k for k, segments in enumerate(found) if segments]
    texts = [[t for s in found[k] for t in s["tokens"]] for k in aligned]
    timed = word_times.align(model, featurizer, [frames[k] for k in aligned], texts, [windows[k][2] for k in aligned])
    for k, window_words in zip(aligned, timed):
        i, first, _ = windows[k]
        last_speech[i] = word_times.place(window_words, found[k], first * FRAME, last_speech[i])


def shown(segment: Segment) -> Segment:
    """A segment as a row holds it: its text without Whisper's leading space, its words (if
    aligned) without theirs, no tokens."""
    kept = {key: value for key, value in segment.items() if key != "tokens"} | {"text": segment["text"].strip()}
    if "words" in kept:
        kept["words"] = [{**w, "word": w["word"].strip()} for w in kept["words"]]
    return kept
