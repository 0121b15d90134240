"""Hugging Face decoder folders as the core's causal Transformer, registered with `core.checkpoints.pretrained`:
a folder with config.json (`LlamaForCausalLM`, `Qwen2ForCausalLM` or `Gemma3ForCausalLM`),
model.safetensors and tokenizer.json (tokenizer_config.json and generation_config.json, where
present, give the special tokens, the chat template and the stop tokens).

The same blocks as the GGUF files of those architectures (core/checkpoints/gguf_files.py), read from
Hugging Face's names: `model.layers.{i}.self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`,
the norms; queries and keys in Hugging Face's half-split rotary order already. Qwen2 adds biases
to the query, key and value projections; Gemma 3 stores its norm weights as w for x * (1 + w)
(the GGUF as 1 + w), read with a `one_plus` rule. The output is tied to the embedding table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from core.checkpoints.pretrained import Checkpoint, Family, folder_config, register
from core.checkpoints.rules import Rule
from core.config import ModelConfig
from core.errors import UserError

# config.json's architectures -> (model_type, its MLP).
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "swiglu"),
    "Qwen2ForCausalLM": ("qwen2", "swiglu"),
    "Gemma3ForCausalLM": ("gemma3_text", "geglu"),
}
ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu"}


def _architecture(config: dict) -> str | None:
    return next((name for name in config.get("architectures") or () if name in ARCHITECTURES), None)


def _plain_rotary(config: dict, path: Path) -> None:
    """Refuses a folder whose rotary angles are scaled (Llama 3.1's "llama3", YaRN, linear ...)."""
    parameters = config.get("rope_parameters") or {}
    kinds = [parameters.get("rope_type")] + [p.get("rope_type") for p in parameters.values() if isinstance(p, dict)]
    scaling = config.get("rope_scaling") or {}
    kinds.append(scaling.get("rope_type") or scaling.get("type"))
    unsupported = sorted({kind for kind in kinds if kind not in (None, "default")})
    if unsupported:
        raise UserError(
            f"{path}: rotary scaling {', '.join(unsupported)} is not supported; the core applies plain angles."
        )


def _rope_base(config: dict, layer_type: str | None = None) -> float | None:
    """The rotary base of config.json, as transformers 4 (`rope_theta`, Gemma's
    `rope_local_base_freq`) or 5 (`rope_parameters`, per layer type where it has several) write it."""
    parameters = config.get("rope_parameters") or {}
    if layer_type is not None and isinstance(parameters.get(layer_type), dict):
        parameters = parameters[layer_type]
    if "rope_theta" in parameters:
        return float(parameters["rope_theta"])
    if layer_type == "sliding_attention" and "rope_local_base_freq" in config:
        return float(config["rope_local_base_freq"])
    return float(config["rope_theta"]) if "rope_theta" in config else None


class HFDecoder(Family):
    name = "hf-decoder"
    decodes = True

    def claims(self, path: Path) -> bool:
        config = folder_config(path)
        return config is not None and _architecture(config) is not None

    def checkpoint(self, directory: Path, name_or_path: str) -> Checkpoint:
        path, raw = directory / "config.json", folder_config(directory)
        architecture = _architecture(raw)
        family, mlp = ARCHITECTURES[architecture]
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [key for key in (*keys, "max_position_embeddings") if not isinstance(raw.get(key), int)]
        if missing:
            raise UserError(f"{path} lacks the integer fields {', '.join(missing)}.")
        if not raw.get("tie_word_embeddings", family == "gemma3_text"):
            raise UserError(
                f"{path}: tie_word_embeddings is false; the core reads decoders whose output is the embedding table."
            )
        activation = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
        if ACTIVATIONS.get(activation) != mlp:
            raise UserError(f"{path}: {architecture} with hidden activation {activation!r} is not supported.")
        _plain_rotary(raw, path)
        heads = raw["num_attention_heads"]
        fields: dict[str, Any] = {}
        if family == "gemma3_text":
            fields = self._gemma3(raw, path)
        elif family == "qwen2":
            fields["qkv_bias"] = True
            if raw.get("use_sliding_window"):
                raise UserError(f"{path}: use_sliding_window is true; the core reads Qwen2 with full attention.")
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise UserError(f"{path}: attention_bias / mlp_bias are not supported for {architecture}.")
        model = ModelConfig(
            d_model=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            mlp_dim=raw["intermediate_size"],
            max_len=raw["max_position_embeddings"],
            dropout=0.0,
            norm="rmsnorm",
            mlp=mlp,
            positions="rotary",
            rope_base=_rope_base(raw, "full_attention") or 10_000.0,
            causal=True,
            norm_epsilon=float(raw.get("rms_norm_eps", 1e-6)),
            pretrained=name_or_path,
            **fields,
        )
        return Checkpoint(directory, directory / "model.safetensors", self.name, family, model, raw["vocab_size"])

    @staticmethod
    def _gemma3(raw: dict, path: Path) -> dict[str, Any]:
        head = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        if raw.get("query_pre_attn_scalar", head) != head:
            raise UserError(
                f"{path}: query_pre_attn_scalar {raw['query_pre_attn_scalar']} differs from head_dim {head}."
            )
        if raw.get("final_logit_softcapping") or raw.get("attn_logit_softcapping"):
            raise UserError(f"{path}: logit soft-capping is not supported.")
        layer_types = raw.get("layer_types") or [
            "full_attention" if (i + 1) % raw.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
            for i in range(raw["num_hidden_layers"])
        ]
        globals_ = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
        every = globals_[0] + 1 if globals_ else 0
        if every and [i for i in range(len(layer_types)) if (i + 1) % every == 0] != globals_:
            raise UserError(f"{path}: layer_types is not a repeating pattern of sliding layers then a global one.")
        return {
            "head_size": head,
            "qk_norm": True,
            "norm_position": "sandwich",
            "embedding_scale": True,
            "sliding_window": int(raw.get("sliding_window") or 0) if len(globals_) < len(layer_types) else 0,
            "global_every": every,
            "rope_local_base": _rope_base(raw, "sliding_attention"),
        }

    def rules(self, checkpoint: Checkpoint, names: set[str]) -> list[Rule]:
        gemma = checkpoint.family == "gemma3_text"
        norm = "one_plus" if gemma else "copy"
        found = [
            Rule("embedder.embedding.embedding", ("model.embed_tokens.weight",)),
            Rule("body.final_norm.scale", ("model.norm.weight",), norm),
        ]
        for i in range(checkpoint.model.num_layers):
            h, b = f"model.layers.{i}.", f"body.blocks.{i}."
            attention = f"{h}self_attn."
            found += [
                Rule(f"{b}norm1.scale", (f"{h}input_layernorm.weight",), norm),
                Rule(f"{b}attention.qkv.kernel", tuple(f"{attention}{p}_proj.weight" for p in "qkv"), "fuse"),
                Rule(f"{b}attention.out.kernel", (f"{attention}o_proj.weight",), "transpose"),
                Rule(f"{b}mlp.up.kernel", (f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"), "fuse"),
                Rule(f"{b}mlp.down.kernel", (f"{h}mlp.down_proj.weight",), "transpose"),
            ]
            if checkpoint.model.qkv_bias:
                found.append(Rule(f"{b}attention.qkv.bias", tuple(f"{attention}{p}_proj.bias" for p in "qkv"), "fuse"))
            if gemma:
                found += [
                    Rule(f"{b}attention.q_norm.scale", (f"{attention}q_norm.weight",), norm),
                    Rule(f"{b}attention.k_norm.scale", (f"{attention}k_norm.weight",), norm),
                    Rule(f"{b}out_norm1.scale", (f"{h}post_attention_layernorm.weight",), norm),
                    Rule(f"{b}norm2.scale", (f"{h}pre_feedforward_layernorm.weight",), norm),
                    Rule(f"{b}out_norm2.scale", (f"{h}post_feedforward_layernorm.weight",), norm),
                ]
            else:
                # Llama's "post attention" norm is the MLP's input norm.
                found.append(Rule(f"{b}norm2.scale", (f"{h}post_attention_layernorm.weight",)))
        return found


def config_json(model: ModelConfig, model_type: str, vocab_size: int, special: dict[str, int]) -> dict[str, Any]:
    """config.json of a decoder of `model_type` ("llama", "qwen2" or "gemma3_text") with
    `model`'s architecture: `HFDecoder.checkpoint`'s inverse. `special`: the ids of bos_token,
    eos_token and pad_token, where the tokenizer has them."""
    architecture = next(name for name, (kind, _) in ARCHITECTURES.items() if kind == model_type)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": model.d_model,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.key_value_heads,
        "head_dim": model.head_dim,
        "intermediate_size": model.mlp_dim,
        "max_position_embeddings": model.max_len,
        "rms_norm_eps": float(str(np.float32(model.norm_epsilon))),  # the shortest float32 text: 1e-05
        "rope_theta": model.rope_base,
        "tie_word_embeddings": True,
        "attention_bias": False,
        **{f"{key}_id": value for key, value in special.items()},
    }
    if model_type == "gemma3_text":
        every = model.global_every
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=model.head_dim,
            sliding_window=model.sliding_window or None,
            rope_local_base_freq=model.rope_local_base or model.rope_base,
            layer_types=[
                "full_attention"
                if not model.sliding_window or (every and (i + 1) % every == 0)
                else "sliding_attention"
                for i in range(model.num_layers)
            ],
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
    else:
        config.update(hidden_act="silu", mlp_bias=False)
    if model_type == "qwen2":
        config.update(attention_bias=True, use_sliding_window=False)
    return config


register(HFDecoder())
