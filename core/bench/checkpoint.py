"""`apps bench decode --model NAME` and `apps bench finetune --model NAME`: a pretrained
decoder's speed.

Decoding: greedy, batch 1 and 8, with float32, bfloat16, int8 and int4 weights (as
`core.bench.decode` times it). Fine-tuning: its train step, every weight and LoRA, at 4 rows
of 512 tokens, with float32 products and with bfloat16 ones (`train.matmul_dtype`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx
from rich.console import Console

from core.bench.causal import pretrained_lm
from core.bench.decode import NEW_TOKENS, PROMPT_TOKENS, time_generation
from core.bench.flops import chip_peak, device_record, train_flops_per_token
from core.bench.timing import figures, timed_steps, token_batch
from core.errors import UserError
from core.model.precision import narrowed
from core.training.steps import build_model, make_steps

PRETRAINED_DECODE = tuple((batch, dtype) for dtype in ("float32", "bfloat16", "int8", "int4") for batch in (1, 8))
FINETUNE_BATCH, FINETUNE_LEN, LORA_RANK = 4, 512, 16
FINETUNE_RUNS = ((0, "float32"), (0, "bfloat16"), (LORA_RANK, "float32"), (LORA_RANK, "bfloat16"))


def decode(name: str, console: Console) -> list[dict]:
    """Decoding speed of the checkpoint `name` at each of `PRETRAINED_DECODE`, in one table."""
    task = pretrained_lm(name, PROMPT_TOKENS + NEW_TOKENS, FINETUNE_BATCH)
    model = build_model(task, None, task.config, from_pretrained=True)
    table = figures(
        title=f"{name}: greedy decoding, {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens",
        caption="new tok/s over the whole call, prefill included, best of 3 calls (median beside it); after "
        "prompt: the tokens after each row's first over the call less a call that stops there (llama-bench's tg); "
        "bfloat16: the linear layers' weights in bfloat16, multiplied in bfloat16 with float32 sums; "
        "int8: those and the token table in int8, a scale per output, multiplied in int8 with int32 sums "
        "(core.model.quantized); int4: the linear layers' weights in four bits, groups of 32 with a float16 scale "
        "and offset, multiplied by our kernel (core.model.int4), the table int8; the activations "
        "and cache in float32.",
        columns=("weights", "batch", "new tok/s", "median", "after prompt", "call s", "compile s"),
    )
    results = []
    graphdef, params = nnx.split(model)
    for batch_size, dtype in PRETRAINED_DECODE:
        try:
            weights = narrowed(params, dtype)
        except UserError as refused:  # int4 where no int4 kernel runs
            table.add_row(dtype, str(batch_size), "refused", "", "", "", "")
            console.print(f"{dtype}: {refused}")
            continue
        result = time_generation(nnx.merge(graphdef, weights), task.vocab_size, batch_size)
        results.append({"model": name, "batch_size": batch_size, "dtype": dtype, **result})
        table.add_row(
            dtype,
            str(batch_size),
            f"{result['new_tokens_per_s']:,.1f}",
            f"{result['median_new_tokens_per_s']:,.1f}",
            f"{result['after_prompt_tokens_per_s']:,.1f}",
            f"{result['call_s']:.2f}",
            f"{result['compile_s']:.1f}",
        )
    console.print(table)
    return results


def finetune(
    name: str,
    steps: int,
    console: Console,
    rows: int = FINETUNE_BATCH,
    length: int = FINETUNE_LEN,
    remat: bool = False,
    kernels: str = "auto",
) -> list[dict]:
    """Fine-tuning speed of the checkpoint `name` at each of `FINETUNE_RUNS`, `rows` rows of
    `length` tokens (`remat`: blocks recomputed in the backward pass), timed over `steps` steps
    after one that compiles, in one table with the MFU of `core.bench.flops`."""
    if steps < 1 or rows < 1 or length < 2:
        raise UserError(f"--steps {steps}, --rows {rows}, --length {length}: at least 1 step, 1 row of 2 tokens.")
    table = figures(
        title=f"{name}: a fine-tuning step (AdamW, float32 weights), {rows} rows of {length} tokens"
        + (", remat" if remat else ""),
        caption="tok/s: training tokens a second, best of the timed steps (median beside it); products: "
        "train.matmul_dtype, bfloat16 multiplying the float32 weights and activations with float32 sums; "
        "MFU: model FLOPs (6N + 12LdT, causal attention at half) x tok/s over the chip's bf16 peak.",
        columns=("weights trained", "products", "tok/s", "median", "ms/step", "compile s", "MFU"),
    )
    results = []
    # The rows divide over the devices (tests simulate 8).
    rows = -(-rows // jax.device_count()) * jax.device_count()
    for rank, products in FINETUNE_RUNS:
        result = _finetune_run(name, steps, rows, length, rank, products, remat, kernels)
        results.append(result)
        label = "all" if rank == 0 else f"LoRA r{rank}"
        mfu = "-" if result["mfu_chip"] is None else f"{result['mfu_chip']:.1%}"
        speed = (f"{result['tokens_per_s']:,.0f}", f"{result['median']:,.0f}", f"{result['step_s'] * 1e3:,.0f}")
        table.add_row(label, products, *speed, f"{result['compile_s']:.1f}", mfu)
    console.print(table)
    return results


def _finetune_run(name, steps: int, rows: int, length: int, rank: int, products: str, remat: bool, kernels) -> dict:
    """One row of `finetune`'s table: its figures and where it ran."""
    task = pretrained_lm(name, length, rows, rank, products, kernels)
    if remat:
        task = dataclasses.replace(
            task, config=dataclasses.replace(task.config, train=dataclasses.replace(task.config.train, remat=True))
        )
    model = build_model(task, None, task.config, from_pretrained=True)
    compiled = make_steps(task, model, task.config, task.config.train.steps)
    batch = token_batch(compiled.mesh, rows, length, task.vocab_size)
    started = time.perf_counter()
    step = compiled.train_step.compiled(compiled.state, batch)
    compile_s = time.perf_counter() - started
    timed = timed_steps(step, compiled.state, [batch], steps)
    step_s = min(timed.times)
    tokens_per_s = rows * length / step_s
    config = task.config.model
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    per_token = train_flops_per_token(params, config.num_layers, config.num_heads * config.head_dim, length, True)
    chip = chip_peak()
    return {
        "model": name,
        "lora_rank": rank,
        "products": products,
        "rows": rows,
        "length": length,
        "remat": remat,
        "kernels": kernels,
        "tokens_per_s": tokens_per_s,
        "median": rows * length / float(np.median(timed.times)),
        "step_s": step_s,
        "compile_s": compile_s,
        "flops_per_token": per_token,
        "mfu_chip": None if chip is None else per_token * tokens_per_s / chip,
        **device_record(),
    }
