"""Read PDB ids, chain names, sequences and DSSP states from a ProMod3 StructureDB file.

ProMod3 (``promod3.loop.StructureDB``) keeps its fragment database in one binary file; the
Debian package ``promod3-data`` ships it as ``/usr/share/promod3/loop_data/structure_db.dat``.
This module reads the four per-chain fields we need with numpy alone, without ProMod3 or
OpenStructure.

The layout is the one written by ``StructureDB::Save`` and read by ``StructureDB::Load`` in
ProMod3's ``modules/loop/src/structure_db.cc`` (header helpers in ``modules/core/src/check_io.hh``).
That source was not at hand, so the layout below was reconstructed from the disassembly of
``StructureDB::Load`` in ``libpromod3_loop.so.3.2.1`` (Debian ProMod3 3.2.1) and checked against
a dump made with the real library. It is the native, non-portable format: raw little-endian
values of an x86-64 build, which is why the header records the sizes of the types involved.

Header (77 bytes):
    uint32  magic number 1234
    uint32  format version (2)
    11 x uint32  type sizes the writer was built with: 4, 4, 2, 8, 2, 6, 88, 40, 24, 6, 4
    probe values 1 as uint32, float32, uint8, uint16, uint64 and int16 (byte-order checks)
    int32   stored_data: bit flags saying which optional arrays follow (-1 means all)

Body:
    uint64 n, then n chain records ("CoordInfo"), each: uint32 length + PDB id,
        uint32 length + chain name, uint32 offset, uint16 size, uint16 start residue number,
        3 x float32 shift; residues offset .. offset+size-1 of the arrays below belong to it
    then per-residue arrays, each a uint64 count followed by count raw elements:
        sequence                  1 byte  (one-letter codes)     always     -> read
        backbone positions       24 bytes (int16 coordinates)    always     -> skipped
        dihedral angles           4 bytes                        flag 0x01  -> skipped
        solvent accessibilities   2 bytes (uint16)               flag 0x02  -> skipped
        residue depths            2 bytes (uint16)               flag 0x04  -> skipped
        DSSP states               1 byte                         flag 0x08  -> read
        sequence profile         40 bytes (20 x int16)           flag 0x10  -> skipped
        structure profile        40 bytes (20 x int16)           flag 0x20  -> skipped

Skipped arrays are never touched: their byte sizes are computed from their counts, so only the
header, the chain records and the two 1-byte arrays are paged in from the memory map.
"""

from __future__ import annotations

import os
import struct

import numpy as np

MAGIC_NUMBER = 1234
SUPPORTED_VERSION = 2

# sizeof() of the types StructureDB::Load checks, in the order it checks them. A file written by
# a build where these differ has a different record layout, so it is refused rather than misread.
_EXPECTED_TYPE_SIZES = (4, 4, 2, 8, 2, 6, 88, 40, 24, 6, 4)

# magic, version, the type sizes, then the probe values (all equal to 1) that Load compares to
# detect a foreign byte order or float format, then the stored_data flags.
_HEADER = struct.Struct("<II11IIfBHQhi")

# Flags in stored_data (ProMod3's StructureDB::DBDataType) and the element sizes of the arrays.
_DIHEDRALS = 0x01
_SOLVENT_ACCESSIBILITIES = 0x02
_RESIDUE_DEPTHS = 0x04
_DSSP = 0x08
_AA_FREQUENCIES = 0x10
_AA_FREQUENCIES_STRUCT = 0x20
_ARRAYS_AFTER_SEQUENCE = (
    # (name, flag that must be set for the array to be present or None if always present, element size)
    ("backbone positions", None, 24),
    ("dihedral angles", _DIHEDRALS, 4),
    ("solvent accessibilities", _SOLVENT_ACCESSIBILITIES, 2),
    ("residue depths", _RESIDUE_DEPTHS, 2),
    ("DSSP states", _DSSP, 1),
    ("sequence profiles", _AA_FREQUENCIES, 40),
    ("structure profiles", _AA_FREQUENCIES_STRUCT, 40),
)

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# offset, size, start residue number, shift (x, y, z) - follows the two strings of a chain record
_COORD_INFO_TAIL = struct.Struct("<IHH3f")


class _Reader:
    """Bounds-checked cursor over the mapped file, so a truncated file raises ValueError."""

    def __init__(self, data: np.ndarray, path: str) -> None:
        self.data = data
        self.buf = memoryview(data)
        self.size = len(data)
        self.path = path
        self.pos = 0

    def need(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or self.pos + nbytes > self.size:
            raise ValueError(
                f"{self.path}: truncated ProMod3 structure database "
                f"({what}: need {nbytes} bytes at offset {self.pos}, file has {self.size})"
            )

    def unpack(self, fmt: struct.Struct, what: str) -> tuple:
        self.need(fmt.size, what)
        values = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return values

    def string(self, what: str) -> str:
        (length,) = self.unpack(_U32, what)
        self.need(length, what)
        text = self.buf[self.pos : self.pos + length].tobytes().decode("ascii")
        self.pos += length
        return text

    def array(self, item_size: int, what: str) -> tuple[int, int]:
        """Consume one serialized array; return (element count, byte offset of its data)."""
        (count,) = self.unpack(_U64, f"{what} count")
        start = self.pos
        self.need(count * item_size, what)
        self.pos += count * item_size
        return count, start


def _check_header(reader: _Reader, path: str) -> int:
    """Reads and checks the header; returns its `stored_data` flags."""
    magic, version, *rest = reader.unpack(_HEADER, "header")
    if magic != MAGIC_NUMBER:
        raise ValueError(f"{path}: not a ProMod3 structure database (magic number {magic}, expected {MAGIC_NUMBER})")
    if version != SUPPORTED_VERSION:
        raise ValueError(f"{path}: ProMod3 structure database version {version} is not supported")
    type_sizes, probes, stored_data = tuple(rest[:11]), tuple(rest[11:17]), rest[17]
    if type_sizes != _EXPECTED_TYPE_SIZES:
        raise ValueError(
            f"{path}: ProMod3 structure database written with type sizes {type_sizes}, "
            f"expected {_EXPECTED_TYPE_SIZES} (incompatible build)"
        )
    if probes != (1, 1.0, 1, 1, 1, 1):
        raise ValueError(f"{path}: ProMod3 structure database has a foreign byte order or number format")
    if not stored_data & _DSSP:
        raise ValueError(f"{path}: ProMod3 structure database holds no DSSP states (stored_data={stored_data})")
    return stored_data


def read_structure_db(path: str | os.PathLike[str]) -> list[tuple[str, str, str, str]]:
    """Return (pdb_id, chain, sequence, dssp) for every chain of a ProMod3 StructureDB, in file order.

    Raises ValueError if the file is not a ProMod3 structure database, has an unsupported
    version, was written by an incompatible build, lacks DSSP states, or is truncated.
    """
    path = os.fspath(path)
    if os.path.getsize(path) < _HEADER.size:
        # Also keeps np.memmap away from empty files, which it cannot map.
        raise ValueError(f"{path}: not a ProMod3 structure database (file too short for the header)")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    reader = _Reader(data, path)

    stored_data = _check_header(reader, path)

    (n_chains,) = reader.unpack(_U64, "chain count")
    # Every chain record takes at least 28 bytes; checking this first stops a corrupt count from
    # driving a huge loop before the bounds checks notice.
    reader.need(n_chains * 28, "chain records")
    chains = []
    for _ in range(n_chains):
        pdb_id = reader.string("PDB id")
        chain_name = reader.string("chain name")
        offset, size, _start_resnum, *_shift = reader.unpack(_COORD_INFO_TAIL, "chain record")
        chains.append((pdb_id, chain_name, offset, size))

    n_residues, seq_start = reader.array(1, "sequence")
    dssp_start = None
    for name, flag, item_size in _ARRAYS_AFTER_SEQUENCE:
        if flag is not None and not stored_data & flag:
            continue
        count, start = reader.array(item_size, name)
        if count != n_residues:
            raise ValueError(
                f"{path}: corrupt ProMod3 structure database ({name} has {count} elements, expected {n_residues})"
            )
        if flag == _DSSP:
            dssp_start = start
    if reader.pos != reader.size:
        extra = reader.size - reader.pos
        raise ValueError(f"{path}: {extra} unexpected trailing bytes after the ProMod3 structure database")

    # One decode per array, then cheap str slices per chain.
    sequence = data[seq_start : seq_start + n_residues].tobytes().decode("ascii")
    dssp = data[dssp_start : dssp_start + n_residues].tobytes().decode("ascii")
    entries = []
    for pdb_id, chain_name, offset, size in chains:
        if offset + size > n_residues:
            raise ValueError(
                f"{path}: corrupt ProMod3 structure database "
                f"(chain {pdb_id} {chain_name} spans residues {offset}..{offset + size}, only {n_residues} stored)"
            )
        entries.append((pdb_id, chain_name, sequence[offset : offset + size], dssp[offset : offset + size]))
    return entries
