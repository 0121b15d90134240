"""The `apps` command line: tasks, train, seeds, eval, predict, embed, serve, report, bench.

Each command parses its arguments and calls one function of the core or the tasks. JAX and the
task modules are imported inside the commands so that `apps --help` answers at once. A
`UserError` from anywhere below is printed as one paragraph with exit code 1.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from core import terminal
from core.bench.commands import DtypeOpt
from core.errors import UserError
from core.terminal import user_errors
from tasks import benches as task_benches

app = typer.Typer(
    help="JAX/Flax Transformer pipelines for real domain problems.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

TaskArg = Annotated[str, typer.Argument(help="Task name; `apps tasks` lists them.")]
WorkdirOpt = Annotated[
    Optional[Path], typer.Option("--workdir", "-w", metavar="DIR", help="Run folder (default: runs/TASK).")
]
DataOpt = Annotated[
    Optional[str],
    typer.Option(metavar="FILE", help="CSV/TSV/JSONL/parquet file, or a hub dataset (default: the task's own)."),
]
PresetOpt = Annotated[Optional[str], typer.Option(metavar="NAME", help="Preset (default: the task's default).")]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", metavar="KEY=VALUE", help="Override, e.g. train.steps=500; repeatable."),
]
FormatOpt = Annotated[
    str, typer.Option("--format", metavar="FORMAT", help="table (for people), json, jsonl or csv (in full).")
]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", "-o", metavar="FILE", help="Write here, not to stdout.")]


@app.callback()
def main() -> None:
    """JAX/Flax Transformer pipelines for real domain problems."""
    from core.training import host

    # The CLI owns its process: huge pages and kept freed memory for XLA's arenas (core/training/host.py).
    host.tune_process()


@app.command("tasks")
@user_errors
def list_tasks(form: FormatOpt = "table", output: OutputOpt = None) -> None:
    """List the tasks: data, model, metrics, presets, options, prompts."""
    import tasks

    terminal.check_format(form)
    terminal.write(tasks.tables(for_people=form == "table"), form, output)


@app.command()
@user_errors
def train(
    task: TaskArg,
    workdir: WorkdirOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    data: DataOpt = None,
    init_from: Annotated[
        Optional[Path], typer.Option(metavar="DIR", help="Start from this run's embedder and body (fresh head).")
    ] = None,
    coordinator: Annotated[Optional[str], typer.Option(metavar="HOST:PORT", help="Multi-process: coordinator.")] = None,
    num_processes: Annotated[Optional[int], typer.Option(metavar="N", help="Multi-process: process count.")] = None,
    process_id: Annotated[Optional[int], typer.Option(metavar="I", help="Multi-process: this one's index.")] = None,
) -> None:
    """Train TASK in WORKDIR, resuming the run there from its last checkpoint."""
    task_type = _task(task)
    from core import run
    from core.training import sharding

    sharding.initialize_distributed(coordinator, num_processes, process_id)
    workdir = workdir or Path("runs") / task
    overrides = [*(set_ or []), *([f"model.init_from={str(init_from)!r}"] if init_from else [])]
    console = terminal.console()
    metrics = run.train(task_type, workdir=workdir, preset=preset, overrides=overrides, data=data, console=console)
    terminal.print_metrics(f"{task}: validation", metrics)
    typer.echo(f"Run saved in {workdir}.")


@app.command("seeds")
@user_errors
def seeds_command(
    task: TaskArg,
    seeds: Annotated[int, typer.Option("--seeds", metavar="N", help="How many seeds: train.seed 0 to N-1.")] = 3,
    workdir: Annotated[
        Optional[Path], typer.Option("--workdir", "-w", metavar="DIR", help="Folder of the runs, one per seed.")
    ] = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    data: DataOpt = None,
    form: FormatOpt = "table",
    output: OutputOpt = None,
) -> None:
    """Train a preset once per seed and show each test metric's mean and spread.

    Finished seeds are read back, so a rerun regenerates the table."""
    terminal.check_format(form)
    if seeds < 1:
        raise UserError(f"--seeds {seeds}: give at least 1.")
    task_type = _task(task)
    from core import seeds as seeds_lib

    workdir = workdir or Path("runs") / "seeds" / task
    result = seeds_lib.across_seeds(
        task_type, range(seeds), workdir, preset=preset, overrides=set_ or [], data=data, console=terminal.console()
    )
    title = f"{task} ({result['preset']}): test split, {seeds} seed(s), from {workdir}"
    terminal.write({title: result["rows"]}, form, output, result)


@app.command("eval")
@user_errors
def evaluate(
    task: TaskArg,
    workdir: WorkdirOpt = None,
    split: Annotated[str, typer.Option("--split", metavar="SPLIT", help="valid or test.")] = "test",
    data: DataOpt = None,
    model: Annotated[
        Optional[str], typer.Option(metavar="NAME", help="Score a pretrained checkpoint as it is (zero-shot).")
    ] = None,
    preset: Annotated[
        Optional[str], typer.Option(metavar="NAME", help="With --model: the preset whose data it is scored on.")
    ] = None,
    baselines: Annotated[
        bool, typer.Option(help="Score the task's baselines too (they depend on the data and preset alone).")
    ] = True,
    form: FormatOpt = "table",
    output: OutputOpt = None,
) -> None:
    """Score WORKDIR's best checkpoint (or a pretrained --model) on a split.

    Writes WORKDIR/eval_SPLIT.json, the same report as --format json."""
    terminal.check_format(form)
    if split not in ("valid", "test"):
        raise UserError(f"--split {split!r}: expected valid or test.")
    if preset is not None and model is None:
        raise UserError("--preset goes with --model; a trained run's workdir holds its own configuration.")
    task_type = _task(task)
    from core import run

    if model is None:
        workdir = workdir or Path("runs") / task
    result = run.evaluate(task_type, workdir, split=split, data=data, model=model, preset=preset, baselines=baselines)
    report = dict(result)
    # Generated text scored per decoding (greedy, beam), then the baselines: one column each.
    columns = {
        name: result.pop(name) for name in list(result) if name != "baselines" and isinstance(result[name], dict)
    }
    columns.update(result.pop("baselines", {}))
    title = f"{task} on {split} ({result.pop('checkpoint')}): {result.pop('dataset')}; {result.pop('protocol')}"
    terminal.print_metrics(title, result, columns, form, output, report)
    if workdir is not None:
        typer.echo(f"Wrote {workdir / f'eval_{split}.json'}.", err=form != "table")


@app.command(context_settings={"ignore_unknown_options": True})
@user_errors
def predict(
    task: TaskArg,
    inputs: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="Inputs and the task's own options (`apps tasks` lists them); without inputs, the lines of stdin.",
        ),
    ] = None,
    workdir: WorkdirOpt = None,
    model: Annotated[
        Optional[str], typer.Option(metavar="NAME", help="A pretrained checkpoint instead of a run (lm, speech).")
    ] = None,
    dtype: DtypeOpt = "float32",
    form: FormatOpt = "table",
    output: OutputOpt = None,
) -> None:
    """Predict with WORKDIR's best checkpoint (or a pretrained --model).

    --format json, jsonl and csv write typed values in full; the table rounds them; speech: srt, vtt."""
    from core.options import switches

    task_type = _task(task)
    terminal.check_format(form, task_type.formats)
    if model is not None and workdir is not None:
        raise UserError("Give --workdir (a trained run) or --model (a pretrained checkpoint), not both.")
    lines, options = terminal.split_options(inputs or [], switches(task_type.predict_options))
    if not lines and sys.stdin is not None and not sys.stdin.isatty():
        lines = terminal.stdin_lines()
    from core import predict as predict_lib

    # One prompt of a task that streams, shown as a table: written to the terminal as it comes.
    streams = task_type.generates and len(lines) == 1 and form == "table" and output is None
    writer = _Streamed(lines[0] if lines else "", options) if streams else None
    source = {"model": model} if model is not None else {"workdir": workdir or Path("runs") / task}
    rows = predict_lib.predict(task_type, lines=lines, options=options, on_text=writer, dtype=dtype, **source)
    if writer is not None and writer.started:
        writer("\n")
        return
    terminal.write({f"{task}: predictions": rows}, form, output, formats=task_type.formats)


class _Streamed:
    """A streamed continuation on the terminal: the prompt, shown once generation has started (not
    before a mistake), then the text as the decode loop produces it."""

    def __init__(self, prompt: str, options: dict[str, str]):
        from core.options import SWITCH_VALUES

        self.prompt, self.started = prompt, False
        # A chat's answer starts on a line of its own; a continuation follows its prompt.
        self.own_line = SWITCH_VALUES.get(options.get("--chat", "").lower(), False)

    def __call__(self, text: str) -> None:
        if not self.started:
            typer.secho(self.prompt, bold=True, nl=self.own_line)
            self.started = True
        sys.stdout.write(text)
        sys.stdout.flush()


@app.command()
@user_errors
def embed(
    inputs: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="Texts; with --workdir, the task first (`apps embed protein-mlm -w DIR seqs.fasta`). "
            "Without inputs, the lines of --file, else of stdin.",
        ),
    ] = None,
    workdir: Annotated[
        Optional[Path], typer.Option("--workdir", "-w", metavar="DIR", help="A trained run whose body embeds.")
    ] = None,
    file: Annotated[
        Optional[Path], typer.Option("--file", metavar="FILE", help="A UTF-8 text file, one input a line.")
    ] = None,
    output: Annotated[Path, typer.Option("--output", "--out", "-o", metavar="FILE", help="The .npz written.")] = Path(
        "embeddings.npz"
    ),
    model: Annotated[
        str, typer.Option(metavar="NAME", help="A Hugging Face encoder folder or a shipped name.")
    ] = "all-MiniLM-L6-v2",
    max_len: Annotated[int, typer.Option(metavar="N", help="Tokens kept of each text.")] = 256,
    per_position: Annotated[
        bool, typer.Option("--per-position", help="With --workdir: a vector per position, not the mean.")
    ] = False,
) -> None:
    """Embed texts (or a trained run's inputs) into an .npz.

    Texts: keys texts and embeddings (mean-pooled); with --workdir, one array per input id."""
    lines = list(inputs or [])
    task = lines.pop(0) if workdir is not None and lines else None
    if workdir is not None and task is None:
        raise UserError("apps embed --workdir DIR needs the run's task first: `apps embed protein-mlm -w DIR ...`.")
    if not lines and file is not None:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"--file {file}: {error}") from None
    elif not lines and sys.stdin is not None and not sys.stdin.isatty():
        lines = terminal.stdin_lines()
    lines = [line for line in lines if line.strip()]
    from tasks.nlp import embed as embed_lib

    if task is not None:
        from core import run

        path = embed_lib.write_by_id(output, vectors := run.embed(_task(task), workdir, lines, per_position))
        typer.echo(f"Wrote the embeddings of {len(vectors)} inputs, keyed by id, to {path}.")
        return
    vectors = embed_lib.embed(lines, model, max_len=max_len)
    path = embed_lib.write(output, lines, vectors)
    typer.echo(f"Wrote {len(lines)} embeddings of size {vectors.shape[1]} to {path}.")


@app.command()
@user_errors
def serve(
    workdir: Annotated[
        Optional[list[Path]], typer.Option("--workdir", "-w", metavar="DIR", help="A trained run; repeatable.")
    ] = None,
    model: Annotated[
        Optional[list[str]], typer.Option(metavar="NAME", help="A pretrained decoder or Whisper; repeatable.")
    ] = None,
    host: Annotated[str, typer.Option("--host", metavar="HOST", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", metavar="PORT", help="Port to listen on.")] = 8000,
    max_batch: Annotated[int, typer.Option(metavar="N", help="Inputs per predict call; generation slots.")] = 8,
    max_wait_ms: Annotated[float, typer.Option(metavar="MS", help="A predict request's wait for others.")] = 5.0,
    context: Annotated[
        Optional[int], typer.Option(metavar="N", help="Positions per slot (default: the model's, at most 2048).")
    ] = None,
    dtype: DtypeOpt = "float32",
    prompt_cache: Annotated[int, typer.Option(metavar="N", help="Ended prompts kept for reuse (0: none).")] = 8,
    queue: Annotated[int, typer.Option(metavar="N", help="Requests that may wait per model; past it, 503.")] = 256,
    timeout: Annotated[float, typer.Option(metavar="S", help="Seconds a request may take; past it, 504.")] = 300.0,
    read_timeout: Annotated[float, typer.Option(metavar="S", help="Seconds to send a head or each body piece.")] = 30.0,
    max_inputs: Annotated[int, typer.Option(metavar="N", help="Inputs per predict request; past it, 400.")] = 64,
    max_audio_seconds: Annotated[float, typer.Option(metavar="S", help="Audio per file; past it, 400.")] = 600.0,
    api_key: Annotated[
        Optional[str],
        typer.Option(envvar="APPS_API_KEY", metavar="KEY", help="Require Authorization: Bearer KEY."),
    ] = None,
    allow_unauthenticated: Annotated[
        bool, typer.Option("--allow-unauthenticated", help="Listen beyond loopback without a key.")
    ] = False,
) -> None:
    """Serve trained runs and pretrained decoders and Whisper over HTTP.

    /v1/TASK/predict for every task; OpenAI's completions and chat for language models, its audio for speech."""
    given = {name: value for name, value in locals().items() if name not in ("workdir", "model")}
    from core.serving import launch

    settings = launch.Settings(**given)
    settings.check()
    terminal.show_task_log()
    import tasks

    launch.serve(list(workdir or []), list(model or []), tasks.get, tasks.for_checkpoint, settings, terminal.console())


@app.command()
@user_errors
def report(
    workdir: Annotated[Path, typer.Option("--workdir", "-w", metavar="DIR", help="Run folder (holds metrics.jsonl).")],
) -> None:
    """Show WORKDIR's best validation step; draw its curves into curves.png."""
    terminal.show_task_log()
    from core import run

    result = run.report(workdir)
    if result["best_step"] is None:
        typer.echo(f"{workdir} has no validation record yet.")
    else:
        chosen = f"by {result['metric']}" if result["metric"] else "the last validation (no best.json)"
        terminal.print_metrics(f"{workdir}: best step {result['best_step']}, {chosen}", result["metrics"])
    typer.echo(f"Curves drawn in {result['picture']}.")


# apps bench: the core's benchmarks (core.bench.commands) and the tasks' own (tasks/benches.py).
app.add_typer(task_benches.app, name="bench")


@app.command("export")
@user_errors
def export_command(
    form: Annotated[str, typer.Option("--format", metavar="FORMAT", help="hf, gguf, ct2 or peft (LoRA adapters).")],
    out: Annotated[Path, typer.Option("--out", "-o", metavar="PATH", help="The folder or file to write.")],
    workdir: Annotated[Optional[Path], typer.Option("--workdir", "-w", metavar="DIR", help="A trained run.")] = None,
    model: Annotated[Optional[str], typer.Option(metavar="NAME", help="A pretrained checkpoint instead.")] = None,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype", metavar="DTYPE", help="float32, bfloat16 or float16; q8_0 (gguf); ct2: float32, float16."
        ),
    ] = "float32",
    force: Annotated[bool, typer.Option("--force", help="Replace what stands at --out.")] = False,
) -> None:
    """Write a fine-tuned run for other tools: a decoder as hf, gguf or peft, Whisper as ct2, MiniLM as hf."""
    from core import export, loading

    if (workdir is None) == (model is None):
        raise UserError("apps export writes a trained run (--workdir) or a pretrained checkpoint (--model): give one.")
    if model is not None:
        import tasks

        exported = export.export_checkpoint(tasks.for_checkpoint(model), model, form, out, dtype=dtype, force=force)
    else:
        exported = export.export(_task(loading.run_task(workdir)), workdir, form, out, dtype=dtype, force=force)
    size = sum(exported.files.values()) / 1e6  # shown to three digits: 540 MB, 0.0203 MB
    folded = f", {exported.adapters} LoRA layers folded in" if exported.adapters else ""
    origin = f"{workdir}, fine-tuned from {exported.source}{folded}" if workdir else f"the checkpoint {model}"
    files = f"{len(exported.files)} files" if len(exported.files) > 1 else "one file"
    typer.echo(f"Wrote {exported.path} ({exported.format}, {exported.dtype}, {size:.3g} MB in {files}) from {origin}.")


def _task(name: str) -> type:
    """The task registered as `name`; its log (rows dropped, items skipped) shown from then on."""
    import tasks

    task_type = tasks.get(name)
    terminal.show_task_log()
    return task_type


if __name__ == "__main__":
    app()
