"""`apps bench`, the core's part: one subcommand a benchmark, each with its own options, each
calling one function (tasks/benches.py adds the tasks' own: translate, summarize, transcribe).

apps bench train                       # the core's train step (small and big decoders)
apps bench decode [--model NAME]       # greedy decoding, random weights or a pretrained decoder
apps bench finetune --model NAME       # a pretrained decoder's fine-tuning step
apps bench serve [--model NAME]        # apps serve under concurrent clients
apps bench embed [--model NAME]        # apps serve's embeddings: texts per second
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from core import terminal
from core.errors import UserError
from core.terminal import user_errors

app = typer.Typer(
    help="Time the core and the tasks: train, decode, finetune, transcribe, serve, seq2seq.",
    no_args_is_help=True,
)

KernelsOpt = Annotated[
    str, typer.Option(metavar="NAME", help="model.kernels: auto, xla, native or pallas (core/model/kernels).")
]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", metavar="FILE", help="Also write the figures here.")]
ModelOpt = Annotated[
    Optional[str], typer.Option(metavar="NAME", help="A pretrained decoder: a shipped name or a .gguf file.")
]
ServedRunOpt = Annotated[
    Optional[Path],
    typer.Option("--workdir", "-w", metavar="DIR", help="A trained run served instead of --model (serve: an lm run)."),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        metavar="DTYPE",
        help="Weights of generation: float32, bfloat16, int8 or int4 (fewer bytes a token, faster decoding).",
    ),
]


@app.command("train")
@user_errors
def bench_train(
    configs: Annotated[
        Optional[list[str]], typer.Argument(metavar="CONFIG", help="small, big (default: both).")
    ] = None,
    steps: Annotated[int, typer.Option(metavar="N", help="Timed steps per config, after warm-up.")] = 10,
    kernels: KernelsOpt = "auto",
    json_path: JsonOpt = None,
) -> None:
    """The core's train step on GPT-style decoders: tokens/s, MFU."""
    from core.bench import timing, train_step

    timing.save_figures("train", train_step.train(configs or [], steps, terminal.console(), kernels), json_path)


@app.command("decode")
@user_errors
def bench_decode(
    models: Annotated[
        Optional[list[str]],
        typer.Argument(metavar="SHAPE", help="Random-weight decoders: small, gpt2 (default: both)."),
    ] = None,
    model: ModelOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Greedy decoding speed, new tokens/s.

    Random weights with and without the KV cache, or a --model in float32 and bfloat16."""
    from core.bench import checkpoint, decode, timing

    if model is not None and models:
        raise UserError("apps bench decode: give shapes of random weights or --model, not both.")
    figures = (
        decode.decode(models or [], terminal.console())
        if model is None
        else checkpoint.decode(model, terminal.console())
    )
    timing.save_figures("decode", figures, json_path)


@app.command("finetune")
@user_errors
def bench_finetune(
    model: Annotated[str, typer.Option(metavar="NAME", help="A pretrained decoder: a name or a .gguf.")] = (
        "smollm2-135m-instruct"
    ),
    steps: Annotated[int, typer.Option(metavar="N", help="Timed steps per run, after one that compiles.")] = 10,
    rows: Annotated[int, typer.Option(metavar="N", help="Rows a step.")] = 4,
    length: Annotated[int, typer.Option(metavar="T", help="Tokens a row.")] = 512,
    remat: Annotated[bool, typer.Option("--remat", help="Recompute each block in the backward pass.")] = False,
    kernels: KernelsOpt = "auto",
    json_path: JsonOpt = None,
) -> None:
    """A pretrained decoder's fine-tuning step: all weights and LoRA.

    Each with float32 and with bfloat16 products."""
    from core.bench import checkpoint, timing

    figures = checkpoint.finetune(model, steps, terminal.console(), rows, length, remat, kernels)
    timing.save_figures("finetune", figures, json_path)


@app.command("serve")
@user_errors
def bench_serve(
    model: ModelOpt = None,
    workdir: ServedRunOpt = None,
    clients: Annotated[str, typer.Option(metavar="N,N,...", help="Concurrent client counts.")] = "1,4,16,64",
    seconds: Annotated[float, typer.Option(metavar="S", help="Seconds of load per client count.")] = 60.0,
    slots: Annotated[int, typer.Option(metavar="N", help="Slots of the batched server (--max-batch).")] = 16,
    against: Annotated[
        Optional[list[str]], typer.Option(metavar="URL", help="Another OpenAI-compatible base URL (.../v1).")
    ] = None,
    context: Annotated[Optional[int], typer.Option(metavar="N", help="Positions per slot (serve --context).")] = None,
    fixed_lengths: Annotated[
        bool, typer.Option("--fixed-lengths", help="Each answer runs to its max_tokens (ignore_eos set).")
    ] = False,
    dtype: DtypeOpt = "float32",
    json_path: JsonOpt = None,
) -> None:
    """`apps serve` of a language model under concurrent clients.

    SmolLM2 by default, with its slots and with one, beside --against servers."""
    from core.bench import timing
    from core.serving import load

    try:
        counts = [int(count) for count in clients.split(",")]
    except ValueError:
        raise UserError(f"--clients {clients!r}: expected counts separated by commas, e.g. 1,4,16.") from None
    figures = load.main(
        model, workdir, counts, terminal.console(), list(against or []), seconds, slots, context, fixed_lengths, dtype
    )
    timing.save_figures("serve", figures, json_path)


@app.command("embed")
@user_errors
def bench_embed(
    model: ModelOpt = None,
    workdir: ServedRunOpt = None,
    seconds: Annotated[float, typer.Option(metavar="S", help="Seconds of each load.")] = 20.0,
    json_path: JsonOpt = None,
) -> None:
    """`apps serve`'s /v1/embeddings at batch 1 and 32, and 32 clients.

    SmolLM2 by default; --workdir a sentiment, protein or lm run."""
    from core.bench import timing
    from core.serving import embedding_load as embeddings

    timing.save_figures("embed", embeddings.main(model, workdir, terminal.console(), seconds), json_path)
