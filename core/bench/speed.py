"""Speed of the shared core on a GPT-style decoder (`apps bench`): the train step, and decoding.

Decoding (`apps bench decode`) times `core.generation.generate.generate` on random weights: greedy, a
64-token prompt, 128 new tokens, batch 1 and 8, with the KV cache and without it (the full
forward pass over the growing sequence at every token, still one compiled loop). New tokens per
second count the whole call, prefill included, after a warm-up call that compiles; the best of
the timed calls is reported, as for the train step, with their median beside it.

For each train config the step is compiled, warmed up, then timed over `steps` steps. Reported:
tokens/s, step time, compile time and model FLOPs utilisation

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
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table

from core.config import Config, ModelConfig, OptimConfig, TrainConfig
from core.errors import UserError
from core.generation.generate import generate
from core.model.attention import score_fraction
from core.model.heads import TiedOutput, TokenEmbedder
from core.model.precision import narrowed
from core.task import Task
from core.training import losses
from core.training.steps import build_model, make_steps


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
class CausalLM(Task):
    """Next-token prediction over random tokens: just enough task to drive the core's step (a
    `Task` subclass for the protocol's defaults, the `model` hook among them)."""

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

    # The steps are all a benchmark drives: no data, featurizer, scores or predictions.
    def examples(self, split):
        raise NotImplementedError

    def fit_featurizer(self, train):
        raise NotImplementedError

    def load_featurizer(self, directory):
        raise NotImplementedError

    def score(self, predictions, examples, featurizer):
        raise NotImplementedError

    def baselines(self, train, test, featurizer):
        raise NotImplementedError

    def protocol(self):
        raise NotImplementedError

    def parse_inputs(self, lines, options):
        raise NotImplementedError

    def render(self, predictions, examples, featurizer):
        raise NotImplementedError


# Decoding: the train benchmark's small decoder, and one of GPT-2 small's shape (124M parameters).
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


def bench_config(bench: BenchConfig, steps: int) -> Config:
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
        ),
        optim=OptimConfig(warmup_steps=1),
        train=TrainConfig(batch_size=bench.batch_size, steps=steps + 2),
    )


def run_config(bench: BenchConfig, steps: int) -> dict[str, float]:
    config = bench_config(bench, steps)
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
    step = compiled.train_step.compiled(state, batch)
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


def run_decode(run: DecodeRun) -> dict[str, float]:
    """Greedy generation on random weights: new tokens per second over whole calls."""
    bench = DECODE_MODELS[run.model]
    config = bench_config(bench, 1)
    model = build_model(CausalLM(config=config, vocab_size=bench.vocab_size), None, config)
    return time_generation(model, bench.vocab_size, run.batch_size, run.use_cache, run.calls)


def time_generation(model, vocab_size: int, batch_size: int, use_cache: bool = True, calls: int = 3) -> dict:
    """New tokens per second of greedy `generate` calls (64-token prompts, 128 new tokens)
    after a warm-up call that compiles: the best call and the median."""
    prompts = np.random.default_rng(0).integers(0, vocab_size, (batch_size, PROMPT_TOKENS))

    def call() -> tuple[float, int]:
        started = time.perf_counter()
        result = generate(model, prompts, max_new_tokens=NEW_TOKENS, use_cache=use_cache)
        return time.perf_counter() - started, int(result.lengths.sum())

    first, _ = call()
    times, counts = zip(*(call() for _ in range(calls)))
    return {
        "params": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "new_tokens": counts[0],
        "new_tokens_per_s": counts[0] / min(times),
        "median_new_tokens_per_s": counts[0] / float(np.median(times)),
        "call_s": min(times),
        "compile_s": first - min(times),
    }


def main(names: list[str], steps: int, console: Console, model: str | None = None) -> dict[str, list[dict]]:
    """Runs the named benchmarks: train configs (small, big), "decode" (every decode run) or
    "decode-MODEL" (that model's decode runs); -> {"train": [...], "decode": [...]}. With a
    pretrained `model`: "decode" and "finetune" (both by default) of that checkpoint."""
    if model is not None:
        unknown = [n for n in names if n not in ("decode", "finetune")]
        if unknown:
            raise UserError(f"Unknown benchmark {unknown} with --model; choose from decode, finetune.")
        names = names or ["decode", "finetune"]
        return {
            "decode": pretrained_decode(model, console) if "decode" in names else [],
            "finetune": pretrained_finetune(model, steps, console) if "finetune" in names else [],
        }
    decode_names = ["decode", *(f"decode-{m}" for m in DECODE_MODELS)]
    unknown = [n for n in names if n not in CONFIGS and n not in decode_names]
    if unknown:
        raise UserError(f"Unknown benchmark {unknown}; choose from {', '.join([*CONFIGS, *decode_names])}.")
    train = [n for n in names if n in CONFIGS]
    runs = [r for r in DECODE_RUNS if "decode" in names or f"decode-{r.model}" in names]
    return {"train": train_table(train, steps, console) if train else [], "decode": decode_table(runs, console)}


def figures(title: str, caption: str, columns: tuple[str, ...]) -> Table:
    """A benchmark's table: its title, the caption that says how the figures were taken, and
    right-aligned columns."""
    table = Table(title=title, caption=caption)
    for column in columns:
        table.add_column(column, justify="right")
    return table


def decode_table(runs: list[DecodeRun], console: Console) -> list[dict]:
    if not runs:
        return []
    table = figures(
        title=f"greedy decoding (f32), {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens, "
        f"on {jax.devices()[0].device_kind}",
        caption="new tok/s: new tokens over the whole call, prefill included, best of the timed calls "
        "(median beside it); no cache: the full forward pass again at every token. Times in s.",
        columns=("model", "params", "batch", "cache", "new tok/s", "median", "call", "compile"),
    )
    results = []
    for run in runs:
        result = run_decode(run)
        results.append({**dataclasses.asdict(run), **result})
        table.add_row(
            run.model,
            f"{result['params'] / 1e6:.1f}M",
            str(run.batch_size),
            "on" if run.use_cache else "off",
            f"{result['new_tokens_per_s']:,.0f}",
            f"{result['median_new_tokens_per_s']:,.0f}",
            f"{result['call_s']:.2f}",
            f"{result['compile_s']:.1f}",
        )
    console.print(table)
    return results


def train_table(names: list[str], steps: int, console: Console) -> list[dict]:
    device = jax.devices()[0].device_kind
    table = figures(
        title=f"core train step (f32, AdamW) on {device} x{jax.device_count()}",
        caption="GFLOP/s: the FLOPs executed (6N + 12LdT x the share of attention scores the kernel computes). "
        "dot: jnp.dot 2048^3 f32 GFLOP/s, sustained over step-long stretches between the steps; "
        "burst: its best single product. MFU = GFLOP/s / dot; MFU model: 6N + 12LdT in full / dot; "
        "MFU/b = GFLOP/s / burst. Compile in s.",
        columns=(
            "config",
            "params",
            "tok/s",
            "ms/step",
            "compile",
            "GFLOP/s",
            "dot",
            "MFU",
            "MFU model",
            "burst",
            "MFU/b",
        ),
    )
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
            f"{result['mfu_model']:.1%}",
            f"{result['burst_flops'] / 1e9:.1f}",
            f"{result['mfu_burst']:.1%}",
        )
    console.print(table)
    return results


# A pretrained decoder (`apps bench --model NAME`): its decoding at batch 1 and 8 with float32
# and bfloat16 weights, and its fine-tuning step, every weight and LoRA, at 4 rows of 512 tokens,
# with float32 products and with bfloat16 ones (`train.matmul_dtype`).
PRETRAINED_DECODE = ((1, "float32"), (8, "float32"), (1, "bfloat16"), (8, "bfloat16"))
FINETUNE_BATCH, FINETUNE_LEN, LORA_RANK = 4, 512, 16
FINETUNE_RUNS = ((0, "float32"), (0, "bfloat16"), (LORA_RANK, "float32"), (LORA_RANK, "bfloat16"))


def pretrained_config(name: str, max_len: int, lora_rank: int = 0, matmul_dtype: str = "float32") -> Config:
    from core.checkpoints import pretrained

    return Config(
        task="bench",
        preset="bench",
        model=dataclasses.replace(pretrained.architecture(name, max_len=max_len), lora_rank=lora_rank),
        optim=OptimConfig(warmup_steps=1),
        train=TrainConfig(batch_size=FINETUNE_BATCH, steps=100, matmul_dtype=matmul_dtype),
    )


def pretrained_task(name: str, max_len: int, lora_rank: int = 0, matmul_dtype: str = "float32") -> CausalLM:
    from core.checkpoints import pretrained

    config = pretrained_config(name, max_len, lora_rank, matmul_dtype)
    return CausalLM(config=config, vocab_size=pretrained.read_checkpoint(name).vocab_size)


def pretrained_decode(name: str, console: Console) -> list[dict]:
    task = pretrained_task(name, PROMPT_TOKENS + NEW_TOKENS)
    model = build_model(task, None, task.config, from_pretrained=True)
    table = figures(
        title=f"{name}: greedy decoding, {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens",
        caption="new tok/s over the whole call, prefill included, best of 3 calls (median beside it); "
        "bfloat16: the linear layers' weights in bfloat16, multiplied in bfloat16 with float32 sums; "
        "the activations, embeddings and cache in float32.",
        columns=("weights", "batch", "new tok/s", "median", "call s", "compile s"),
    )
    results = []
    for batch_size, dtype in PRETRAINED_DECODE:
        graphdef, params = nnx.split(model)
        result = time_generation(nnx.merge(graphdef, narrowed(params, dtype)), task.vocab_size, batch_size)
        results.append({"model": name, "batch_size": batch_size, "dtype": dtype, **result})
        table.add_row(
            dtype,
            str(batch_size),
            f"{result['new_tokens_per_s']:,.1f}",
            f"{result['median_new_tokens_per_s']:,.1f}",
            f"{result['call_s']:.2f}",
            f"{result['compile_s']:.1f}",
        )
    console.print(table)
    return results


def pretrained_finetune(name: str, steps: int, console: Console) -> list[dict]:
    table = figures(
        title=f"{name}: a fine-tuning step (AdamW, float32 weights), {FINETUNE_BATCH} rows of {FINETUNE_LEN} tokens",
        caption="tok/s: training tokens a second, best of the timed steps (median beside it); products: "
        "train.matmul_dtype, bfloat16 multiplying the float32 weights and activations with float32 sums.",
        columns=("weights trained", "products", "tok/s", "median", "ms/step", "compile s"),
    )
    results = []
    # The rows divide over the devices (tests simulate 8).
    rows = -(-FINETUNE_BATCH // jax.device_count()) * jax.device_count()
    for rank, products in FINETUNE_RUNS:
        task = pretrained_task(name, FINETUNE_LEN, rank, products)
        model = build_model(task, None, task.config, from_pretrained=True)
        compiled = make_steps(task, model, task.config, task.config.train.steps)
        tokens = np.random.default_rng(0).integers(0, task.vocab_size, (rows, FINETUNE_LEN + 1), np.int32)
        batch = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "mask": np.ones((rows, FINETUNE_LEN), bool),
            "weights": np.ones(rows, np.float32),
        }
        batch = jax.device_put(
            batch, jax.sharding.NamedSharding(compiled.mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
        )
        state, started = compiled.state, time.perf_counter()
        state, logs = compiled.train_step(state, batch)
        jax.block_until_ready(logs)
        compile_s, times = time.perf_counter() - started, []
        for _ in range(steps):
            started = time.perf_counter()
            state, logs = compiled.train_step(state, batch)
            jax.block_until_ready(logs)
            times.append(time.perf_counter() - started)
        tokens_per_s = rows * FINETUNE_LEN / min(times)
        median = rows * FINETUNE_LEN / float(np.median(times))
        label = "all" if rank == 0 else f"LoRA r{rank}"
        results.append(
            {"model": name, "lora_rank": rank, "products": products, "tokens_per_s": tokens_per_s, "median": median}
        )
        table.add_row(
            label, products, f"{tokens_per_s:,.0f}", f"{median:,.0f}", f"{min(times) * 1e3:,.0f}", f"{compile_s:.1f}"
        )
    console.print(table)
    return results
