"""`apps bench train`: the core's jitted train step on a GPT-style decoder, compiled ahead of
time, warmed up, then timed over `steps` steps.

Reported: tokens/s, step time, compile time and model FLOPs utilisation, with the model FLOPs
of `core.bench.flops` (6 N + 12 L d T per token, causal attention counted at half; N counts the
parameters that take part in products: the tied embedding once, as the output projection, the
learned position table, only gathered, left out):

- MFU (chip): against the chip's published bfloat16 peak (`core.bench.flops.chip_peak`; none on
  a CPU);
- MFU (dot): against the best that `jnp.dot` sustains here in the step's products' dtype
  (`core.bench.timing.MatmulPeak`), measured like the step: after each timed step, products
  run back to back for as long as that step took, and the best such stretch counts, so that
  both best-ofs come from the same minutes and from stretches of the same length (a shared
  CPU's speed drifts by a third from one minute to the next).

Tokens/s comes from the best of the timed steps. The products run in the run's default dtype:
bfloat16 on an accelerator, float32 on a CPU (`train.matmul_dtype`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np
from rich.console import Console

from core.bench.causal import BenchConfig, CausalLM, bench_config
from core.bench.flops import chip_peak, device_record, train_flops_per_token
from core.bench.timing import MatmulPeak, figures, timed_steps, token_batch
from core.errors import UserError
from core.model.precision import chosen_products
from core.training.steps import build_model, make_steps

CONFIGS = {
    "small": BenchConfig(8192, 256, 4, 4, 1024, 256, 16),
    "big": BenchConfig(8192, 512, 8, 8, 2048, 512, 8),
}


def run_config(bench: BenchConfig, steps: int, kernels: str = "auto") -> dict[str, float]:
    """The figures of the module's text for one decoder shape, with `kernels` (`model.kernels`)."""
    config = bench_config(bench, steps, kernels)
    task = CausalLM(config=config, vocab_size=bench.vocab_size)
    compiled = make_steps(task, build_model(task, None, config), config, config.train.steps)
    params = compiled.state["params"]
    matmul_params = sum(x.size for x in jax.tree.leaves(params)) - bench.seq_len * bench.d_model
    batch = token_batch(compiled.mesh, bench.batch_size, bench.seq_len, bench.vocab_size)
    started = time.perf_counter()
    step = compiled.train_step.compiled(compiled.state, batch)
    compile_s = time.perf_counter() - started
    peak = MatmulPeak.for_products(chosen_products(config.train.matmul_dtype))
    timed = timed_steps(step, compiled.state, [batch], steps, after_each=peak.sample)
    # Best of the timed steps, like the peak: both are what the machine allows when nothing
    # else runs on it; medians wander with the other tenants of a shared CPU.
    step_s = float(np.min(timed.times))
    tokens_per_s = bench.batch_size * bench.seq_len / step_s
    per_token = train_flops_per_token(matmul_params, bench.num_layers, bench.d_model, bench.seq_len, causal=True)
    achieved = per_token * tokens_per_s
    chip = chip_peak()
    return {
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
        "compile_s": compile_s,
        "flops_per_token": per_token,
        "achieved_flops": achieved,
        "params": matmul_params,
        "products": peak.dtype,
        "peak_flops": peak.best,
        "mfu": achieved / peak.best,
        "chip_peak_flops": chip,
        "mfu_chip": None if chip is None else achieved / chip,
        "burst_flops": peak.burst,
    }


def train(names: Sequence[str], steps: int, console: Console, kernels: str = "auto") -> list[dict]:
    """The train step of each named config (`CONFIGS`; all of them if none is named), timed
    over `steps` steps, in one table."""
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        raise UserError(f"Unknown train config {', '.join(unknown)}; choose from {', '.join(CONFIGS)}.")
    if steps < 1:
        raise UserError(f"--steps {steps}: time at least 1 step.")
    table = figures(
        title=f"core train step (AdamW) on {jax.devices()[0].device_kind} x{jax.device_count()}",
        caption="TFLOP/s: model FLOPs (6N + 12LdT, causal attention at half) x tok/s. dot: jnp.dot 2048^3 (CPU) "
        "or 8192^3 (accelerators) in the products' dtype, sustained over step-long stretches between the steps. "
        "MFU dot = TFLOP/s / dot; MFU chip = TFLOP/s / the chip's published bf16 peak. Compile in s.",
        columns=("config", "params", "products", "tok/s", "ms/step", "compile", "TFLOP/s", "dot", "MFU dot")
        + ("MFU chip",),
    )
    results = []
    for name in names or list(CONFIGS):
        result = run_config(CONFIGS[name], steps, kernels)
        record = {"config": name, **dataclasses.asdict(CONFIGS[name]), **result, "kernels": kernels, **device_record()}
        results.append(record)
        table.add_row(
            name,
            f"{result['params'] / 1e6:.1f}M",
            result["products"],
            f"{result['tokens_per_s']:,.0f}",
            f"{result['step_s'] * 1e3:.0f}",
            f"{result['compile_s']:.1f}",
            f"{result['achieved_flops'] / 1e12:.3g}",
            f"{result['peak_flops'] / 1e12:.3g}",
            f"{result['mfu']:.1%}",
            "-" if result["mfu_chip"] is None else f"{result['mfu_chip']:.1%}",
        )
    console.print(table)
    return results
