"""The embedded speech corpora, rendered with eSpeak NG on first use and cached.

No labelled human speech ships in any package the suite installs, so the default corpus is
synthetic: texts spoken by eSpeak NG's English voices (accents) combined with its `!v` voice
variants (speakers), at random rates and pitches, with random leading and trailing silence.

Protocol. Train and valid use the seen accents x seen variants; test uses only held-out
variants, half of its utterances in a held-out accent (`en-029`, Caribbean English) that training
never heard, so every test voice is new. Two transcript presets:

- `digits`: strings of 1-7 digits spoken as words, 0 as "oh" or "zero" at random (as in TIDIGITS);
  `synthetic` (for tests) is a small digits set of 1-3 digits, rendered in memory;
- `sentences` (default): sentences of 3-15 words from the Women's E-Commerce Clothing Reviews
  that the sentiment task reads; a sentence belongs to one split only (by a hash of its text),
  so test sentences are held out.

A rendered corpus is cached under `$XDG_CACHE_HOME/apps/speech` (default `~/.cache`), in a folder
named by a hash of every setting that shapes it: int16 samples at 16 kHz in `audio.npy` (read
memory-mapped) and the utterances in `utterances.json`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from core.paths import cache_folder
from tasks.common.splits import hash_split
from tasks.speech import audio as audio_lib
from tasks.speech.scoring import DIGITS, normalize

# Part of the cache key: raise it whenever the planning or rendering code changes what it makes.
CORPUS_VERSION = 1
# A CRC-32 of a transcript (or of a user's clip path) places it: 1 in 20 in test, 1 in 20 in
# valid, the rest in train.
SHARES = {"test": 1, "valid": 1, "train": 18}
ACCENTS_SEEN = ("en", "en-us", "en-gb-x-rp", "en-gb-scotland", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-us-nyc")
ACCENT_HELD_OUT = "en-029"
# eSpeak NG's `!v` variants that sound like people (robots, whispers and effects left out); the
# empty name is the accent's own voice.
VARIANTS_SEEN = (
    "", "m1", "m2", "m4", "m5", "m6", "m7", "f1", "f3", "f4", "f5", "klatt", "klatt2", "klatt3",
    "Alex", "Andy", "Annie", "adam", "anika", "aunty", "benjamin", "boris", "caleb", "ed", "iven",
    "john", "linda", "max", "michel", "norbert", "paul", "quincy", "rob", "robert", "steph",
    "travis", "victor", "zac",
)  # fmt: skip
VARIANTS_HELD_OUT = ("m3", "f2", "klatt4", "david")
RATES = (125, 185)  # words per minute (eSpeak's default is 175)
PITCHES = (25, 75)  # 0-100, 50 being the voice's own
SILENCE = (0.05, 0.3)  # seconds of silence before and after, each
SIZES = {
    "digits": {"train": 6000, "valid": 300, "test": 400},
    "sentences": {"train": 7000, "valid": 200, "test": 300},
    # Small enough to render in a second or two, for tests (never cached on disk).
    "synthetic": {"train": 64, "valid": 16, "test": 16},
}
SENTENCE_WORDS = (3, 15)
# Sentences spoken as written: letters, spaces and plain punctuation (no digits or symbols that
# eSpeak would read out differently from their spelling).
_SPEAKABLE = re.compile(r"^[A-Za-z ,.'!?;:-]+$")


@dataclass(frozen=True)
class Utterance:
    split: str
    spoken: str  # what eSpeak NG reads
    text: str  # the transcript (normalized)
    voice: str  # accent or accent+variant, as eSpeak NG names it
    rate: int
    pitch: int
    lead: float  # seconds of silence before and after
    tail: float


def voice_pool(split: str) -> tuple[list[str], list[str]]:
    """(accents, variants) of a split under the protocol."""
    if split == "test":
        return [*ACCENTS_SEEN, ACCENT_HELD_OUT], list(VARIANTS_HELD_OUT)
    return list(ACCENTS_SEEN), list(VARIANTS_SEEN)


def digit_texts(count: int, rng: np.random.Generator, longest: int = 7) -> list[tuple[str, str]]:
    texts = []
    for _ in range(count):
        digits = rng.integers(0, 10, int(rng.integers(1, longest + 1)))
        words = [("oh" if rng.random() < 0.5 else "zero") if d == 0 else DIGITS[d] for d in digits]
        texts.append((" ".join(words), " ".join(words)))
    return texts


def review_sentences() -> dict[str, list[tuple[str, str]]]:
    """(spoken, transcript) pairs of every usable review sentence, by split: a CRC-32 of the
    transcript puts 5% in test, 5% in valid and the rest in train; duplicates are kept once."""
    from tasks.common.reviews import load_reviews

    pools: dict[str, list[tuple[str, str]]] = {"train": [], "valid": [], "test": []}
    seen = set()
    for review in load_reviews()["text"]:
        for sentence in re.split(r"(?<=[.!?])\s+", review.replace("\n", " ")):
            sentence = sentence.strip()
            text = normalize(sentence)
            if not _SPEAKABLE.match(sentence) or text in seen:
                continue
            if not SENTENCE_WORDS[0] <= len(text.split()) <= SENTENCE_WORDS[1]:
                continue
            seen.add(text)
            pools[hash_split(text, SHARES)].append((sentence, text))
    return pools


def plan(preset: str, sizes: dict[str, int], seed: int) -> list[Utterance]:
    """Every utterance of the corpus, before rendering: texts, voices, rates, silences."""
    pools = review_sentences() if preset == "sentences" else None
    utterances = []
    for index, split in enumerate(("train", "valid", "test")):
        rng = np.random.default_rng((seed, index))
        count = sizes[split]
        if pools is None:  # the synthetic set's strings are short: few batch widths to compile in tests
            texts = digit_texts(count, rng, longest=3 if preset == "synthetic" else 7)
        else:
            pool = pools[split]
            texts = [pool[i] for i in rng.choice(len(pool), min(count, len(pool)), replace=False)]
        accents, variants = voice_pool(split)
        for spoken, text in texts:
            if split == "test":  # half in the held-out accent, half in the seen ones
                accent = ACCENT_HELD_OUT if rng.random() < 0.5 else str(rng.choice(ACCENTS_SEEN))
            else:
                accent = str(rng.choice(accents))
            variant = str(rng.choice(variants))
            utterances.append(
                Utterance(
                    split=split,
                    spoken=spoken,
                    text=text,
                    voice=f"{accent}+{variant}" if variant else accent,
                    rate=int(rng.integers(RATES[0], RATES[1] + 1)),
                    pitch=int(rng.integers(PITCHES[0], PITCHES[1] + 1)),
                    lead=round(float(rng.uniform(*SILENCE)), 3),
                    tail=round(float(rng.uniform(*SILENCE)), 3),
                )
            )
    return utterances


def render(utterance: Utterance) -> np.ndarray:
    """One utterance as int16 samples at 16 kHz."""
    import librosa

    from tasks.speech.espeak import speaker

    voice = speaker()
    samples = voice.say(utterance.spoken, utterance.voice, utterance.rate, utterance.pitch)
    resampled = librosa.resample(samples.astype(np.float32) / 32768, orig_sr=voice.sample_rate, target_sr=16000)
    lead, tail = (np.zeros(int(s * audio_lib.SAMPLE_RATE), np.float32) for s in (utterance.lead, utterance.tail))
    return (np.clip(np.concatenate([lead, resampled, tail]), -1, 1) * 32767).astype(np.int16)


def cache_root() -> Path:
    return cache_folder() / "speech"


def settings(preset: str, sizes: dict[str, int], seed: int) -> dict:
    """Everything that shapes a rendered corpus; its hash names the cache folder."""
    return {
        "version": CORPUS_VERSION,
        "preset": preset,
        "sizes": sizes,
        "seed": seed,
        "accents": [ACCENTS_SEEN, ACCENT_HELD_OUT],
        "variants": [VARIANTS_SEEN, VARIANTS_HELD_OUT],
        "rates": RATES,
        "pitches": PITCHES,
        "silence": SILENCE,
    }


def load_corpus(preset: str, seed: int = 0) -> dict[str, list[dict]]:
    """The embedded corpus `preset` ("digits", "sentences" or "synthetic") as examples by split,
    rendered (with a progress bar) on first use and read from the cache after."""
    sizes = SIZES[preset]
    if preset == "synthetic":
        return _examples(*_synthetic(seed), "synthetic")
    spec = settings(preset, sizes, seed)
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_root() / f"{preset}-{key}"
    if not (folder / "utterances.json").exists():
        _render_corpus(plan(preset, sizes, seed), folder, spec)
    meta = json.loads((folder / "utterances.json").read_text())
    utterances = [Utterance(**u) for u in meta["utterances"]]
    samples = np.load(folder / "audio.npy", mmap_mode="r")
    return _examples(utterances, samples, np.asarray(meta["offsets"]), f"{preset}-{key}")


def _render_corpus(utterances: list[Utterance], folder: Path, spec: dict) -> None:
    """Renders into a temporary folder, then renames it: a killed render leaves no half corpus."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    temporary = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    clips = []
    columns = (TextColumn("[bold]rendering speech"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=False) as progress:
        for utterance in progress.track(utterances, description="render"):
            clips.append(render(utterance))
    offsets = np.cumsum([0] + [len(c) for c in clips])
    np.save(temporary / "audio.npy", np.concatenate(clips))
    meta = {"settings": spec, "offsets": offsets.tolist(), "utterances": [asdict(u) for u in utterances]}
    (temporary / "utterances.json").write_text(json.dumps(meta))
    shutil.rmtree(folder, ignore_errors=True)
    temporary.rename(folder)


@functools.cache
def _synthetic(seed: int) -> tuple[list[Utterance], np.ndarray, np.ndarray]:
    """The small synthetic corpus, rendered once per process (3 s; a run reads it for each split)
    and never written to the cache folder. Its samples are read-only, as the cached corpora's are."""
    utterances = plan("synthetic", SIZES["synthetic"], seed)
    clips = [render(u) for u in utterances]
    samples = np.concatenate(clips)
    samples.flags.writeable = False
    return utterances, samples, np.cumsum([0] + [len(c) for c in clips])


def _examples(utterances: list[Utterance], samples: np.ndarray, offsets: np.ndarray, name: str) -> dict:
    splits: dict[str, list[dict]] = {"train": [], "valid": [], "test": []}
    for i, u in enumerate(utterances):
        splits[u.split].append(
            {
                "id": f"{name}/{i}",
                "audio": samples[offsets[i] : offsets[i + 1]],
                "path": None,
                "text": u.text,
                "voice": u.voice,
            }
        )
    return splits
