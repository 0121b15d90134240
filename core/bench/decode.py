"""`apps bench decode`: greedy generation (`core.generation.generate.generate`) on random weights.

A 64-token prompt, 128 new tokens, batch 1 and 8, with the KV cache and without it (the full
forward pass over the growing sequence at every token, still one compiled loop). New tokens per
second count the whole call, prefill included, after a warm-up call that compiles; the best of
the timed calls is reported, as for the train step, with their median beside it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from rich.console import Console

from core.bench.causal import BenchConfig, CausalLM, bench_config
from core.bench.timing import figures
from core.bench.train_step import CONFIGS
from core.errors import UserError
from core.generation.generate import generate
from core.training.steps import build_model

# The train benchmark's small decoder, and one of GPT-2 small's shape (124M parameters).
DECODE_MODELS = {"small": CONFIGS["small"], "gpt2": BenchConfig(50257, 768, 12, 12, 3072, 1024, 1)}
PROMPT_TOKENS, NEW_TOKENS = 64, 128


@dataclass(frozen=True)
class DecodeRun:
    model: str
    batch_size: int
    use_cache: bool
    calls: int = 3


DECODE_RUNS = (
    DecodeRun("small", 1, True),
    DecodeRun("small", 8, True),
    DecodeRun("small", 1, False),
    DecodeRun("small", 8, False),
    DecodeRun("gpt2", 1, True),
    DecodeRun("gpt2", 8, True),
    # Without a cache GPT-2 recomputes about 6 TFLOP per call at batch 1: one timed call.
    DecodeRun("gpt2", 1, False, calls=1),
)


def run_decode(run: DecodeRun) -> dict[str, float]:
    """Greedy generation on random weights: new tokens per second over whole calls."""
    bench = DECODE_MODELS[run.model]
    config = bench_config(bench, 1)
    model = build_model(CausalLM(config=config, vocab_size=bench.vocab_size), None, config)
    return time_generation(model, bench.vocab_size, run.batch_size, run.use_cache, run.calls)


def time_generation(model, vocab_size: int, batch_size: int, use_cache: bool = True, calls: int = 3) -> dict:
    """New tokens per second of greedy `generate` calls (64-token prompts, 128 new tokens)
    after a warm-up call that compiles: the best call and the median; and the rate after the
    prompt (llama-bench's tg): the tokens after each row's first over the best call's time less
    the best time of calls that stop at the first token (the prompt's forward pass and one
    token)."""
    prompts = np.random.default_rng(0).integers(0, vocab_size, (batch_size, PROMPT_TOKENS))

    def call(new_tokens: int = NEW_TOKENS) -> tuple[float, int]:
        started = time.perf_counter()
        result = generate(model, prompts, max_new_tokens=new_tokens, use_cache=use_cache)
        return time.perf_counter() - started, int(result.lengths.sum())

    first, _ = call()
    times, counts = zip(*(call() for _ in range(calls)))
    call(1)
    prompt_s = min(call(1)[0] for _ in range(calls))
    return {
        "params": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "new_tokens": counts[0],
        "new_tokens_per_s": counts[0] / min(times),
        "median_new_tokens_per_s": counts[0] / float(np.median(times)),
        "after_prompt_tokens_per_s": (counts[0] - batch_size) / (min(times) - prompt_s),
        "call_s": min(times),
        "prompt_s": prompt_s,
        "compile_s": first - min(times),
    }


def decode(models: Sequence[str], console: Console) -> list[dict]:
    """The decode runs of the named models (`DECODE_MODELS`; all of them if none is named), in
    one table."""
    unknown = [name for name in models if name not in DECODE_MODELS]
    if unknown:
        raise UserError(f"Unknown decode model {', '.join(unknown)}; choose from {', '.join(DECODE_MODELS)}.")
    table = figures(
        title=f"greedy decoding (f32), {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens, "
        f"on {jax.devices()[0].device_kind}",
        caption="new tok/s: new tokens over the whole call, prefill included, best of the timed calls "
        "(median beside it); after prompt: the tokens after each row's first over the call less a call that "
        "stops there (llama-bench's tg); no cache: the full forward pass again at every token. Times in s.",
        columns=("model", "params", "batch", "cache", "new tok/s", "median", "after prompt", "call", "compile"),
    )
    results = []
    for run in [run for run in DECODE_RUNS if not models or run.model in models]:
        result = run_decode(run)
        results.append({**dataclasses.asdict(run), **result})
        table.add_row(
            run.model,
            f"{result['params'] / 1e6:.1f}M",
            str(run.batch_size),
            "on" if run.use_cache else "off",
            f"{result['new_tokens_per_s']:,.0f}",
            f"{result['median_new_tokens_per_s']:,.0f}",
            f"{result['after_prompt_tokens_per_s']:,.0f}",
            f"{result['call_s']:.2f}",
            f"{result['compile_s']:.1f}",
        )
    console.print(table)
    return results
