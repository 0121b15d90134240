"""The `apps` command line: tasks, train, seeds, eval, predict, serve, report, bench, embed.

JAX and the task modules are imported inside the commands so that `apps --help` answers at
once. A `UserError` from anywhere below is printed as one paragraph with exit code 1.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from core.errors import LostPeer, UserError

app = typer.Typer(
    help="JAX/Flax Transformer pipelines for real domain problems.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

TaskArg = Annotated[str, typer.Argument(help="Task name; `apps tasks` lists them.")]
WorkdirOpt = Annotated[
    Path, typer.Option("--workdir", "-w", help="Run folder: config, featurizer, checkpoints, metrics.")
]
DataOpt = Annotated[
    Optional[str],
    typer.Option(
        "--data",
        help="A CSV/TSV/JSONL/parquet file, or a hub dataset name when online; default: the task's embedded data.",
    ),
]


FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        help="table (for people), or json, jsonl or csv (every field in full, for a program to read).",
    ),
]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", "-o", help="Write to this file, not to stdout.")]
FORMATS = ("table", "json", "jsonl", "csv")


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _check_format(form: str) -> None:
    if form not in FORMATS:
        raise UserError(f"--format {form!r}: expected one of {', '.join(FORMATS)}.")


def _write(tables: dict[str, list[dict]], form: str, output: Path | None, document=None) -> None:
    """Writes `tables` (title: rows, each a dict of column: value) to stdout or `output`: as
    rich tables whose cells fold rather than cut; as one JSON document (`document` if given,
    else the rows, or title: rows for several tables); as JSON lines; or as CSV. Rows of several
    tables carry their title in a `table` field (JSON lines, CSV)."""
    import csv
    import io
    import json

    from rich.console import Console
    from rich.table import Table

    _check_format(form)
    several = len(tables) > 1
    rows = [{"table": title, **row} if several else row for title, rows in tables.items() for row in rows]
    text = io.StringIO()
    if form == "table":
        console = _console() if output is None else Console(file=text, highlight=False, width=160)
        for title, table_rows in tables.items():
            table = Table(title=title)
            for column in dict.fromkeys(key for row in table_rows for key in row):
                table.add_column(column, overflow="fold")
            for row in table_rows:
                table.add_row(*(_cell(value) for value in row.values()))
            console.print(table)
    elif form == "json":
        whole = document if document is not None else {t: r for t, r in tables.items()} if several else rows
        text.write(json.dumps(whole, ensure_ascii=False, indent=2) + "\n")
    elif form == "jsonl":
        text.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    else:
        writer = csv.DictWriter(text, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows({key: _cell(value) for key, value in row.items()} for row in rows)
    if output is None:
        sys.stdout.write(text.getvalue())  # empty for tables, printed by the console
        sys.stdout.flush()
        return
    try:
        output.write_text(text.getvalue(), encoding="utf-8")
    except OSError as error:
        raise UserError(f"--output {output}: cannot be written ({error.strerror or error}).") from None
    typer.echo(f"Wrote {output}.", err=True)


def _cell(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "" if value is None else str(value)


@app.callback()
def main() -> None:
    """JAX/Flax Transformer pipelines for real domain problems."""
    from core.training import host

    # The CLI owns its process: keep freed host memory for XLA's per-step arenas (see core/training/host.py).
    host.keep_freed_memory()


def user_errors(command):
    """Prints a UserError (or a device out-of-memory error, `core.training.memory.explain`) as a message and
    exits 1, without a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except UserError as error:
            _fail(error)
        except Exception as error:
            from core.training import memory

            explained = memory.explain(error)  # a device out of memory: the figures and the knobs
            if explained is None:
                raise
            _fail(explained)

    return wrapper


def _fail(error: UserError):
    typer.secho(f"Error: {error}", fg=typer.colors.RED, err=True)
    if isinstance(error, LostPeer):
        # Skips JAX's exit handler, which would wait for the lost process and then abort.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    raise typer.Exit(1) from None


def _task(name: str) -> type:
    import tasks

    return tasks.get(name)


@app.command("tasks")
@user_errors
def list_tasks(form: FormatOpt = "table", output: OutputOpt = None) -> None:
    """List the tasks with their default data, model, metrics and presets, the options of
    `apps predict` and the prompts of the presets on a pretrained decoder."""
    import tasks

    _check_format(form)
    listed, options, prompts = [], [], []
    for name in sorted(tasks.REGISTRY):
        task = tasks.get(name)
        presets = ", ".join(f"{p}*" if p == task.default_preset else p for p in task.presets)
        fields = {
            "what": task.summary,
            "default data": task.default_data,
            "model": task.model_summary,
            "metrics": ", ".join(task.metric_names),
            "presets": presets,
        }
        if form == "table":  # two columns, the fields one a line: it reads at 80 columns
            what = fields.pop("what")
            fields = {"about": "\n".join([what, *(f"{key}: {value}" for key, value in fields.items())])}
        listed.append({"task": name, **fields})
        for option in task.predict_options:
            value = "" if option.type is bool else f" {option.type.__name__.upper()}"  # a switch takes none
            options.append({"task": name, "option": option.flag + value, "help": option.help})
        for preset, prompt in task.prompts.items():
            prompts.append({"task": name, "preset": preset, "prompt": repr(prompt) if form == "table" else prompt})
    tables = {
        "Tasks (* the default preset)": listed,
        "apps predict TASK options": options,
        "Prompts of the presets on a pretrained decoder (data.prompt)": prompts,
    }
    _write(tables, form, output)


@app.command()
@user_errors
def train(
    task: TaskArg,
    workdir: WorkdirOpt = None,
    preset: Annotated[Optional[str], typer.Option(help="Preset name (default: the task's default preset).")] = None,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="Override KEY=VALUE, e.g. train.steps=500; repeatable.")
    ] = None,
    data: DataOpt = None,
    init_from: Annotated[
        Optional[Path],
        typer.Option(help="Another run's folder: start from its embedder and body weights (fresh head)."),
    ] = None,
    coordinator: Annotated[Optional[str], typer.Option(help="Multi-process: coordinator HOST:PORT.")] = None,
    num_processes: Annotated[Optional[int], typer.Option(help="Multi-process: number of processes.")] = None,
    process_id: Annotated[Optional[int], typer.Option(help="Multi-process: this process's index.")] = None,
) -> None:
    """Train TASK in WORKDIR; an existing run there is resumed from its last checkpoint."""
    task_type = _task(task)
    _show_task_log()
    from core import run
    from core.training import sharding

    sharding.initialize_distributed(coordinator, num_processes, process_id)
    workdir = workdir or Path("runs") / task
    overrides = [*(set_ or []), *([f"model.init_from={str(init_from)!r}"] if init_from else [])]
    metrics = run.train(task_type, workdir=workdir, preset=preset, overrides=overrides, data=data, console=_console())
    _print_metrics(f"{task}: validation", metrics)
    typer.echo(f"Run saved in {workdir}.")


@app.command("seeds")
@user_errors
def seeds_command(
    task: TaskArg,
    seeds: Annotated[int, typer.Option("--seeds", help="How many seeds: train.seed 0 to N-1.")] = 3,
    workdir: Annotated[
        Optional[Path], typer.Option("--workdir", "-w", help="Folder of the runs, one per seed (seed0, ...).")
    ] = None,
    preset: Annotated[Optional[str], typer.Option(help="Preset name (default: the task's default preset).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override KEY=VALUE; repeatable.")] = None,
    data: DataOpt = None,
    form: FormatOpt = "table",
    output: OutputOpt = None,
) -> None:
    """Train TASK's preset once per seed, score each on the test split, and show every metric's
    mean and spread; finished seeds are read back, so a rerun regenerates the table."""
    _check_format(form)
    if seeds < 1:
        raise UserError(f"--seeds {seeds}: give at least 1.")
    task_type = _task(task)
    _show_task_log()
    from core import seeds as seeds_lib

    workdir = workdir or Path("runs") / "seeds" / task
    result = seeds_lib.across_seeds(
        task_type, range(seeds), workdir, preset=preset, overrides=set_ or [], data=data, console=_console()
    )
    title = f"{task} ({result['preset']}): test split, {seeds} seed(s), from {workdir}"
    _write({title: result["rows"]}, form, output, result)


@app.command("eval")
@user_errors
def evaluate(
    task: TaskArg,
    workdir: WorkdirOpt = None,
    split: Annotated[str, typer.Option(help="valid or test.")] = "test",
    data: DataOpt = None,
    model: Annotated[
        Optional[str],
        typer.Option(
            help="Score a pretrained checkpoint as it is (zero-shot; lm: smollm2-135m-instruct, gemma3-270m)."
        ),
    ] = None,
    preset: Annotated[
        Optional[str], typer.Option(help="With --model: the preset whose data and lengths it is scored with.")
    ] = None,
    baselines: Annotated[
        bool,
        typer.Option(
            help="Score the task's baselines (and a pretrained decoder zero-shot) beside the model; they "
            "depend on the data and the preset alone, so runs of one preset can skip them after the first."
        ),
    ] = True,
    form: FormatOpt = "table",
    output: OutputOpt = None,
) -> None:
    """Score the best checkpoint of WORKDIR on a split; writes WORKDIR/eval_<split>.json. With
    --model, a pretrained checkpoint as it is (written into --workdir if given). --format json
    writes that same report."""
    _check_format(form)
    if split not in ("valid", "test"):
        raise UserError(f"--split {split!r}: expected valid or test.")
    if preset is not None and model is None:
        raise UserError("--preset goes with --model; a trained run's workdir holds its own configuration.")
    task_type = _task(task)
    _show_task_log()
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
    _print_metrics(title, result, columns, form, output, report)
    if workdir is not None:
        typer.echo(f"Wrote {workdir / f'eval_{split}.json'}.", err=form != "table")


@app.command(context_settings={"ignore_unknown_options": True})
@user_errors
def predict(
    task: TaskArg,
    inputs: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="Inputs, and the task's own options (`apps tasks` lists them: recsys --user, --history; "
            "lm --max-new-tokens, --temperature, ...). Inputs are read from stdin, one per line, when none are given."
        ),
    ] = None,
    workdir: WorkdirOpt = None,
    model: Annotated[
        Optional[str],
        typer.Option(
            help="Predict with a pretrained checkpoint instead of a trained run: a shipped name "
            "(lm: smollm2-135m-instruct), a .gguf file or a Hugging Face folder."
        ),
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            help="A generating task's decoding weights: float32, or bfloat16 (the linear layers' products in "
            "bfloat16 with float32 sums; activations and caches stay float32)."
        ),
    ] = "float32",
    form: FormatOpt = "table",
    output: OutputOpt = None,
) -> None:
    """Predict with the best checkpoint of WORKDIR (or a pretrained --model)."""
    _check_format(form)
    task_type = _task(task)
    if model is not None and workdir is not None:
        raise UserError("Give --workdir (a trained run) or --model (a pretrained checkpoint), not both.")
    from core.task import SWITCH_VALUES, switches

    lines, options = _split_options(inputs or [], switches(task_type.predict_options))
    if not lines and sys.stdin is not None and not sys.stdin.isatty():
        lines = _stdin_lines()
    _show_task_log()
    from core import run

    # One prompt of a task that streams (lm), shown as a table: its continuation is written to
    # the terminal as the decode loop produces it, after the prompt, which is shown once
    # generation has started (not before a mistake). Other tasks, several inputs, and output for
    # a program or a file are written whole (`_write`).
    shown = []

    def write(text: str) -> None:
        if not shown:
            # A chat's answer starts on a line of its own; a continuation follows its prompt.
            typer.secho(lines[0], bold=True, nl=SWITCH_VALUES.get(options.get("--chat", "").lower(), False))
            shown.append(True)
        sys.stdout.write(text)
        sys.stdout.flush()

    streams = task_type.generates and len(lines) == 1 and form == "table" and output is None
    source = {"model": model} if model is not None else {"workdir": workdir or Path("runs") / task}
    rows = run.predict(
        task_type, lines=lines, options=options, on_text=write if streams else None, dtype=dtype, **source
    )
    if shown:
        write("\n")
        return
    _write({f"{task}: predictions": rows}, form, output)


@app.command()
@user_errors
def embed(
    inputs: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="Texts to embed; with --workdir, the task first, then its inputs (`apps embed protein-mlm "
            "--workdir DIR seqs.fasta`). Without inputs, the lines of --file, else of stdin."
        ),
    ] = None,
    workdir: Annotated[
        Optional[Path], typer.Option("--workdir", "-w", help="A trained run whose body embeds the inputs.")
    ] = None,
    file: Annotated[Optional[Path], typer.Option(help="A UTF-8 text file, one input per line.")] = None,
    output: Annotated[Path, typer.Option("--output", "--out", "-o", help="The .npz written.")] = Path("embeddings.npz"),
    model: Annotated[
        str, typer.Option(help="A Hugging Face encoder folder (config.json, model.safetensors, tokenizer.json).")
    ] = "all-MiniLM-L6-v2",
    max_len: Annotated[int, typer.Option(help="Tokens kept of each text.")] = 256,
    per_position: Annotated[
        bool, typer.Option(help="With --workdir: one vector per position (residue) instead of the mean.")
    ] = False,
) -> None:
    """Embeddings written to an .npz: of texts with a pretrained encoder (mean-pooled; keys texts
    and embeddings), or with --workdir of a trained run's inputs (one array per input id)."""
    lines = list(inputs or [])
    task = lines.pop(0) if workdir is not None and lines else None
    if workdir is not None and task is None:
        raise UserError(
            "apps embed --workdir DIR needs the run's task first: `apps embed protein-mlm --workdir DIR ...`."
        )
    if not lines and file is not None:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"--file {file}: {error}") from None
    elif not lines and sys.stdin is not None and not sys.stdin.isatty():
        lines = _stdin_lines()
    lines = [line for line in lines if line.strip()]
    if task is not None:
        task_type = _task(task)
        _show_task_log()
        import numpy as np

        from core import run
        from tasks.nlp import embed as embed_lib

        vectors = run.embed(task_type, workdir, lines, per_position)
        path = embed_lib.output_path(output)
        np.savez(path, **{key: value.astype(np.float32) for key, value in vectors.items()})
        typer.echo(f"Wrote the embeddings of {len(vectors)} inputs, keyed by id, to {path}.")
        return
    from tasks.nlp import embed as embed_lib

    vectors = embed_lib.embed(lines, model, max_len=max_len)
    path = embed_lib.write(output, lines, vectors)
    typer.echo(f"Wrote {len(lines)} embeddings of size {vectors.shape[1]} to {path}.")


def _split_options(arguments: list[str], switches: set[str] = frozenset()) -> tuple[list[str], dict[str, str]]:
    """Positional inputs, and `--flag value` / `--flag=value` pairs for the task to read; a
    switch (`--chat`) stands alone."""
    lines, options, index = [], {}, 0
    while index < len(arguments):
        argument = arguments[index]
        if argument.startswith("--") and len(argument) > 2:
            flag, sep, value = argument.partition("=")
            if not sep and flag in switches:
                value = "true"
            elif not sep:
                if index + 1 == len(arguments):
                    raise UserError(f"{flag} needs a value.")
                index, value = index + 1, arguments[index + 1]
            options[flag] = value
        else:
            lines.append(argument)
        index += 1
    return lines, options


def _check_dtype(dtype: str) -> None:
    if dtype not in ("float32", "bfloat16"):
        raise UserError(f"--dtype {dtype}: expected float32 or bfloat16.")


@app.command()
@user_errors
def serve(
    workdir: Annotated[
        Optional[list[Path]], typer.Option("--workdir", "-w", help="A trained run to serve; repeatable.")
    ] = None,
    model: Annotated[
        Optional[list[str]],
        typer.Option(help="A pretrained decoder to serve as it is (smollm2-135m-instruct, a .gguf); repeatable."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    max_batch: Annotated[
        int, typer.Option(help="Predict inputs per call, and generation slots sharing a KV cache.")
    ] = 8,
    max_wait_ms: Annotated[
        float, typer.Option(help="How long a predict request waits for others to batch with.")
    ] = 5.0,
    context: Annotated[
        Optional[int], typer.Option(help="Positions per generation slot (default: the model's, at most 2048).")
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            help="Generation weights: float32, or bfloat16 (products in bfloat16 with float32 sums: faster with "
            "two or more requests at once; activations and the cache stay float32)."
        ),
    ] = "float32",
    queue: Annotated[int, typer.Option(help="Requests that may wait per model; past it, 503.")] = 256,
    timeout: Annotated[float, typer.Option(help="Seconds a request may take; past it, 504.")] = 300.0,
    api_key: Annotated[
        Optional[str],
        typer.Option(envvar="APPS_API_KEY", help="Require Authorization: Bearer KEY (or set APPS_API_KEY)."),
    ] = None,
    allow_unauthenticated: Annotated[
        bool, typer.Option(help="Listen beyond loopback without an API key (anyone who can reach it may use it).")
    ] = False,
) -> None:
    """Serve trained runs and pretrained decoders over HTTP: /v1/TASK/predict for every task, and
    OpenAI's /v1/completions and /v1/chat/completions for language models."""
    import ipaddress

    loopback = host == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback)
    if api_key is None and not loopback and not allow_unauthenticated:
        raise UserError(
            f"--host {host} listens beyond this machine: give --api-key (or APPS_API_KEY), or "
            "--allow-unauthenticated to serve anyone who can reach it."
        )
    if max_batch < 1 or queue < 1 or timeout <= 0 or max_wait_ms < 0:
        raise UserError("--max-batch and --queue must be at least 1, --timeout positive, --max-wait-ms at least 0.")
    _check_dtype(dtype)
    _show_task_log()
    import uvicorn

    import tasks
    from core.serving import models
    from core.serving import server as server_lib

    served = models.load(
        list(workdir or []),
        list(model or []),
        tasks.get,
        tasks.get("lm"),
        slots=max_batch,
        context=context,
        queue=queue,
        dtype=dtype,
    )
    console = _console()
    for item in served:
        engine = item.engine
        if engine is not None:
            timings = engine.warm_up()
            widths = ", ".join(str(w) for w in engine.widths())
            rows = ", ".join(str(n) for n in engine.row_counts())
            console.print(
                f"{item.name} ({item.task.name}): {max_batch} slots of {engine.context} positions, {dtype} weights; "
                f"compiled the decode step over {rows} rows and prefills of width {widths} in "
                f"{sum(timings.values()):.1f} s."
            )
        else:
            console.print(f"{item.name} ({item.task.name}): predictions batched up to {max_batch} inputs.")
    server = server_lib.Server(
        served, api_key=api_key, max_batch=max_batch, max_wait_ms=max_wait_ms, queue_size=queue, timeout_s=timeout
    )
    access = "a key is required" if api_key else "no key: loopback only" if loopback else "no key, open to all"
    console.print(f"Serving {', '.join(s.name for s in served)} at http://{host}:{port} ({access}).")
    uvicorn.Server(uvicorn.Config(server.app, host=host, port=port, log_level="warning")).run()


def _is_ip(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@app.command()
@user_errors
def report(
    workdir: Annotated[
        Path, typer.Option("--workdir", "-w", help="Run folder written by `apps train` (holds metrics.jsonl).")
    ],
) -> None:
    """Show the best validation step of WORKDIR and draw its curves into WORKDIR/curves.png."""
    _show_task_log()
    from core import run

    result = run.report(workdir)
    if result["best_step"] is None:
        typer.echo(f"{workdir} has no validation record yet.")
    else:
        chosen = f"by {result['metric']}" if result["metric"] else "the last validation (no best.json)"
        _print_metrics(f"{workdir}: best step {result['best_step']}, {chosen}", result["metrics"])
    typer.echo(f"Curves drawn in {result['picture']}.")


@app.command()
@user_errors
def bench(
    configs: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="Train step configs: small, big (default both); decode: greedy generation on the small "
            "and GPT-2-sized decoders (decode-small, decode-gpt2: one of them); transcribe: Whisper's "
            "real-time factor (with --model); translate, summarize: each preset's training and decoding speed; "
            "serve: apps serve under concurrent clients (--model or --workdir; --clients, --seconds, --slots, "
            "--against, --fixed-lengths)."
        ),
    ] = None,
    steps: Annotated[int, typer.Option(help="Timed train steps per config, after warm-up.")] = 10,
    model: Annotated[
        Optional[str],
        typer.Option(
            help="A pretrained decoder (smollm2-135m-instruct, a .gguf file): its decode and finetune speed; "
            "a Whisper checkpoint with transcribe."
        ),
    ] = None,
    json_path: Annotated[
        Optional[Path], typer.Option("--json", help="Also write the figures to this JSON file.")
    ] = None,
    clients: Annotated[str, typer.Option(help="serve: concurrent client counts, comma-separated.")] = "1,4,16,64",
    seconds: Annotated[float, typer.Option(help="serve: seconds of load per client count.")] = 60.0,
    slots: Annotated[int, typer.Option(help="serve: slots of the batched server (its --max-batch).")] = 16,
    workdir: Annotated[
        Optional[Path], typer.Option(help="serve: a trained lm run to load, instead of --model's pretrained decoder.")
    ] = None,
    against: Annotated[
        Optional[list[str]], typer.Option(help="serve: another OpenAI-compatible base URL (…/v1) to load alike.")
    ] = None,
    context: Annotated[
        Optional[int], typer.Option(help="serve: positions per slot of the served model (apps serve --context).")
    ] = None,
    fixed_lengths: Annotated[
        bool,
        typer.Option(
            help="serve: each answer runs to its max_tokens (min_tokens = max_tokens: no end token is drawn "
            "before), so every server writes the same mix of output lengths."
        ),
    ] = False,
    dtype: Annotated[
        str, typer.Option(help="serve: the served model's generation weights (apps serve --dtype).")
    ] = "float32",
) -> None:
    """Time the core's jitted train step (tokens/s, step time, compile time, MFU) or decoding (new tokens/s)."""
    import json

    from core.bench import speed as bench_lib

    if configs in (["translate"], ["summarize"]):
        import tasks
        from tasks.nlp import bench as nlp_bench

        results = {configs[0]: nlp_bench.seq2seq(tasks.get(configs[0]), _console())}
    elif configs == ["serve"]:
        from core.serving import load as serve_bench

        try:
            counts = [int(c) for c in clients.split(",")]
        except ValueError:
            raise UserError(f"--clients {clients!r}: expected counts separated by commas, e.g. 1,4,16.") from None
        _check_dtype(dtype)
        if seconds <= 0 or slots < 2:
            raise UserError(f"--seconds {seconds:g}, --slots {slots}: seconds must be positive, slots at least 2.")
        if workdir is None:
            model = model or "smollm2-135m-instruct"
        elif model is not None:
            raise UserError("apps bench serve: give --model or --workdir, not both.")
        results = {
            "serve": serve_bench.main(
                model, workdir, counts, _console(), list(against or []), seconds, slots, context, fixed_lengths, dtype
            )
        }
    elif configs == ["transcribe"]:
        if model is None:
            raise UserError("apps bench transcribe needs --model (whisper-tiny.en, whisper-base).")
        from tasks.speech import bench as speech_bench

        results = {"transcribe": speech_bench.transcription(model, _console())}
    else:
        default = [] if model is not None else list(bench_lib.CONFIGS)
        results = bench_lib.main(configs or default, steps, _console(), model)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        typer.echo(f"Wrote {json_path}.")


def _show_task_log() -> None:
    """Tasks report counts (rows dropped, items skipped) on the "apps" logger: show them plainly."""
    logger = logging.getLogger("apps")
    if not logger.handlers:
        logger.addHandler(_StderrHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False


class _StderrHandler(logging.Handler):
    """Writes to whatever `sys.stderr` is at the time (test runners swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def _stdin_lines() -> list[str]:
    lines = []
    for number, raw in enumerate(sys.stdin.buffer.read().splitlines(), start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"stdin line {number} is not valid UTF-8.") from None
    return lines


def _print_metrics(
    title: str,
    metrics: dict,
    columns: dict | None = None,
    form: str = "table",
    output: Path | None = None,
    document=None,
) -> None:
    """A table of the model's metrics beside other columns (decodings, baselines) of metrics:
    one row a metric (`_write`'s formats; `document` is the JSON one)."""
    cells = {"model": metrics, **(columns or {})}
    names = [key for values in cells.values() for key, value in values.items() if isinstance(value, float)]
    rows = [
        {"metric": key, **{column: values.get(key) for column, values in cells.items()}} for key in dict.fromkeys(names)
    ]
    _write({title: rows}, form, output, document)


if __name__ == "__main__":
    app()
