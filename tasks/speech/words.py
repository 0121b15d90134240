"""Word timestamps: when each word of a Whisper transcript was said, from its cross-attention.

As Whisper's `find_alignment` and faster-whisper's do it, per window: the decoder reads the
window's text again (`core.generation.alignment`); the checkpoint's alignment heads' attention
over the first `frames // 2` encoder positions (those of the window's audio) is normalized over
the tokens, median-filtered (width 7) along the frames and averaged over the heads; dynamic time
warping over its negation pairs each token with frames; a word starts at the first frame of its
first token. Each word carries the mean probability of its tokens. Then Whisper's adjustments:
a word over twice the median length at a sentence's end is cut, punctuation joins its word,
words are dealt to their segments, and a segment's ends move to its words'.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from core.generation.alignment import cross_attention

if TYPE_CHECKING:
    from tasks.speech.whisper import WhisperFeaturizer

FILTER_WIDTH = 7
STEPS_PER_SECOND = 50  # encoder positions: 20 ms each
PREPENDED, APPENDED = "\"'“¿([{-", "\"'.。,，!！?？:：”)]}、"
SENTENCE_ENDS = ".。!！?？"


def align(model, featurizer: WhisperFeaturizer, frames: np.ndarray, texts: Sequence[list[int]], lengths: Sequence[int]):
    """Each window's words [{"word", "start", "end", "probability", "tokens"}] (seconds into
    the window) for its text tokens `texts` (timestamps dropped) and its audio's 10 ms frames."""
    vocabulary = featurizer.vocabulary
    prompt = [t for t in featurizer.decoding().prompt if t != vocabulary.no_timestamps]
    rows = [[*prompt, vocabulary.no_timestamps, *text, vocabulary.end] for text in texts]
    width = max(len(row) for row in rows)
    tokens = np.array([row + [vocabulary.end] * (width - len(row)) for row in rows])
    weights, probabilities = cross_attention(model, list(frames), tokens, featurizer.alignment_heads, vocabulary.end)
    found = []
    for row, text, length, w, p in zip(rows, texts, lengths, weights, probabilities):
        if len(text) < 1:
            found.append([])
            continue
        matrix = _matrix(w[:, : len(row), : length // 2], len(prompt))
        found.append(_words(featurizer, text, matrix, p[len(prompt) + 1 : len(prompt) + 1 + len(text)]))
    return found


def _matrix(weights: np.ndarray, prompt: int) -> np.ndarray:
    weights = weights / weights.sum(-1, keepdims=True)  # the softmax over the audio's positions
    weights = (weights - weights.mean(1, keepdims=True)) / weights.std(1, keepdims=True)
    if weights.shape[-1] > FILTER_WIDTH // 2:
        half = FILTER_WIDTH // 2
        padded = np.pad(weights, ((0, 0), (0, 0), (half, half)), mode="reflect")
        weights = np.median(np.lib.stride_tricks.sliding_window_view(padded, FILTER_WIDTH, axis=-1), axis=-1)
    return weights.mean(0)[prompt:-1]  # the no-timestamps row and each text token's


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotone path through `cost` [N, M] from (0, 0) to (N-1, M-1), as Whisper's
    dtw: (row, column) indices in order; of equal steps, the one along the row is taken."""
    N, M = cost.shape
    total = np.full((N + 1, M + 1), np.inf)
    total[0, 0] = 0
    trace = np.zeros((N + 1, M + 1), np.int8)
    for d in range(2, N + M + 1):  # anti-diagonals: each cell needs the two before
        i = np.arange(max(1, d - M), min(N, d - 1) + 1)
        j = d - i
        c0, c1, c2 = total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        total[i, j] = cost[i - 1, j - 1] + np.choose(step, [c0, c1, c2])
        trace[i, j] = step
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = N, M, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        step = trace[i, j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    rows, columns = np.array(path[::-1]).T
    return rows, columns


def _words(featurizer: WhisperFeaturizer, text: list[int], matrix: np.ndarray, probabilities: np.ndarray):
    rows, columns = dtw(-matrix)
    jumps = np.concatenate([[True], np.diff(rows) != 0])
    times = columns[jumps] / STEPS_PER_SECOND
    words = split(featurizer, text)
    bounds = np.cumsum([0, *(len(tokens) for _, tokens in words)])
    return [
        {
            "word": word,
            "start": float(times[a]),
            "end": float(times[b]),
            "probability": float(np.mean(probabilities[a:b])),
            "tokens": tokens,
        }
        for (word, tokens), a, b in zip(words, bounds, bounds[1:])
    ]


def split(featurizer: WhisperFeaturizer, tokens: list[int]) -> list[tuple[str, list[int]]]:
    """The tokens as words: a new word at a token that begins with a space or is punctuation (in
    languages written without spaces, at every whole character)."""
    decode = featurizer.tokenizer.decode
    pieces, current = [], []
    for token in tokens:  # whole characters: a piece ends where its text decodes cleanly
        current.append(token)
        if "\ufffd" not in decode(current):
            pieces.append((decode(current), current))
            current = []
    if current:
        pieces.append((decode(current), current))
    if featurizer.language in ("zh", "ja", "th", "lo", "my", "yue"):
        return pieces
    words: list[tuple[str, list[int]]] = []
    for text, piece in pieces:
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append((text, list(piece)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + piece)
    return words


def merged(words: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Punctuation joined to its word, as Whisper does: an opening mark after a space to the word
    after it, a closing mark to the word before it (which keeps its own times); the emptied
    entries stay, without text or tokens."""
    words = [dict(w) for w in words]
    following = len(words) - 1
    for i in range(len(words) - 2, -1, -1):
        if words[i]["word"].startswith(" ") and words[i]["word"].strip() in PREPENDED:
            words[following]["word"] = words[i]["word"] + words[following]["word"]
            words[following]["tokens"] = words[i]["tokens"] + words[following]["tokens"]
            words[i]["word"], words[i]["tokens"] = "", []
        else:
            following = i
    previous = 0
    for j in range(1, len(words)):
        if not words[previous]["word"].endswith(" ") and words[j]["word"] in APPENDED:
            words[previous]["word"] += words[j]["word"]
            words[previous]["tokens"] = words[previous]["tokens"] + words[j]["tokens"]
            words[j]["word"], words[j]["tokens"] = "", []
        else:
            previous = j
    return words


def place(words: list[dict[str, Any]], segments: list[dict[str, Any]], offset: float, last_speech: float) -> float:
    """Deals a window's `words` (seconds into the window at `offset`) to its `segments` by
    their text tokens (`segment["tokens"]`), with Whisper's corrections: a word at a sentence's
    end held over twice the median word length is cut to it; punctuation joins its word; a
    segment's ends move to its words' unless a word strays past them. -> the end of the last
    segment with words (where speech was last heard)."""
    durations = [w["end"] - w["start"] for w in words if w["end"] > w["start"]]
    median = min(0.7, float(np.median(durations))) if durations else 0.0
    longest = 2 * median
    for i in range(1, len(words)):
        if longest and words[i]["end"] - words[i]["start"] > longest:
            if words[i]["word"] in SENTENCE_ENDS:
                words[i]["end"] = words[i]["start"] + longest
            elif words[i - 1]["word"] in SENTENCE_ENDS:
                words[i]["start"] = words[i]["end"] - longest
    words = merged(words)
    taken = 0
    for segment in segments:
        count, found = 0, []
        while taken < len(words) and count < len(segment["tokens"]):
            word = words[taken]
            taken += 1
            count += len(word["tokens"])
            if word["word"]:
                found.append(
                    {
                        "word": word["word"],
                        "start": round(offset + word["start"], 2),
                        "end": round(offset + word["end"], 2),
                        "probability": round(word["probability"], 4),
                    }
                )
        segment["words"] = found
        if found:
            last_speech = _bounded(segment, found, median, longest, last_speech)
    return last_speech


def _bounded(segment, found, median: float, longest: float, last_speech: float) -> float:
    first = found[0]
    if first["end"] - last_speech > 4 * median and (
        first["end"] - first["start"] > longest or (len(found) > 1 and found[1]["end"] - first["start"] > 2 * longest)
    ):
        if len(found) > 1 and found[1]["end"] - found[1]["start"] > longest:
            boundary = max(found[1]["end"] / 2, found[1]["end"] - longest)
            first["end"] = found[1]["start"] = boundary
        first["start"] = max(0.0, first["end"] - longest)
    if segment["start"] < first["end"] and segment["start"] - 0.5 > first["start"]:
        first["start"] = max(0.0, min(first["end"] - median, segment["start"]))
    else:
        segment["start"] = first["start"]
    last = found[-1]
    if segment["end"] > last["start"] and segment["end"] + 0.5 < last["end"]:
        last["end"] = max(last["start"] + median, segment["end"])
    else:
        segment["end"] = last["end"]
    return segment["end"]
