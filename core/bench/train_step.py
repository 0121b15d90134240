"""`apps bench train`: the core's jitted train step on a GPT-style decoder, compiled ahead of
time, warmed up, then timed over `steps` steps.

Reported: tokens/s, step time, compile time and model FLOPs utilisation

    MFU = (6 N + 12 L d T f) FLOPs/token x tokens/s / peak,

where f is the share of the T x T attention scores that the kernel computes (the blockwise CPU
kernel skips the causal blocks above the diagonal: f = 5/8 at four blocks; "MFU model" counts
them all, f = 1), tokens/s comes from the best of the timed steps, N counts the parameters that take part
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
from collections.abc import Sequence

import jax
import numpy as np
from rich.console import Console

from core.bench.causal import BenchConfig, CausalLM, bench_config
from core.bench.timing import MatmulPeak, figures, timed_steps, token_batch
from core.errors import UserError
from core.model.attention import score_fraction
from core.training.steps import build_model, make_steps

CONFIGS = {
    "small": BenchConfig(8192, 256, 4, 4, 1024, 256, 16),
    "big": BenchConfig(8192, 512, 8, 8, 2048, 512, 8),
}


def run_config(bench: BenchConfig, steps: int) -> dict[str, float]:
    """The figures of the module's text for one decoder shape."""
    config = bench_config(bench, steps)
    task = CausalLM(config=config, vocab_size=bench.vocab_size)
    compiled = make_steps(task, build_model(task, None, config), config, config.train.steps)
    params = compiled.state["params"]
    matmul_params = sum(x.size for x in jax.tree.leaves(params)) - bench.seq_len * bench.d_model
    batch = token_batch(compiled.mesh, bench.batch_size, bench.seq_len, bench.vocab_size)
    started = time.perf_counter()
    step = compiled.train_step.compiled(compiled.state, batch)
    compile_s = time.perf_counter() - started
    peak = MatmulPeak()
    timed = timed_steps(step, compiled.state, [batch], steps, after_each=peak.sample)
    # Best of the timed steps, like the peak: both are what the machine allows when nothing
    # else runs on it; medians wander with the other tenants of a shared CPU.
    step_s = float(np.min(timed.times))
    tokens_per_s = bench.batch_size * bench.seq_len / step_s
    attention_flops = 12 * bench.num_layers * bench.d_model * bench.seq_len
    model_flops_per_token = 6 * matmul_params + attention_flops
    # What the kernel runs: the blockwise kernel skips the causal blocks above the diagonal.
    fraction = score_fraction(bench.seq_len, True, config.model.attention)
    flops_per_token = 6 * matmul_params + attention_flops * fraction
    achieved = flops_per_token * tokens_per_s
    return {
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
        "compile_s": compile_s,
        "flops_per_token": flops_per_token,
        "model_flops_per_token": model_flops_per_token,
        "achieved_flops": achieved,
        "params": matmul_params,
        "peak_flops": peak.best,
        "mfu": achieved / peak.best,
        "mfu_model": model_flops_per_token * tokens_per_s / peak.best,
        "burst_flops": peak.burst,
        "mfu_burst": achieved / peak.burst,
    }


def train(names: Sequence[str], steps: int, console: Console) -> list[dict]:
    """The train step of each named config (`CONFIGS`; all of them if none is named), timed
    over `steps` steps, in one table."""
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        raise UserError(f"Unknown train config {', '.join(unknown)}; choose from {', '.join(CONFIGS)}.")
    if steps < 1:
        raise UserError(f"--steps {steps}: time at least 1 step.")
    table = figures(
        title=f"core train step (f32, AdamW) on {jax.devices()[0].device_kind} x{jax.device_count()}",
        caption="GFLOP/s: the FLOPs executed (6N + 12LdT x the share of attention scores the kernel computes). "
        "dot: jnp.dot 2048^3 f32 GFLOP/s, sustained over step-long stretches between the steps; "
        "burst: its best single product. MFU = GFLOP/s / dot; MFU model: 6N + 12LdT in full / dot; "
        "MFU/b = GFLOP/s / burst. Compile in s.",
        columns=("config", "params", "tok/s", "ms/step", "compile", "GFLOP/s", "dot", "MFU", "MFU model")
        + ("burst", "MFU/b"),
    )
    results = []
    for name in names or list(CONFIGS):
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
            f"{result['mfu_model']:.1%}",
            f"{result['burst_flops'] / 1e9:.1f}",
            f"{result['mfu_burst']:.1%}",
        )
    console.print(table)
    return results
