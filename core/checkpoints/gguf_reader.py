"""A GGUF file's metadata and tensor table, read at the speed of its bytes.

The `gguf` package's own reader parses every value through a numpy view of its own: Gemma 3's
vocabulary (262,144 strings, their scores and types) takes it 15 s of a CPU, every time a
process opens the file. Here the same layout (llama.cpp's docs/gguf.md: a header, the key-value
pairs, the tensor table, then the aligned tensor data) is read with `struct` in a fraction of a
second, and each tensor's data stays a view of the memory-mapped file, as `gguf`'s is, in the
form `gguf.quants.dequantize` takes and shaped as `gguf`'s (numpy's order): float32 or float16
values, or a quantized type's bytes, one row of them per row of the tensor.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF's value types: 0-7 and 10-12 are scalars (struct formats), 8 a string, 9 an array.
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: np.ndarray  # in GGUF's order, the innermost dimension first (as `gguf`'s)
    tensor_type: Any  # a gguf.GGMLQuantizationType
    data: np.ndarray


class GGUFFile:
    """`fields`: every metadata key's value (text, number, or a list of them); `types`: each
    key's value type and, for an array, its items' (GGUF's numbers, which a writer needs to
    write the key back as it was); `tensors`: the table, in the file's order. Raises ValueError
    on a file that is not GGUF or is cut short."""

    def __init__(self, path: Path):
        with open(path, "rb") as file:
            self._buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._offset = 0
        if self._buffer[:4] != MAGIC:
            raise ValueError("it does not begin with GGUF's magic bytes")
        version, tensor_count, field_count = self._unpack("<IQQ", 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} predates the 64-bit counts this reader reads")
        self.fields: dict[str, Any] = {}
        self.types: dict[str, tuple[int, int | None]] = {}
        for _ in range(field_count):
            key = self._string()
            (kind,) = self._unpack("<I")
            item = struct.unpack_from("<I", self._buffer, self._offset)[0] if kind == ARRAY else None
            self.types[key] = (kind, item)
            self.fields[key] = self._value(kind)
        table = [self._tensor_entry() for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in table]

    def _unpack(self, layout: str, skip: int = 0) -> tuple:
        self._offset += skip
        try:
            values = struct.unpack_from(layout, self._buffer, self._offset)
        except struct.error:
            raise ValueError(f"it ends inside its metadata, at byte {self._offset}") from None
        self._offset += struct.calcsize(layout)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        end = self._offset + length
        if end > len(self._buffer):
            raise ValueError(f"a text at byte {self._offset} runs past the end of the file")
        text = self._buffer[self._offset : end].decode("utf-8", errors="replace")
        self._offset = end
        return text

    def _value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self._unpack("<" + SCALARS[kind])[0]
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item_kind, count = self._unpack("<IQ")
            if item_kind in SCALARS:  # numbers in one block
                dtype = np.dtype(SCALARS[item_kind]).newbyteorder("<")
                if self._offset + count * dtype.itemsize > len(self._buffer):
                    raise ValueError(f"an array at byte {self._offset} runs past the end of the file")
                values = np.frombuffer(self._buffer, dtype, count, self._offset)
                self._offset += count * dtype.itemsize
                return values.tolist()
            return [self._value(item_kind) for _ in range(count)]
        raise ValueError(f"an unknown value type {kind} at byte {self._offset}")

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (dimensions,) = self._unpack("<I")
        dims = self._unpack(f"<{dimensions}Q")
        kind, offset = self._unpack("<IQ")
        return name, dims, kind, offset

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, start: int) -> Tensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        tensor_type = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        count = int(np.prod(dims))
        size = count // block * block_bytes
        if start + size > len(self._buffer):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = np.frombuffer(self._buffer, np.uint8, size, start)
        shape = tuple(reversed(dims))  # numpy's order: the innermost dimension last
        if tensor_type == GGMLQuantizationType.F32:
            data = data.view(np.float32).reshape(shape)
        elif tensor_type == GGMLQuantizationType.F16:
            data = data.view(np.float16).reshape(shape)
        else:  # a quantized type's bytes, a row of them per row of the tensor
            data = data.reshape(*shape[:-1], shape[-1] // block * block_bytes)
        return Tensor(name, np.asarray(dims), tensor_type, data)
