"""Word and character error rates with jiwer, after one declared normalization, and the
off-the-shelf recognizer scored beside the model: pocketsphinx 5 with the US English acoustic
model, dictionary and language model that its wheel ships (nothing trained here).

Normalization (`normalize`), applied to references and hypotheses alike and to the transcripts
the model learns: lower case; each digit becomes its word, one by one ("371" and "3 7 1" both
read "three seven one", as the digit corpus speaks them; Whisper writes digits); hyphens,
slashes and underscores become spaces; every other punctuation mark is dropped, except
apostrophes inside words ("don't"); runs of white space become one space.
"""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np

NORMALIZATION = (
    "lowercase; digits spelled one by one; punctuation dropped (hyphens and slashes as spaces, apostrophes inside "
    "words kept)"
)
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_DIGIT = re.compile(r"[0-9]")
_SPACERS = re.compile(r"[-/_\u2010-\u2015]")
_QUOTE_EDGES = re.compile(r"(^|\s)'+|'+(?=\s|$)")


def normalize(text: str) -> str:
    """`text` as the metrics and the model's vocabulary read it (see the module docstring)."""
    text = _DIGIT.sub(lambda digit: f" {DIGITS[int(digit.group())]} ", text)
    text = _SPACERS.sub(" ", text.lower().replace("\u2019", "'"))
    text = "".join(c for c in text if c == "'" or not unicodedata.category(c).startswith("P"))
    text = _QUOTE_EDGES.sub(" ", text)
    return " ".join(text.split())


def error_rates(references: Sequence[str], hypotheses: Sequence[str]) -> dict[str, float]:
    """WER and CER in percent with the word-level substitution, deletion and insertion counts,
    over normalized texts (jiwer 4). An empty reference counts its hypothesis' words as insertions."""
    import jiwer

    references = [normalize(text) for text in references]
    hypotheses = [normalize(text) for text in hypotheses]
    words = jiwer.process_words(references, hypotheses)
    reference_words = words.hits + words.substitutions + words.deletions
    characters = jiwer.process_characters(references, hypotheses)
    reference_characters = characters.hits + characters.substitutions + characters.deletions
    word_errors = words.substitutions + words.deletions + words.insertions
    character_errors = characters.substitutions + characters.deletions + characters.insertions
    return {
        "wer": 100.0 * word_errors / max(reference_words, 1),
        "cer": 100.0 * character_errors / max(reference_characters, 1),
        "substitutions": float(words.substitutions),
        "deletions": float(words.deletions),
        "insertions": float(words.insertions),
        "reference_words": float(reference_words),
    }


def grouped_error_rates(
    references: Sequence[str], hypotheses: Sequence[str], groups: Sequence[Sequence[str]]
) -> dict[str, float]:
    """`error_rates` over all examples, then WER and CER of each group ("wer/en-029"); `groups`
    names the groups of each example (any number of them)."""
    scores = error_rates(references, hypotheses)
    for group in sorted({g for names in groups for g in names}):
        rows = [i for i, names in enumerate(groups) if group in names]
        part = error_rates([references[i] for i in rows], [hypotheses[i] for i in rows])
        scores[f"wer/{group}"], scores[f"cer/{group}"] = part["wer"], part["cer"]
    return scores


def pocketsphinx_transcripts(clips: Iterable[np.ndarray], progress=None) -> list[str]:
    """pocketsphinx 5's transcript of each float32 16 kHz clip, with its default US English
    models (`Decoder()` loads the acoustic model, dictionary and trigram model that ship),
    decoded in one process per core."""
    import concurrent.futures

    workers = max(1, min(os.cpu_count() or 1, 8))
    with concurrent.futures.ProcessPoolExecutor(workers, initializer=_start_decoder) as pool:
        transcripts = []
        for transcript in pool.map(_decode, clips, chunksize=4):
            transcripts.append(transcript)
            if progress is not None:
                progress()
    return transcripts


_decoder = None


def _start_decoder() -> None:
    from pocketsphinx import Decoder

    global _decoder
    _decoder = Decoder(samprate=16000, logfn=os.devnull)


def _decode(clip: np.ndarray) -> str:
    pcm = (np.clip(clip, -1.0, 1.0) * 32767).astype(np.int16).tobytes()
    _decoder.start_utt()
    _decoder.process_raw(pcm, full_utt=True)
    _decoder.end_utt()
    hypothesis = _decoder.hyp()
    return hypothesis.hypstr if hypothesis is not None else ""
