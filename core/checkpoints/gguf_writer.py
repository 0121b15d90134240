"""GGUF files written: a decoder's tensors under a source file's metadata, with the `gguf`
package's writer and quantizer (llama.cpp's own Python library).

The metadata (architecture keys, tokenizer, chat template) is the source file's, key by key
with its value types (`GGUFFile.types`): a fine-tuned model has its base's configuration and
vocabulary. What describes the tensors is written anew: `general.file_type` (llama.cpp's
`LLAMA_FTYPE_*` of the chosen type) and `general.quantization_version`.

Types follow llama.cpp's converter: vectors (norm weights, biases) stay float32, every matrix
takes the chosen type; Q8_0 (blocks of 32 int8 values and one float16 scale) needs rows whose
length is a multiple of 32, and a matrix whose rows are not is written in float16.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from core.checkpoints.gguf_reader import GGUFFile
from core.errors import UserError

# --dtype -> (GGML's tensor type name, llama.cpp's general.file_type).
DTYPES = {"float32": ("F32", 0), "float16": ("F16", 1), "bfloat16": ("BF16", 32), "q8_0": ("Q8_0", 7)}
# Keys that describe the tensors or the layout, written by the writer itself or anew.
WRITTEN_ANEW = ("general.architecture", "general.alignment", "general.file_type", "general.quantization_version")
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: a GGUF file holds {', '.join(DTYPES)}.")


def encoded(value: np.ndarray, dtype: str):
    """(the tensor's data as the writer takes it, its GGML type) for a float32 tensor in `dtype`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    kind = GGMLQuantizationType[DTYPES[dtype][0]]
    if value.ndim < 2 or kind == GGMLQuantizationType.F32:
        return np.ascontiguousarray(value, np.float32), GGMLQuantizationType.F32
    if kind == GGMLQuantizationType.F16 or value.shape[-1] % GGML_QUANT_SIZES[kind][0]:
        return value.astype(np.float16), GGMLQuantizationType.F16
    return quantize(np.ascontiguousarray(value, np.float32), kind), kind


def write(path: Path, source: GGUFFile, tensors: Mapping[str, np.ndarray], dtype: str) -> None:
    """A GGUF file at `path` of `tensors` (float32, [out, in]) in `dtype`, under `source`'s metadata."""
    from gguf import GGUFValueType, GGUFWriter

    check_dtype(dtype)
    writer = GGUFWriter(path, source.fields["general.architecture"])
    for key, value in source.fields.items():
        if key in WRITTEN_ANEW:
            continue
        kind, item = source.types[key]
        writer.add_key_value(key, value, GGUFValueType(kind), None if item is None else GGUFValueType(item))
    writer.add_uint32("general.file_type", DTYPES[dtype][1])
    writer.add_uint32("general.quantization_version", QUANTIZATION_VERSION)  # as llama.cpp's converter, always
    for name, value in tensors.items():
        data, kind = encoded(value, dtype)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
