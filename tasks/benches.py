"""`apps bench`, the tasks' part: the core's group (core.bench.commands) with the subcommands
that time a task's own pipeline added, each calling one function of its domain.

apps bench transcribe --model NAME     # Whisper's real-time factor (tasks/speech/bench.py)
apps bench translate                   # translate's presets: training and decoding (tasks/nlp/bench.py)
apps bench summarize                   # summarize's presets, likewise
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from core import terminal
from core.bench import commands
from core.bench.commands import JsonOpt
from core.errors import UserError
from core.terminal import user_errors

app = commands.app


@app.command("transcribe")
@user_errors
def bench_transcribe(
    model: Annotated[Optional[str], typer.Option(metavar="NAME", help="whisper-tiny.en or whisper-base.")] = None,
    json_path: JsonOpt = None,
) -> None:
    """Whisper's real-time factor on short and long clips."""
    if model is None:
        raise UserError("apps bench transcribe needs --model (whisper-tiny.en, whisper-base).")
    from core.bench import timing
    from tasks.speech import bench as speech_bench

    timing.save_figures("transcribe", speech_bench.transcription(model, terminal.console()), json_path)


@app.command("translate")
@user_errors
def bench_translate(json_path: JsonOpt = None) -> None:
    """translate's presets: training tokens/s and decoding examples/s."""
    _bench_seq2seq("translate", json_path)


@app.command("summarize")
@user_errors
def bench_summarize(json_path: JsonOpt = None) -> None:
    """summarize's presets: training tokens/s and decoding examples/s."""
    _bench_seq2seq("summarize", json_path)


def _bench_seq2seq(task: str, json_path: Path | None) -> None:
    import tasks
    from core.bench import timing
    from tasks.nlp import bench as nlp_bench

    task_type = tasks.get(task)
    terminal.show_task_log()
    timing.save_figures(task, nlp_bench.seq2seq(task_type, terminal.console()), json_path)
