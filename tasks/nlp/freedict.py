"""The English-German FreeDict dictionary (Debian's `dict-freedict-eng-deu`, from Ding): its
usage examples as translation pairs, and its headwords as a word-by-word baseline.

The dictionary is in dictd format: `freedict-eng-deu.dict.dz` (gzip text) holds one entry per
headword sense, and `freedict-eng-deu.index` gives each entry's headword, byte offset and length
(base64 numbers). An entry reads

    house /hˈaʊs/
    Haus <neut>
          "build a house"  - ein Haus bauen
          "take a lease on a house"  - ein Haus mieten
     see: {houses}, {open house}

the headword and pronunciation, the sense's translations (alternatives after commas, with
grammar notes in <> and labels in [] or ()), then usage examples, one a line, quoted English,
two spaces, a dash and the German. Ding writes alternatives inside a phrase with slashes
("he/she has/had run" - "er/sie ist/war gelaufen"); examples keep the first of each, on both
sides ("he has run" - "er ist gelaufen"), and the first of the German alternatives after commas
(a German sentence is kept whole).
"""

from __future__ import annotations

import functools
import gzip
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

from core.errors import UserError

PACKAGE = "dict-freedict-eng-deu"
DICTIONARY = Path("/usr/share/dictd/freedict-eng-deu.dict.dz")
INDEX = DICTIONARY.with_name("freedict-eng-deu.index")

_EXAMPLE = re.compile(r'^\s+"(.+?)"  - (.+?)\s*$', re.M)
_SLASHED = re.compile(r"(\w[\w'’.-]*?)(?:/[\w'’.-]*\w)+")
_SENTENCE_ALTERNATIVES = re.compile(r"(?<=[.!?…])\s*,\s+")
_ANNOTATION = re.compile(r"<[^<>]*>|\[[^\[\]]*\]|\{[^{}]*\}|\([^()]*\)")
# The longest headword phrase that `phrases` keeps and `word_by_word` looks up.
PHRASE_WORDS = 4
_BASE64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def missing_message(path: Path) -> str:
    return (
        f"{path} is missing: the translate task's default data ships in the Debian package {PACKAGE} "
        f"(`sudo apt-get install {PACKAGE}`; `make install` does it when run as root). Or give your own "
        "pairs with --data FILE (.tsv/.csv/.jsonl/.parquet with source and target columns)."
    )


def read(path: Path | None = None) -> bytes:
    """The whole dictionary text (about 56 MB) as UTF-8 bytes; the installed one by default."""
    return _read(path or DICTIONARY)


@functools.cache
def _read(path: Path) -> bytes:
    if not path.is_file():
        raise UserError(missing_message(path))
    try:
        return gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as error:
        raise UserError(f"{path} is not a readable dictzip file ({error}); reinstall {PACKAGE}.") from None


def first_alternatives(text: str) -> str:
    """Each slashed alternative reduced to its first: "he/she has/had run" -> "he has run"."""
    return _SLASHED.sub(r"\1", text)


def first_translation(german: str) -> str:
    """The first of the alternatives of an example's German side: a whole sentence when it is
    one, else the text before the first comma."""
    first = _SENTENCE_ALTERNATIVES.split(german)[0].strip()
    if not first.endswith((".", "!", "?", "…", '"', "“", "”")):
        first = first.split(", ")[0].strip()
    return first


def example_pairs(text: str) -> list[tuple[str, str]]:
    """(English, German) of every usage example, in dictionary order, alternatives reduced."""
    pairs = []
    for english, german in _EXAMPLE.findall(text):
        source, target = first_alternatives(english).strip(), first_alternatives(first_translation(german))
        if source and target:
            pairs.append((source, target))
    return pairs


def _number(text: str) -> int:
    value = 0
    for character in text:
        value = value * 64 + _BASE64.index(character)
    return value


def senses(dictionary: Path | None = None, index: Path | None = None) -> dict[str, tuple[str, ...]]:
    """One-word headword -> the first translation of each of its senses, in dictionary order
    (of the installed dictionary by default)."""
    return {
        headword: tuple(found)
        for headword, found in _headwords(dictionary or DICTIONARY, index or INDEX)
        if " " not in headword
    }


def phrases(dictionary: Path | None = None, index: Path | None = None) -> dict[str, str]:
    """Headword of 2 to PHRASE_WORDS words, lower case -> the first translation of its first
    sense ("construction site" -> "Baustelle")."""
    found = {}
    for headword, translations in _headwords(dictionary or DICTIONARY, index or INDEX):
        words = headword.lower().split()
        if 1 < len(words) <= PHRASE_WORDS:
            found.setdefault(" ".join(words), translations[0])
    return found


@functools.cache
def _headwords(dictionary: Path, index: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(headword, the first translation of each of its senses) of every entry with one."""
    if not index.is_file():
        raise UserError(missing_message(index))
    data = read(dictionary)
    found: dict[str, list[str]] = {}
    for line in index.read_text(encoding="utf-8").splitlines():
        headword, _, rest = line.partition("\t")
        if not headword or headword.startswith("00-database"):
            continue
        offset, _, length = rest.partition("\t")
        start = _number(offset)
        translation = first_sense(data[start : start + _number(length)].decode("utf-8", errors="replace"))
        if translation and translation not in found.setdefault(headword, []):
            found[headword].append(translation)
    return tuple((headword, tuple(translations)) for headword, translations in found.items() if translations)


def first_sense(entry: str) -> str:
    """The first translation of an entry's sense: its second line, labels and notes removed,
    up to the first comma."""
    lines = entry.split("\n")
    if len(lines) < 2:
        return ""
    line, previous = lines[1], None
    while line != previous:  # nested labels: "bei ([+ dat]) <prep>"
        line, previous = _ANNOTATION.sub(" ", line), line
    return next((" ".join(part.split()) for part in line.split(",") if part.strip()), "")


def choose_senses(candidates: dict[str, tuple[str, ...]], german: list[str]) -> dict[str, str]:
    """Headword -> the translation among its senses whose rarest word is the most frequent in
    the `german` texts (a training split), the first sense on a tie: "the" has senses "das",
    "der", "die" and "zum", and is translated as whichever the texts use most."""
    counts: dict[str, int] = {}
    for text in german:
        for word in _TOKEN.findall(text):
            counts[word] = counts.get(word, 0) + 1
    return {headword: most_used(translations, counts)[0] for headword, translations in candidates.items()}


def most_used(translations: Sequence[str], counts: Mapping[str, int]) -> tuple[str, int]:
    """The translation whose rarest word has the highest count, the first on a tie, and that
    count."""
    rarest = [min(counts.get(word, 0) for word in _TOKEN.findall(t) or [""]) for t in translations]
    best = rarest.index(max(rarest))
    return translations[best], rarest[best]


_TOKEN = re.compile(r"\w+(?:[-'’]\w+)*|[^\w\s]")


class Cooccurrence:
    """How often each English word (lower case) and each German word appear in one pair of a
    training split, together and alone: what a learned glossary chooses senses and fills the
    dictionary's gaps by."""

    def __init__(self, pairs: Sequence[tuple[str, str]]):
        self.together: dict[str, Counter] = defaultdict(Counter)
        self.english, self.german = Counter(), Counter()
        for english, german in pairs:
            # Distinct words in the order they come (not a set's, which varies with the hash
            # seed): a tie in `associate` goes to the German word seen first.
            source = list(dict.fromkeys(token.lower() for token in _TOKEN.findall(english)))
            target = list(dict.fromkeys(_TOKEN.findall(german)))
            self.english.update(source)
            self.german.update(target)
            for word in source:
                self.together[word].update(target)

    def sense(self, word: str, translations: Sequence[str]) -> str | None:
        """The translation whose rarest word appears most often in pairs with `word`, the first
        on a tie; None when no translation's words all do."""
        translation, count = most_used(translations, self.together.get(word.lower(), {}))
        return translation if count > 0 else None

    def associate(self, word: str, least: int = 2) -> str | None:
        """The German word most associated with `word` (Dice: twice the pairs with both over the
        pairs with either), if they share at least `least` pairs; of equals, the first seen."""
        seen = self.together.get(word, {})
        if not seen:
            return None
        german, both = max(seen.items(), key=lambda item: item[1] / (self.english[word] + self.german[item[0]]))
        return german if both >= least else None


def learned_words(candidates: dict[str, tuple[str, ...]], pairs: Sequence[tuple[str, str]]) -> dict[str, str]:
    """`choose_senses` informed by the training pairs: each headword's sense is the one whose
    words appear most often in pairs with the headword (`Cooccurrence.sense`; by the targets'
    word counts where none does), and an English word of the pairs without an entry is
    translated by its most associated German word (`Cooccurrence.associate`)."""
    counts = Cooccurrence(pairs)
    words = choose_senses(candidates, [german for _, german in pairs])
    for headword, translations in candidates.items():
        words[headword] = counts.sense(headword, translations) or words[headword]
    known = {headword.lower() for headword in candidates}
    for word in counts.english:
        if word[0].isalpha() and word not in known and (german := counts.associate(word)):
            words[word] = german
    return words


def word_by_word(sentence: str, words: dict[str, str]) -> str:
    """Each word replaced by its dictionary translation (as written, else lower-cased), unknown
    words and punctuation copied. Where `words` also holds phrases (lower case, `phrases`), the
    longest phrase that starts at a word is translated whole."""
    tokens, out, at = _TOKEN.findall(sentence), [], 0
    while at < len(tokens):
        token, span = tokens[at], 1
        translated = words.get(token) or words.get(token.lower()) or token
        for size in range(min(PHRASE_WORDS, len(tokens) - at), 1, -1):
            phrase = words.get(" ".join(tokens[at : at + size]).lower())
            if phrase:
                translated, span = phrase, size
                break
        if out and not token[0].isalnum() and token not in "(„“\"'":
            out[-1] += translated
        else:
            out.append(translated)
        at += span
    return " ".join(out)
