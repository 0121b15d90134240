"""Amino-acid sequences: reading sequence files, the residue vocabulary, crops and sliding windows.

Records are dicts {"id", "sequence", "label", ...}: `sequence` in upper case, `label` a class
name, a per-residue label string of the sequence's length, or None.

Residue vocabulary (23 tokens): padding, the mask token, X (any unknown residue), then the 20
standard amino acids. Lower case is read as upper case. The rare and ambiguous letters map as
stated: selenocysteine U -> C and pyrrolysine O -> K (the standard residues they derive from);
B (D or N), Z (E or Q) and J (I or L) -> X. A trailing `*` (a stop codon in translated FASTA) is
dropped. Any other character is an error that names the record and the position.

Sequences longer than the model's `max_len`: training reads a random crop of each (`crop`,
through the task's augment hook); evaluation and prediction read windows of `max_len` that
overlap by half (`windows`) and average the outputs of the windows covering each residue
(`merge_windows`), so that every residue is scored once.
"""

from __future__ import annotations

import gzip
import io
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from core.errors import UserError
from tasks.common import tables

PAD, MASK, UNKNOWN = 0, 1, 2
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
VOCAB = ("<pad>", "<mask>", "X", *AMINO_ACIDS)
MAPPED = {"U": "C", "O": "K", "B": "X", "Z": "X", "J": "X"}

_CODES = np.full(256, 255, np.uint8)
for _index, _letter in enumerate(VOCAB[UNKNOWN:], start=UNKNOWN):
    _CODES[ord(_letter)] = _CODES[ord(_letter.lower())] = _index
for _letter, _target in MAPPED.items():
    _CODES[ord(_letter)] = _CODES[ord(_letter.lower())] = VOCAB.index(_target)

SEQUENCE_FORMATS = {
    ".fasta": "fasta",
    ".fa": "fasta",
    ".faa": "fasta",
    ".fas": "fasta",
    ".swiss": "swiss",
    ".dat": "swiss",
    ".txt": "swiss",
}


def clean(sequence: str) -> str:
    """The residues of `sequence` as `encode` reads them: spaces around and a trailing stop codon dropped."""
    return sequence.strip().rstrip("*")


def encode(sequence: str, record: str) -> np.ndarray:
    """Token ids [L] (uint8) of one sequence; `record` names it in errors."""
    sequence = clean(sequence)
    if not sequence:
        raise UserError(f"Record {record!r} has no sequence.")
    raw = sequence.encode("ascii", errors="replace")
    codes = _CODES[np.frombuffer(raw, np.uint8)]
    bad = np.flatnonzero(codes == 255)
    if bad.size:
        position = int(bad[0])
        raise UserError(
            f"Record {record!r}: {sequence[position]!r} at position {position + 1} is not an amino-acid letter "
            f"(expected {AMINO_ACIDS}, the ambiguous B, Z, J, X or the rare U, O)."
        )
    return codes


def decode(ids: Iterable[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def is_sequence_file(spec: str) -> bool:
    """Whether `spec` names a FASTA or flat file (by its suffix, before any .gz)."""
    path = Path(spec)
    stem = Path(path.stem) if path.suffix.lower() == ".gz" else path
    return stem.suffix.lower() in SEQUENCE_FORMATS


def read_sequences(
    spec: str, sequence_column: str = "sequence", label_column: str | None = None, id_column: str = "id"
) -> list[dict]:
    """Records of a FASTA file (plain or .gz), a UniProt/SwissProt flat file, or a CSV/TSV/JSONL/
    parquet table (or hub dataset) with a sequence column and, for supervised tasks, a label column."""
    path = Path(spec)
    if is_sequence_file(spec):
        stem = Path(path.stem) if path.suffix.lower() == ".gz" else path
        records = _read_biopython(path, SEQUENCE_FORMATS[stem.suffix.lower()])
    else:
        records = _read_table(spec, sequence_column, label_column, id_column)
    if not records:
        raise UserError(f"--data {spec} holds no sequence records.")
    return records


def _read_biopython(path: Path, kind: str) -> list[dict]:
    if not path.is_file():
        raise UserError(f"--data {path}: no such file.")
    try:
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if path.suffix.lower() == ".gz" else raw).decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile) as error:
        raise UserError(f"--data {path}: cannot be read ({error}).") from None
    except UnicodeDecodeError:
        raise UserError(f"--data {path}: not UTF-8 text.") from None
    return parse_text(text, kind, f"--data {path}")


def parse_text(text: str, kind: str, where: str) -> list[dict]:
    """The records of FASTA or flat-file `text`; `where` names its source in errors."""
    from Bio import SeqIO

    if kind == "fasta" and text.strip() and not text.lstrip().startswith(">"):
        raise UserError(f"{where}: not FASTA (the first line does not start with '>').")
    try:
        parsed = list(SeqIO.parse(io.StringIO(text), kind))
    except ValueError as error:
        raise UserError(f"{where}: cannot be parsed as {kind}: {error}") from None
    records = []
    for entry in parsed:
        sequence = str(entry.seq)
        if not sequence.strip():
            raise UserError(f"{where}: record {entry.id!r} has no sequence.")
        record = {"id": entry.id, "sequence": sequence.upper(), "label": None, "description": entry.description}
        record.update(uniprot_fields(entry.description if kind == "fasta" else _swiss_description(entry)))
        records.append(record)
    return records


def _swiss_description(entry) -> str:
    """A flat-file entry's name and species in the FASTA header's form ("Name OS=Species")."""
    name = re.sub(r"^RecName: Full=|[;{].*$", "", entry.description).strip()
    return f"{entry.id} {name} OS={entry.annotations.get('organism', '').rstrip('.')}"


def uniprot_fields(header: str) -> dict:
    """{"name", "species"} of a UniProt FASTA header ("sp|P69905|HBA_HUMAN Hemoglobin subunit
    alpha OS=Homo sapiens OX=9606 GN=HBA1 PE=1 SV=2"); empty for other headers."""
    match = re.match(r"\S+\s+(.*?)\s+OS=(.*?)(?:\s+[A-Z]{2}=|$)", header)
    return {"name": match.group(1).strip(), "species": match.group(2).strip()} if match else {}


def _read_table(spec: str, sequence_column: str, label_column: str | None, id_column: str) -> list[dict]:
    table, where = tables.read_table(spec, "a FASTA, flat or .csv/.tsv/.jsonl/.parquet file")
    wanted = {"data.sequence_column": sequence_column}
    if label_column is not None:
        wanted["data.label_column"] = label_column
    tables.require_columns(table, wanted, where)
    ids = table[id_column] if id_column in table.column_names else None
    labels = table[label_column] if label_column is not None else None
    sequences = table[sequence_column]
    rows = range(len(sequences)) if labels is None else tables.labelled_rows(labels, where, label_column)
    records = []
    for row in rows:
        name, sequence = str(ids[row]) if ids is not None else f"{where} row {row + 1}", sequences[row]
        if not isinstance(sequence, str) or not sequence.strip():
            raise UserError(f"{where}: record {name!r} has no sequence.")
        label = None if labels is None else str(labels[row])
        records.append({"id": name, "sequence": sequence.strip().upper(), "label": label})
    return records


def unique(records: Sequence[dict]) -> list[dict]:
    """The first record of each distinct sequence."""
    seen, kept = set(), []
    for record in records:
        if record["sequence"] not in seen:
            seen.add(record["sequence"])
            kept.append(record)
    return kept


# --- Crops and windows -----------------------------------------------------------------------


def window_offsets(length: int, width: int) -> list[int]:
    """Starts of the windows of `width` over `length` residues: every half width, the last one
    ending at the end (one window when the sequence fits)."""
    if length <= width:
        return [0]
    stride = max(1, width // 2)
    return [*range(0, length - width, stride), length - width]


def windows(per_sequence: dict[str, Sequence[np.ndarray]], width: int) -> dict[str, np.ndarray]:
    """Every sequence's windows (`window_offsets`) as rows of each array of `per_sequence` (the
    same lengths for one sequence): [R, width], zero-padded; plus `sequence` [R], whose window
    each row is, and `offset` [R], where it starts."""
    first = next(iter(per_sequence.values()))
    return _cut(per_sequence, [(s, o) for s, v in enumerate(first) for o in window_offsets(len(v), width)], width)


def _cut(
    per_sequence: dict[str, Sequence[np.ndarray]], rows: list[tuple[int, int]], width: int
) -> dict[str, np.ndarray]:
    out = {
        key: padded([arrays[s][o : o + width] for s, o in rows], width, arrays[0].dtype)
        for key, arrays in per_sequence.items()
    }
    out["sequence"] = np.array([s for s, _ in rows], np.int32)
    out["offset"] = np.array([o for _, o in rows], np.int32)
    return out


def merge_windows(
    values: np.ndarray, sequence: np.ndarray, offset: np.ndarray, lengths: Sequence[int]
) -> list[np.ndarray]:
    """Per-position outputs of window rows [R, width, ...] -> per sequence [L, ...]: the mean over
    the windows that cover each residue."""
    sums = [np.zeros((n, *values.shape[2:]), np.float64) for n in lengths]
    counts = [np.zeros(n, np.float64) for n in lengths]
    for row, (s, o) in enumerate(zip(sequence, offset)):
        span = min(values.shape[1], lengths[s] - o)
        sums[s][o : o + span] += values[row, :span]
        counts[s][o : o + span] += 1
    return [total / count.reshape(-1, *[1] * (total.ndim - 1)) for total, count in zip(sums, counts)]


def merge_rows(values: np.ndarray, sequence: np.ndarray, count: int) -> np.ndarray:
    """Per-row outputs [R, ...] -> per sequence [count, ...]: the mean over each sequence's windows."""
    sums = np.zeros((count, *values.shape[1:]), np.float64)
    np.add.at(sums, sequence, values)
    return sums / np.bincount(sequence, minlength=count).reshape(-1, *[1] * (values.ndim - 1))


def pieces(per_sequence: dict[str, Sequence[np.ndarray]], cap: int) -> dict[str, np.ndarray]:
    """Each sequence whole, or cut into consecutive pieces of `cap` residues when longer, as
    rows [R, cap] (with `sequence` and `offset` as in `windows`): the training rows, which
    `crop` cuts at random at every step."""
    first = next(iter(per_sequence.values()))
    return _cut(per_sequence, [(s, o) for s, v in enumerate(first) for o in range(0, len(v), cap)], cap)


def padded(rows: Sequence[np.ndarray], width: int, dtype) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype)
    for r, row in enumerate(rows):
        out[r, : len(row)] = row[:width]
    return out


def crop(batch: dict, keys: Sequence[str], width: int, rng: np.random.Generator) -> dict:
    """`batch` with every row of `mask` longer than `width` cut to a random span of `width`
    positions, the same span in each of `keys` (which includes "mask")."""
    mask = batch["mask"]
    lengths = mask.sum(1)
    out_width = min(mask.shape[1], width)
    starts = (rng.random(len(lengths)) * np.maximum(lengths - width + 1, 1)).astype(np.int64)
    index = starts[:, None] + np.arange(out_width)[None, :]
    return {**batch, **{key: np.take_along_axis(batch[key], index, axis=1) for key in keys}}
