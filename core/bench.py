"""Speed of the shared core's jitted train step on a GPT-style decoder (`apps bench`).

For each config the step is compiled, warmed up, then timed over `steps` steps. Reported:
tokens/s, step time, compile time and model FLOPs utilisation

    MFU = (6 N + 12 L d T) FLOPs/token x tokens/s / peak,

where tokens/s comes from the best of the timed steps, N counts the parameters that take part
in matmuls (the tied embedding once, as the output projection; the learned position table,
which is only gathered, is left out), and `peak` is the best f32 throughput that `jnp.dot`
reaches on a 2048^3 product measured in the same run, so that the ratio holds on a noisy machine.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from core import losses
from core.config import Config, ModelConfig, OptimConfig, TrainConfig
from core.errors import UserError
from core.heads import TiedOutput, TokenEmbedder
from core.train import build_model, make_steps


@dataclass(frozen=True)
class BenchConfig:
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    seq_len: int
    batch_size: int


CONFIGS = {
    "small": BenchConfig(8192, 256, 4, 4, 1024, 256, 16),
    "big": BenchConfig(8192, 512, 8, 8, 2048, 512, 8),
}


@dataclass(frozen=True, kw_only=True)
class CausalLM:
    """Next-token prediction over random tokens: just enough task to drive the core's step."""

    config: Config
    vocab_size: int
    data: str | None = None

    def embedder(self, featurizer, rngs):
        return TokenEmbedder(self.vocab_size, self.config.model.d_model, rngs=rngs)

    def head(self, featurizer, embedder, rngs):
        return TiedOutput(embedder)

    def loss(self, projection, batch):
        return losses.linear_cross_entropy(projection.hidden, projection.weight, batch["targets"], batch["mask"])

    def metrics(self, projection, batch):
        return {}

    def decode(self, projection, batch):
        return {}


def run_config(bench: BenchConfig, steps: int) -> dict[str, float]:
    config = Config(
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
        ),
        optim=OptimConfig(warmup_steps=1),
        train=TrainConfig(batch_size=bench.batch_size, steps=steps + 2),
    )
    task = CausalLM(config=config, vocab_size=bench.vocab_size)
    model = build_model(task, None, config)
    compiled = make_steps(task, model, config, config.train.steps)
    params = compiled.state["params"]
    matmul_params = sum(x.size for x in jax.tree.leaves(params)) - bench.seq_len * bench.d_model
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, bench.vocab_size, (bench.batch_size, bench.seq_len + 1), dtype=np.int32)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "mask": np.ones((bench.batch_size, bench.seq_len), bool),
        "weights": np.ones(bench.batch_size, np.float32),
    }
    batch = jax.device_put(
        batch, jax.sharding.NamedSharding(compiled.mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    )
    state = compiled.state
    started = time.perf_counter()
    step = compiled.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - started
    state, logs = step(state, batch)  # warm-up
    jax.block_until_ready(logs)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        state, logs = step(state, batch)
        jax.block_until_ready(logs)
        times.append(time.perf_counter() - started)
    # Best of the timed steps, like the best-of-N peak below: both are what the machine allows
    # when nothing else runs on it; medians wander with the other tenants of a shared CPU.
    step_s = float(np.min(times))
    tokens_per_s = bench.batch_size * bench.seq_len / step_s
    flops_per_token = 6 * matmul_params + 12 * bench.num_layers * bench.d_model * bench.seq_len
    return {
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
        "compile_s": compile_s,
        "flops_per_token": flops_per_token,
        "achieved_flops": flops_per_token * tokens_per_s,
        "params": matmul_params,
    }


def matmul_peak(size: int = 2048, repeats: int = 10) -> float:
    """Best f32 FLOP/s of `jnp.dot` on a size^3 product."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((size, size), np.float32))
    b = jnp.asarray(np.random.default_rng(1).standard_normal((size, size), np.float32))
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    best = np.inf
    for _ in range(repeats):
        started = time.perf_counter()
        dot(a, b).block_until_ready()
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def main(names: list[str], steps: int, console: Console) -> list[dict]:
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise UserError(f"Unknown benchmark config {unknown}; choose from {', '.join(CONFIGS)}.")
    peak = matmul_peak()
    console.print(
        f"jnp.dot 2048^3 f32: {peak / 1e9:.1f} GFLOP/s on {jax.devices()[0].device_kind} x{jax.device_count()}"
    )
    table = Table(title="core train step (f32, AdamW)")
    for column in ("config", "params", "tokens/s", "step ms", "compile s", "GFLOP/s", "MFU"):
        table.add_column(column, justify="right")
    results = []
    for name in names:
        result = run_config(CONFIGS[name], steps)
        result["mfu"] = result["achieved_flops"] / peak
        results.append({"config": name, **dataclasses.asdict(CONFIGS[name]), **result, "peak_flops": peak})
        table.add_row(
            name,
            f"{result['params'] / 1e6:.1f}M",
            f"{result['tokens_per_s']:,.0f}",
            f"{result['step_s'] * 1e3:.0f}",
            f"{result['compile_s']:.1f}",
            f"{result['achieved_flops'] / 1e9:.1f}",
            f"{result['mfu']:.1%}",
        )
    console.print(table)
    return results
