"""`apps bench serve`: a language model's server under concurrent clients, side by side.

    apps bench serve --model smollm2-135m-instruct               # 1, 4, 16 and 64 clients
    apps bench serve --clients 1,16 --against http://127.0.0.1:8080/v1   # and another server

The same workload goes to `apps serve` with `--max-batch 16` (continuous batching), to the same
server forced to one slot (`--max-batch 1`: one request at a time), and to each `--against`
URL (any OpenAI-compatible server, such as llama.cpp's `llama-server` on the same GGUF). Each
client sends streamed completion requests (`/v1/completions`, greedy) one after another for
`seconds`; the requests mix short and long prompts (`PROMPTS`) and outputs (`MAX_TOKENS`), in
an order fixed by the request's number. A model often ends an answer well before its
max_tokens; `--fixed-lengths` sends `ignore_eos` (as vLLM's and llama-server's take it: the
end tokens never end an answer), so every server writes the lengths of the mix. A request
whose kept-alive connection the server had closed is sent again on a new one, as the openai
client does (llama-server closes idle connections), never one that had begun answering.

The figures are of that window alone, so that they measure the server loaded by `clients`, not
a ramp-up or a tail where fewer clients are left: the tokens are those streamed within it (each
finished answer's usage, or the chunks that carried text where a server sends no usage, as
llama-cpp-python's does, one token each there; an answer still streaming at the end counts the
chunks it had received), the requests those finished within it; an answer still streaming at
the end is cut off (the server frees its slot). Reported per server and client count: requests
per second, generated tokens per second, and the median and 99th percentile of the latency and
of the time to the first token.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from core.bench.timing import figures
from core.errors import UserError
from core.predict import check_dtype

MAX_TOKENS = (16, 48, 96, 128)
STORY = (
    "The harbour town woke slowly. Fishing boats came back with the tide, gulls followed them in, "
    "and the baker on the corner opened his shutters to the smell of bread and salt. "
)
PROMPTS = (
    "Write a haiku about rain.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    f"Summarize this story in one sentence: {STORY * 2}",
    f"Continue this story: {STORY * 6}",
    "What is the capital of France, and what river runs through it?",
)
SECONDS = 60.0
ROOT = Path(__file__).resolve().parents[2]  # the repository, where `python -m cli` runs


def job(number: int) -> tuple[str, int]:
    """Request `number` of a run, as (prompt, max_tokens): every prompt meets every length."""
    return PROMPTS[number % len(PROMPTS)], MAX_TOKENS[(number // len(PROMPTS)) % len(MAX_TOKENS)]


def run_load(
    url: str,
    model: str,
    clients: int,
    seconds: float = SECONDS,
    api_key: str | None = None,
    fixed_lengths: bool = False,
) -> dict:
    """`clients` threads send streamed completions to `url` (an OpenAI base URL, ending in /v1)
    for `seconds`, client i sending requests i, i + clients, i + 2 clients, ... -> the figures
    of the module's text, with the counts behind them ("tokens", "requests", "cut": answers cut
    off at the end). `fixed_lengths`: each request runs to its max_tokens (`ignore_eos`)."""
    load = _Load(url, model, clients, time.perf_counter() + seconds, api_key, fixed_lengths)
    threads = [threading.Thread(target=load.client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if load.failures:
        raise UserError(f"{len(load.failures)} requests to {url} failed; the first: {load.failures[0]}")
    latency = np.array([r["latency"] for r in load.finished] or [np.nan])
    first = np.array([r["first"] for r in load.finished if r["first"] is not None] or [np.nan])
    return {
        "clients": clients,
        "seconds": seconds,
        "requests": len(load.finished),
        "cut": load.cut,
        "tokens": load.tokens,
        "requests/s": len(load.finished) / seconds,
        "tokens/s": load.tokens / seconds,
        "p50 latency": float(np.percentile(latency, 50)),
        "p99 latency": float(np.percentile(latency, 99)),
        "p50 first token": float(np.percentile(first, 50)),
        "p99 first token": float(np.percentile(first, 99)),
    }


class _Load:
    """The clients of one `run_load` and what they counted, under one lock: the finished
    requests (latency, time to the first token), the tokens streamed within the window, the
    answers cut off at its end, and the failures."""

    def __init__(self, url: str, model: str, clients: int, deadline: float, api_key, fixed_lengths: bool):
        self.url, self.model, self.clients, self.deadline = url, model, clients, deadline
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.fixed_lengths = fixed_lengths
        self.lock = threading.Lock()
        self.finished: list[dict] = []
        self.failures: list[str] = []
        self.tokens = self.cut = 0

    def client(self, index: int) -> None:
        """Requests index, index + clients, ... one after another until the deadline."""
        import httpx2 as httpx

        with httpx.Client(timeout=600, headers=self.headers) as session:
            number = index
            while time.perf_counter() < self.deadline:
                try:
                    self.request(session, number)
                except Exception as error:  # a failed request is reported, not hidden in the figures
                    with self.lock:
                        self.failures.append(str(error))
                    return
                number += self.clients

    def request(self, session, number: int) -> None:
        """Request `number`, streamed: counted when it finishes, or cut off at the deadline."""
        prompt, max_tokens = job(number)
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        } | ({"ignore_eos": True} if self.fixed_lengths else {})
        sent, first, usage, pieces = time.perf_counter(), None, None, 0
        with self.opened(session, body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:200]!r}")
            for line in response.iter_lines():
                now = time.perf_counter()
                if now > self.deadline:  # cut off: closing the stream frees the server's slot
                    with self.lock:
                        self.tokens += pieces
                        self.cut += 1
                    return
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    pieces += 1
                    first = now - sent if first is None else first
        with self.lock:
            self.tokens += pieces if usage is None else usage
            self.finished.append({"latency": time.perf_counter() - sent, "first": first})

    def opened(self, session, body: dict):
        """The streamed response to `body`, sent again on a new connection where the kept-alive
        one turns out closed before any answer came."""
        import httpx2 as httpx

        def send():
            return contextlib.closing(
                session.send(session.build_request("POST", f"{self.url}/completions", json=body), stream=True)
            )

        try:
            return send()
        except httpx.RemoteProtocolError:  # the pool drops the closed connection: the next send opens one
            return send()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`apps serve SOURCE --max-batch N` in a subprocess, for the length of a `with`; SOURCE is
    `--model NAME` or `--workdir DIR`."""

    def __init__(self, source: list[str], max_batch: int, context: int | None = None, dtype: str = "float32"):
        self.source, self.max_batch, self.context, self.dtype = source, max_batch, context, dtype

    def __enter__(self) -> str:
        port = _free_port()
        command = [sys.executable, "-m", "cli", "serve", *self.source, "--port", str(port)]
        command += ["--max-batch", str(self.max_batch), "--dtype", self.dtype]
        if self.context is not None:
            command += ["--context", str(self.context)]
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in __exit__
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        import httpx2 as httpx

        deadline = time.monotonic() + 900
        while True:
            code = self.process.poll()
            if code is not None or time.monotonic() > deadline:
                self.process.kill()
                self.process.wait()
                self.log.seek(0)
                said = "\n".join(self.log.read().splitlines()[-15:])
                self.log.close()
                ended = f"exit {code}" if code is not None else "no answer in 900 s"
                raise UserError(f"apps serve {' '.join(self.source)} did not start ({ended}); it said:\n{said}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return f"{url}/v1"
            except httpx.TransportError:
                time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(120)
        self.log.close()


def main(
    model: str | None,
    workdir: Path | None,
    clients: list[int],
    console: Console,
    against: list[str] = (),
    seconds: float = SECONDS,
    slots: int = 16,
    context: int | None = None,
    fixed_lengths: bool = False,
    dtype: str = "float32",
) -> list[dict]:
    """The table of the module's text: `apps serve` of a pretrained `model` (a name or a file;
    SmolLM2's instruct model by default) or of a trained language model's `workdir`, with
    `slots` slots and with one (each slot `context` positions long, None: the server's default;
    its weights in `dtype`), then each other one; `seconds` of load per client count."""
    if workdir is not None and model is not None:
        raise UserError("apps bench serve: give --model or --workdir, not both.")
    model = (model or "smollm2-135m-instruct") if workdir is None else None
    check_dtype(dtype)
    if any(c < 1 for c in clients):
        raise UserError("--clients: each count must be at least 1.")
    if seconds <= 0 or slots < 2:
        raise UserError(f"--seconds {seconds:g}, --slots {slots}: seconds must be positive, slots at least 2.")
    from core.serving.models import served_name

    name = served_name(model=model, workdir=workdir)  # what each request names
    source = ["--model", model] if workdir is None else ["--workdir", str(workdir)]
    rows = []
    table = figures(
        f"apps serve under load: {name}, {dtype} weights",
        f"streamed greedy completions, prompts and outputs mixed{' (each to its max_tokens)' * fixed_lengths}, "
        f"{seconds:g} s per client count; tokens "
        "streamed within them, requests finished within them",
        ("server", "clients", "requests", "req/s", "tokens/s", "p50 s", "p99 s", "p50 TTFT s", "p99 TTFT s"),
    )
    # Each target: its label and what gives its base URL for the length of its runs.
    targets = [
        (f"apps serve, {batch} slot{'s' * (batch > 1)}", Server(source, batch, context, dtype)) for batch in (slots, 1)
    ]
    targets += [(url, contextlib.nullcontext(url.rstrip("/"))) for url in against]
    for label, server in targets:
        with server as url:
            found = [run_load(url, name, c, seconds, fixed_lengths=fixed_lengths) for c in clients]
        for figure in found:
            rows.append({"server": label, **figure})
            table.add_row(
                label,
                str(figure["clients"]),
                str(figure["requests"]),
                f"{figure['requests/s']:.2f}",
                f"{figure['tokens/s']:.1f}",
                f"{figure['p50 latency']:.2f}",
                f"{figure['p99 latency']:.2f}",
                f"{figure['p50 first token']:.2f}",
                f"{figure['p99 first token']:.2f}",
            )
    console.print(table)
    return rows
