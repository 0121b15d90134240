"""The benchmarks' model: a GPT-style causal decoder over random tokens, from a shape
(`BenchConfig`) or from a pretrained decoder's checkpoint.

`CausalLM` is no `Task`: it has no data, featurizer, scores or predictions, only what the core's
compiled steps read (`core.task.Trainable`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flax import nnx

from core.config import Config, ModelConfig, OptimConfig, TrainConfig
from core.model.heads import TiedOutput, TokenEmbedder
from core.model.transformer import Model, Transformer
from core.training import losses


@dataclass(frozen=True)
class BenchConfig:
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    seq_len: int
    batch_size: int


@dataclass(frozen=True, kw_only=True)
class CausalLM:
    """Next-token prediction with tied embeddings: token embedder -> the core's body -> the
    embedding again as the output projection (a `core.task.Trainable`)."""

    config: Config
    vocab_size: int

    def model(self, featurizer, config: Config, rngs: nnx.Rngs) -> nnx.Module:
        embedder = TokenEmbedder(self.vocab_size, config.model.d_model, rngs=rngs)
        body = Transformer(config.model, remat=config.train.remat, rngs=rngs)
        return Model(embedder, body, TiedOutput(embedder))

    def loss(self, projection, batch):
        return losses.linear_cross_entropy(projection.hidden, projection.weight, batch["targets"], batch["mask"])

    def metrics(self, projection, batch):
        return {}

    def decode(self, projection, batch):
        return {}

    def augment_on_device(self, batch):
        return batch


def bench_config(bench: BenchConfig, steps: int, kernels: str = "auto") -> Config:
    """The causal decoder of `bench` (learned positions, no dropout) in a run config."""
    return Config(
        task="bench",
        preset="bench",
        model=ModelConfig(
            d_model=bench.d_model,
            num_layers=bench.num_layers,
            num_heads=bench.num_heads,
            mlp_dim=bench.mlp_dim,
            max_len=bench.seq_len,
            dropout=0.0,
            causal=True,
            kernels=kernels,
        ),
        optim=OptimConfig(warmup_steps=1),
        train=TrainConfig(batch_size=bench.batch_size, steps=steps + 2),
    )


def pretrained_lm(
    name: str, max_len: int, batch_size: int, lora_rank: int = 0, matmul_dtype: str = "float32", kernels: str = "auto"
):
    """The pretrained decoder `name` (a shipped name or a file) as a `CausalLM`: its architecture
    with rows of `max_len`, LoRA adapters of `lora_rank` (0: none), products in `matmul_dtype`."""
    from core.checkpoints import pretrained

    config = Config(
        task="bench",
        preset="bench",
        model=dataclasses.replace(pretrained.architecture(name, max_len=max_len), lora_rank=lora_rank, kernels=kernels),
        optim=OptimConfig(warmup_steps=1),
        train=TrainConfig(batch_size=batch_size, steps=100, matmul_dtype=matmul_dtype),
    )
    return CausalLM(config=config, vocab_size=pretrained.read_checkpoint(name).vocab_size)
