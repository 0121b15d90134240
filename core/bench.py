"""Speed of the shared core's jitted train step on a GPT-style decoder (`apps bench`).

For each config the step is compiled, warmed up, then timed over `steps` steps. Reported:
tokens/s, step time, compile time and model FLOPs utilisation

    MFU = (6 N + 12 L d T) FLOPs/token x tokens/s / peak,

where tokens/s comes from the best of the timed steps, N counts the parameters that take part
in matmuls (the tied embedding once, as the output projection; the learned position table,
which is only gathered, is left out), and `peak` is the best f32 throughput that `jnp.dot`
reaches on 2048^3 products. The peak is measured like the step: after each timed step, dots
run back to back for as long as that step took, and the best such stretch counts. Both
best-ofs then come from the same minutes and from stretches of the same length: a shared CPU's
speed drifts by a third from one minute to the next, and a 0.1 s product catches quiet moments
that a several-second step cannot, which would skew the ratio. For comparison the table also
gives the best single product ("burst") and the MFU against it, the stricter figure.
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
    peak = MatmulPeak()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        state, logs = step(state, batch)
        jax.block_until_ready(logs)
        times.append(time.perf_counter() - started)
        peak.sample(seconds=times[-1])
    # Best of the timed steps, like the peak: both are what the machine allows when nothing
    # else runs on it; medians wander with the other tenants of a shared CPU.
    step_s = float(np.min(times))
    tokens_per_s = bench.batch_size * bench.seq_len / step_s
    flops_per_token = 6 * matmul_params + 12 * bench.num_layers * bench.d_model * bench.seq_len
    achieved = flops_per_token * tokens_per_s
    return {
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
        "compile_s": compile_s,
        "flops_per_token": flops_per_token,
        "achieved_flops": achieved,
        "params": matmul_params,
        "peak_flops": peak.best,
        "mfu": achieved / peak.best,
        "burst_flops": peak.burst,
        "mfu_burst": achieved / peak.burst,
    }


class MatmulPeak:
    """The best f32 FLOP/s that `jnp.dot` sustains on size^3 products, over all samples."""

    def __init__(self, size: int = 2048):
        rng = np.random.default_rng(0)
        self.a, self.b = (jnp.asarray(rng.standard_normal((size, size), np.float32)) for _ in range(2))
        self.dot = jax.jit(jnp.dot)
        self.dot(self.a, self.b).block_until_ready()
        self.flops = 2 * size**3
        self.best = 0.0  # sustained: the best mean rate of a sample
        self.burst = 0.0  # the best single product

    def sample(self, seconds: float) -> None:
        """Products back to back for about `seconds`; their mean rate is one sample."""
        started = time.perf_counter()
        count, now = 0, started
        while count == 0 or now - started < seconds:
            self.dot(self.a, self.b).block_until_ready()
            count, last = count + 1, now
            now = time.perf_counter()
            self.burst = max(self.burst, self.flops / (now - last))
        self.best = max(self.best, count * self.flops / (now - started))


def main(names: list[str], steps: int, console: Console) -> list[dict]:
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise UserError(f"Unknown benchmark config {unknown}; choose from {', '.join(CONFIGS)}.")
    device = jax.devices()[0].device_kind
    table = Table(
        title=f"core train step (f32, AdamW) on {device} x{jax.device_count()}",
        caption="dot: jnp.dot 2048^3 f32 GFLOP/s, sustained over step-long stretches between the steps; "
        "burst: its best single product. MFU = GFLOP/s / dot; MFU/b = GFLOP/s / burst. Compile in s.",
    )
    columns = ("config", "params", "tok/s", "ms/step", "compile", "GFLOP/s", "dot", "MFU", "burst", "MFU/b")
    for column in columns:
        table.add_column(column, justify="right")
    results = []
    for name in names:
        result = run_config(CONFIGS[name], steps)
        results.append({"config": name, **dataclasses.asdict(CONFIGS[name]), **result})
        table.add_row(
            name,
            f"{result['params'] / 1e6:.1f}M",
            f"{result['tokens_per_s']:,.0f}",
            f"{result['step_s'] * 1e3:.0f}",
            f"{result['compile_s']:.1f}",
            f"{result['achieved_flops'] / 1e9:.1f}",
            f"{result['peak_flops'] / 1e9:.1f}",
            f"{result['mfu']:.1%}",
            f"{result['burst_flops'] / 1e9:.1f}",
            f"{result['mfu_burst']:.1%}",
        )
    console.print(table)
    return results
