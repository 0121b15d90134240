"""GGUF files (llama.cpp's format) as checkpoints of the core's decoder, registered with
`core.checkpoints.pretrained`: one family for every architecture a module describes (`core/checkpoints/llama.py`,
`core/checkpoints/gemma.py`), each an `Architecture` registered here.

A GGUF file holds its configuration (`ARCH.*` keys), its tokenizer (`tokenizer.ggml.*`) and its
tensors, quantized or not; `core.checkpoints.gguf_reader` reads all three (the `gguf` package's
reader takes 15 s over Gemma's vocabulary), and `gguf.quants.dequantize` turns the tensors into
float32 numpy arrays shaped as Hugging Face's ([out, in] for a linear
weight). The output layer is the token embedding itself (tied), which a task reads through
`core.model.heads.TiedOutput`; a file with an output matrix of its own is refused.

The tokenizer is rebuilt from the metadata by its kind (`tokenizer.ggml.model`): "gpt2" is a
byte-level BPE (SmolLM2: digits split one by one), "llama" a sentencepiece BPE with byte
fallback (Gemma: its merges follow from the vocabulary's scores). Control tokens are special:
never split, dropped when decoding.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from core.checkpoints.gguf_reader import GGUFFile
from core.checkpoints.pretrained import Checkpoint, Family
from core.checkpoints.rules import Rule
from core.config import ModelConfig
from core.errors import UserError

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values


def stamp(path: Path) -> tuple[int, int]:
    """What the caches below are keyed by beside the path: a file replaced there is read anew."""
    status = path.stat()
    return status.st_size, status.st_mtime_ns


def reader(path: Path) -> GGUFFile:
    """The file's metadata and tensor table (its data memory-mapped); its problems as `UserError`s."""
    return _reader(path, stamp(path))


@functools.cache
def _reader(path: Path, stamp: tuple[int, int]) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (ValueError, KeyError, OSError) as error:
        raise UserError(f"{path} is not a readable GGUF file ({error}); copy or download it again.") from None


def field(path: Path, key: str, default=None):
    """The metadata value `key` of the file; a missing one is an error unless it has a default."""
    found = reader(path).fields.get(key)
    if found is None:
        if default is None:
            raise UserError(f"{path}: the GGUF metadata lacks {key}.")
        return default
    return found


def numpy_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in numpy's order ([out, in] for a linear weight): GGUF lists it reversed."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


class Architecture(abc.ABC):
    """One `general.architecture` of GGUF files: its configuration and its tensors' names."""

    name: str

    @abc.abstractmethod
    def model(self, key: Callable[..., Any]) -> dict[str, Any]:
        """The ModelConfig fields of the architecture, read with `key(name, default=None)`, which
        returns the metadata value `ARCH.name`."""

    def extra_rules(self, layer: int, block: str, prefix: str) -> list[Rule]:
        """The rules of block `layer` beyond the shared ones (`block`: its parameters' path,
        `prefix`: its tensors' name prefix)."""
        return []

    def adjust(self, name: str, value: np.ndarray, model: ModelConfig) -> np.ndarray:
        """A tensor as the core reads it, from the file's convention (llama's permuted rows)."""
        return value

    def restore(self, name: str, value: np.ndarray, model: ModelConfig) -> np.ndarray:
        """`adjust`'s inverse: a tensor in the file's convention, for a file written."""
        return value


ARCHITECTURES: dict[str, Architecture] = {}


def register_architecture(architecture: Architecture) -> None:
    ARCHITECTURES[architecture.name] = architecture


class GGUF(Family):
    name = "gguf"
    decodes = True

    def claims(self, path: Path) -> bool:
        return path.is_file() and path.suffix.lower() == ".gguf"

    def architecture(self, path: Path) -> Architecture:
        name = field(path, "general.architecture")
        if name not in ARCHITECTURES:
            raise UserError(
                f"{path}: a GGUF of the {name!r} architecture, which the core does not build; "
                f"it builds {', '.join(sorted(ARCHITECTURES))}."
            )
        return ARCHITECTURES[name]

    def checkpoint(self, path: Path, name_or_path: str) -> Checkpoint:
        architecture = self.architecture(path)
        key = lambda name, default=None: field(path, f"{architecture.name}.{name}", default)  # noqa: E731
        scaling = key("rope.scaling.type", "none")
        if scaling != "none" and float(key("rope.scaling.factor", 1.0)) != 1.0:
            raise UserError(
                f"{path}: rotary scaling {scaling!r} is not supported; the core applies plain rotary angles."
            )
        heads = int(key("attention.head_count"))
        vocab = int(key("vocab_size", len(field(path, "tokenizer.ggml.tokens"))))
        model = ModelConfig(
            d_model=int(key("embedding_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            mlp_dim=int(key("feed_forward_length")),
            max_len=int(key("context_length")),
            dropout=0.0,
            norm="rmsnorm",
            positions="rotary",
            causal=True,
            norm_epsilon=float(key("attention.layer_norm_rms_epsilon")),
            pretrained=name_or_path,
            **architecture.model(key),
        )
        return Checkpoint(path.parent, path, self.name, architecture.name, model, vocab)

    def tensors(self, checkpoint: Checkpoint) -> dict[str, np.ndarray]:
        """Every tensor dequantized to float32, shaped [out, in], in the core's convention."""
        from gguf.quants import dequantize

        architecture = ARCHITECTURES[checkpoint.family]
        tensors = {}
        for tensor in reader(checkpoint.weights).tensors:
            value = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(numpy_shape(tensor))
            tensors[tensor.name] = architecture.adjust(tensor.name, value, checkpoint.model)
        return tensors

    def shapes(self, checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
        """Every tensor's [out, in] shape from the file's tensor table, nothing dequantized."""
        return {tensor.name: numpy_shape(tensor) for tensor in reader(checkpoint.weights).tensors}

    def rules(self, checkpoint: Checkpoint, names: set[str]) -> list[Rule]:
        if "rope_freqs.weight" in names:
            raise UserError(f"{checkpoint.weights}: per-frequency rotary factors (rope_freqs) are not supported.")
        if "output.weight" in names:
            raise UserError(
                f"{checkpoint.weights} has an output matrix of its own; the core reads GGUF decoders with a tied "
                "output (the embedding table), as SmolLM2 and Gemma 3 have."
            )
        architecture = ARCHITECTURES[checkpoint.family]
        found = [
            Rule("embedder.embedding.embedding", ("token_embd.weight",)),
            Rule("body.final_norm.scale", ("output_norm.weight",)),
        ]
        for i in range(checkpoint.model.num_layers):
            g, b = f"blk.{i}.", f"body.blocks.{i}."
            found += [
                Rule(f"{b}norm1.scale", (f"{g}attn_norm.weight",)),
                Rule(f"{b}attention.qkv.kernel", tuple(f"{g}attn_{p}.weight" for p in "qkv"), "fuse"),
                Rule(f"{b}attention.out.kernel", (f"{g}attn_output.weight",), "transpose"),
                Rule(f"{b}norm2.scale", (f"{g}ffn_norm.weight",)),
                # The core's gated MLP kernel holds the gate's columns, then the up projection's.
                Rule(f"{b}mlp.up.kernel", (f"{g}ffn_gate.weight", f"{g}ffn_up.weight"), "fuse"),
                Rule(f"{b}mlp.down.kernel", (f"{g}ffn_down.weight",), "transpose"),
                *architecture.extra_rules(i, b, g),
            ]
        return found

    def tokenizer_json(self, checkpoint: Checkpoint) -> str:
        path = checkpoint.weights
        kind = field(path, "tokenizer.ggml.model")
        builders = {"gpt2": byte_level_bpe, "llama": sentencepiece_bpe}
        if kind not in builders:
            raise UserError(
                f"{path}: tokenizer.ggml.model {kind!r}; the suite rebuilds {', '.join(builders)} tokenizers."
            )
        tokens, types = field(path, "tokenizer.ggml.tokens"), field(path, "tokenizer.ggml.token_type")
        if len(types) != len(tokens) or len(set(tokens)) != len(tokens):
            raise UserError(f"{path}: the tokenizer's tokens and types disagree, or tokens repeat.")
        try:
            return builders[kind](path, tokens, types).to_str()
        except Exception as error:  # tokenizers reports a bad vocabulary as a plain Exception
            raise UserError(f"{path}: the tokenizer in its metadata does not build ({error}).") from None

    def tokenizer_config(self, checkpoint: Checkpoint) -> dict:
        """The special tokens, whether texts begin with BOS, the chat template and the tokens
        that end a generation (EOS, and the end-of-turn token where the file names one)."""
        path = checkpoint.weights
        tokens = field(path, "tokenizer.ggml.tokens")
        ids = {key: int(field(path, f"tokenizer.ggml.{key}_token_id", -1)) for key in ("bos", "eos", "padding", "eot")}
        ids = {key: value for key, value in ids.items() if 0 <= value < len(tokens)}
        config = {
            f"{key}_token": tokens[ids[name]]
            for key, name in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
            if name in ids
        }
        # llama.cpp's default: a sentencepiece vocabulary adds BOS, a byte-level BPE one does not.
        default = field(path, "tokenizer.ggml.model") == "llama"
        config["add_bos_token"] = bool(field(path, "tokenizer.ggml.add_bos_token", default))
        template = field(path, "tokenizer.chat_template", "")
        if template:
            config["chat_template"] = template
        stops = [ids[key] for key in ("eos", "eot") if key in ids]
        # A chat template's end-of-turn marker ends an answer too (Gemma's <end_of_turn>).
        stops += [i for i, token in enumerate(tokens) if token == "<end_of_turn>" and template]
        config["stop_ids"] = list(dict.fromkeys(stops))
        return config


def byte_level_bpe(path: Path, tokens: list[str], types: list[int]):
    """GPT-2's byte-level BPE with the file's merges, digits split one by one (SmolLM2)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    merges = [tuple(merge.split(" ", 1)) for merge in field(path, "tokenizer.ggml.merges")]
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == CONTROL]
    )
    return tokenizer


def sentencepiece_bpe(path: Path, tokens: list[str], types: list[int]):
    """A sentencepiece BPE vocabulary (Gemma), built to give the ids that Hugging Face's
    conversion of the same file gives (tests/test_gemma.py checks them):

    - spaces reach the model as "▁" (no dummy prefix unless the file asks for one), and the
      tokens made of spaces alone are spelled so;
    - the file holds no merges: they follow from the vocabulary, every split of a token into two
      tokens, ranked by the token's place in the file (its real rank: control and user-defined
      tokens carry a placeholder score), the longer left piece first;
    - characters outside the vocabulary fall back to their bytes (<0xXX> tokens);
    - control tokens are special; user-defined ones (runs of newlines, HTML tags) are matched
      whole in the text, never split.
    """
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: i for i, token in enumerate(spelled)}
    merges = [
        (token[:k], token[k:])
        for token in spelled
        for k in range(len(token) - 1, 0, -1)
        if token[:k] in vocab and token[k:] in vocab
    ]
    unknown = next((t for t, kind in zip(spelled, types) if kind == UNKNOWN), "<unk>" if "<unk>" in vocab else None)
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unknown, fuse_unk=True, byte_fallback=True)
    )
    back = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if field(path, "tokenizer.ggml.add_space_prefix", True):
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tokenizer.decoder = decoders.Sequence([*back, decoders.Strip(content=" ", left=1)])
    else:
        tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
        tokenizer.decoder = decoders.Sequence(back)
    tokenizer.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == CONTROL]
    )
    tokenizer.add_tokens(
        [
            tokenizers.AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == USER_DEFINED and t in vocab
        ]
    )
    return tokenizer


FAMILY = GGUF()
