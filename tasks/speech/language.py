"""Whisper's language detection: the language a recording is spoken in, from its first window.

As Whisper's own `detect_language` does: the decoder reads the start token alone, and the
token it expects next, among the language tokens only, is the language, its softmax over them
the probability. A multilingual checkpoint used as it is (`--model whisper-base`) detects by
default (`--language auto`); an English-only one speaks English. Recordings in different
languages are decoded apart (`by_language`): the language is part of the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from core.generation.seq2seq import first_logits
from core.model.encoder_decoder import Start
from tasks.speech.featurizer import clip

if TYPE_CHECKING:
    from tasks.speech.whisper import WhisperFeaturizer

AUTO = "auto"


def detect(model, featurizer: WhisperFeaturizer, examples: Sequence[dict], batch_size: int):
    """Each example's language (its code) and the model's probability of it."""
    vocabulary = featurizer.vocabulary
    if not vocabulary.multilingual:
        return [("en", 1.0)] * len(examples)
    codes, ids = list(vocabulary.languages), np.asarray(list(vocabulary.languages.values()))
    windows = [featurizer.frames(clip(e, silence_allowed=True)[: featurizer.window_samples]) for e in examples]
    found = []
    for first in range(0, len(windows), batch_size):
        logits = first_logits(model, windows[first : first + batch_size], start=Start((vocabulary.start,)))
        chosen = logits[:, ids]
        probabilities = np.exp(chosen - chosen.max(-1, keepdims=True))
        probabilities /= probabilities.sum(-1, keepdims=True)
        found += [(codes[int(row.argmax())], float(row.max())) for row in probabilities]
    return found


def by_language(languages: Sequence[str]) -> dict[str, list[int]]:
    """The examples' indices grouped by their language, in order."""
    groups: dict[str, list[int]] = {}
    for index, language in enumerate(languages):
        groups.setdefault(language, []).append(index)
    return groups
