"""`apps serve`: its settings checked, the runs and checkpoints loaded and compiled, then the
HTTP server run until it is stopped."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from core.errors import UserError
from core.model import kernels
from core.options import RequestLimits
from core.predict import check_dtype
from core.training import host


@dataclass(frozen=True)
class Settings:
    """How `apps serve` listens and batches (its options, with the same names)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_wait_ms: float = 5.0
    context: int | None = None
    dtype: str = "float32"
    prompt_cache: int = 8
    queue: int = 256
    timeout: float = 300.0
    api_key: str | None = None
    allow_unauthenticated: bool = False
    read_timeout: float = 30.0
    max_inputs: int = 64
    max_audio_seconds: float = 600.0

    def loopback(self) -> bool:
        """Whether the server listens on this machine alone."""
        try:
            return self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name other than localhost
            return False

    def check(self) -> None:
        """Every setting a user can get wrong, named before anything loads."""
        if self.api_key is None and not self.loopback() and not self.allow_unauthenticated:
            raise UserError(
                f"--host {self.host} listens beyond this machine: give --api-key (or APPS_API_KEY), or "
                "--allow-unauthenticated to serve anyone who can reach it."
            )
        least_one = min(self.max_batch, self.queue, self.max_inputs)
        times = min(self.timeout, self.read_timeout, self.max_audio_seconds)
        if least_one < 1 or times <= 0 or min(self.max_wait_ms, self.prompt_cache) < 0:
            raise UserError(
                "--max-batch, --queue and --max-inputs must be at least 1, --timeout, --read-timeout and "
                "--max-audio-seconds positive, --max-wait-ms and --prompt-cache at least 0."
            )
        check_dtype(self.dtype)


def serve(
    workdirs: list[Path],
    models: list[str],
    task_of: Callable[[str], type],
    task_for: Callable[[str], type],
    settings: Settings,
    console: Console,
) -> None:
    """Loads the trained runs `workdirs` (their task found by `task_of(name)`) and the pretrained
    checkpoints `models` (each as the task `task_for` it runs it: a decoder as lm, Whisper as
    speech), compiles each generation engine and says what it compiled, then serves them until
    the process is stopped."""
    settings.check()
    import uvicorn

    from core.serving import server as server_lib
    from core.serving import timeouts
    from core.serving.models import load

    served = load(
        workdirs,
        models,
        task_of,
        task_for,
        slots=settings.max_batch,
        context=settings.context,
        queue=settings.queue,
        dtype=settings.dtype,
        prompt_cache=settings.prompt_cache,
    )
    _warm_up_all(served, settings, console)
    server = server_lib.Server(
        served,
        api_key=settings.api_key,
        max_batch=settings.max_batch,
        max_wait_ms=settings.max_wait_ms,
        queue_size=settings.queue,
        timeout_s=settings.timeout,
        limits=RequestLimits(settings.max_inputs, settings.max_audio_seconds),
    )
    access = (
        "a key is required"
        if settings.api_key
        else "no key: loopback only"
        if settings.loopback()
        else "no key, open to all"
    )
    url = f"http://{settings.host}:{settings.port}"
    console.print(f"{kernels.chosen().describe()}.")
    console.print(f"Serving {', '.join(s.name for s in served)} at {url} ({access}).")
    # No websockets are served: an upgrade would hand the connection to a protocol without the read clock.
    http = timeouts.protocol(settings.read_timeout)
    config = uvicorn.Config(
        server.app, host=settings.host, port=settings.port, http=http, ws="none", log_level="warning"
    )
    uvicorn.Server(config).run()


def _warm_up_all(served, settings: Settings, console) -> None:
    """Every served model compiled before the first request; then freed memory goes back to the
    system: a server's load comes and goes, and what a request's arrays took is returned after
    it, not kept as a training process keeps it (core/training/host.py)."""
    warmed: dict[int, str] = {}  # engines compiled, by id: the name of the model that compiled each
    for item in served:
        console.print(_warm_up(item, settings, warmed))
    host.give_back_freed_memory()


def _warm_up(item, settings: Settings, warmed: dict[int, str]) -> str:
    """Compiles a served model's generation engine (if it has one, and no model before it shared
    it) and says what it compiled."""
    engine = item.engine
    if engine is None:
        return f"{item.name} ({item.task.name}): predictions batched up to {settings.max_batch} inputs."
    role = f"LoRA adapter {item.adapter} of {engine.adapters}" if item.adapter else "the base weights"
    if id(engine) in warmed:
        return f"{item.name} ({item.task.name}): {role}, on {warmed[id(engine)]}'s engine."
    warmed[id(engine)] = item.name
    timings = engine.warm_up()
    widths = ", ".join(str(w) for w in engine.widths())
    rows = ", ".join(str(n) for n in engine.row_counts())
    shared = f" ({role}, the base's shared with {engine.adapters} LoRA adapters)" if engine.adapters else ""
    return (
        f"{item.name} ({item.task.name}): {settings.max_batch} slots of {engine.context} positions, "
        f"{settings.dtype} weights{shared}, holding {engine.held.describe()}; compiled the decode step over "
        f"{rows} rows and prefills of width {widths} in {sum(timings.values()):.1f} s."
    )
