"""Whisper's transcripts with times: segments read from its timestamp tokens, over audio of any length.

A window decoded with timestamps (`core.generation.timestamps`) reads `<|0.00|> Hello
there.<|1.52|><|1.52|> How are you?<|3.10|>`: each segment's text lies between two timestamp
tokens, 20 ms a step after the window's start (`split`). Long audio is read as Whisper's own
transcribe() reads it (`transcribe`): a window of 30 s from `seek`, then the next window from the
end of the last complete segment, so that a sentence cut by the window's end is decoded whole in
the next; a window that ends on a lone timestamp (its last segment closed, nothing begun) was
read to its end. Each file's windows run one after another, the files' windows side by side in
one batch. `batched` instead cuts the audio into windows at quiet moments first
(`tasks.speech.whisper.cut_windows`) and decodes all of them at once, as faster-whisper's
`BatchedInferencePipeline` does with its voice-activity chunks: faster on long audio, with
segments that cannot cross a cut.

A window whose no-speech probability passes the threshold gives no segment; the temperature
fallback runs per window, as without timestamps (`tasks.speech.whisper.decode_windows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from core.generation.timestamps import PRECISION, Timestamps
from core.model.encoder_decoder import Start
from tasks.speech import audio
from tasks.speech.featurizer import clip
from tasks.speech.whisper import NO_SPEECH_THRESHOLD, cut_windows, decode_windows

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
    ends_alone = timed[-2:] == [False, True]
    cuts = [i for i in range(1, len(tokens)) if timed[i - 1] and timed[i]]
    pieces, read = [], duration
    if cuts:
        bounds = [0, *cuts, *([len(tokens)] if ends_alone else [])]
        pieces = [tokens[a:b] for a, b in zip(bounds, bounds[1:])]
        times = [((piece[0] - begin) * PRECISION, (piece[-1] - begin) * PRECISION) for piece in pieces]
        if not ends_alone:
            read = (tokens[bounds[-1] - 1] - begin) * PRECISION
    else:  # one segment: from the window's start to its last timestamp (the window's end if none)
        last = max((t for t in tokens if t >= begin), default=begin)
        pieces, times = [list(tokens)], [(0.0, (last - begin) * PRECISION if last > begin else duration)]
    segments = []
    for piece, (start, end) in zip(pieces, times):
        end = min(end, duration)  # a last timestamp past the audio, in a window padded after the recording's end
        # As Whisper writes it, its leading space kept: the segments' texts joined are the transcript.
        text = featurizer.tokenizer.decode([t for t in piece if t < featurizer.vocabulary.end])
        if text.strip():
            segments.append({"start": round(offset + start, 3), "end": round(offset + end, 3), "text": text})
    return segments, read


def transcribe(
    model,
    featurizer: WhisperFeaturizer,
    examples: Sequence[dict],
    start: Start,
    beam_width: int,
    batch_size: int,
    fallback: bool = True,
    batched: bool = False,
    temperature: float = 0.0,
) -> list[list[Segment]]:
    """Each example's segments, its windows read one after another from the last complete
    segment's end, or, `batched`, cut first and decoded at once (see the module's text)."""
    timestamps = Timestamps(begin=featurizer.vocabulary.timestamp_begin, end=featurizer.vocabulary.end)
    clips = [clip(example, silence_allowed=True) for example in examples]
    lengths = [len(samples) // audio.HOP for samples in clips]  # in 10 ms frames
    width = featurizer.window_frames
    found: list[list[Segment]] = [[] for _ in clips]

    def decoded(windows: list[tuple[int, int, int]]):  # (example, first frame, frames)
        hop = audio.HOP
        frames = [featurizer.frames(clips[i][first * hop : (first + size) * hop]) for i, first, size in windows]
        results = decode_windows(
            model, featurizer, frames, start, beam_width, batch_size, fallback, timestamps, temperature
        )
        for (i, first, size), result in zip(windows, results):
            if result.no_speech > NO_SPEECH_THRESHOLD:
                yield i, size
                continue
            segments, read = split(result.tokens, featurizer, first * FRAME, size * FRAME)
            found[i] += segments
            yield i, min(size, round(read / FRAME)) or size

    if batched:
        cuts = [(i, cut) for i, samples in enumerate(clips) for cut in cut_windows(samples, width * audio.HOP)]
        windows = [(i, cut.start // audio.HOP, (cut.stop - cut.start) // audio.HOP) for i, cut in cuts]
        for _ in decoded([w for w in windows if w[2] > 0]):
            pass
        return found
    seeks = [0] * len(clips)  # each recording's next window, in frames
    while active := [i for i in range(len(clips)) if seeks[i] < lengths[i]]:
        for i, read in decoded([(i, seeks[i], min(width, lengths[i] - seeks[i])) for i in active]):
            seeks[i] += read
    return found
