"""`apps bench serve`: a language model's server under concurrent clients, side by side.

    apps bench serve --model smollm2-135m-instruct               # 1, 4, 16 and 64 clients
    apps bench serve --clients 1,16 --against http://127.0.0.1:8080/v1   # and another server

The same workload goes to `apps serve` with `--max-batch 8` (continuous batching), to the same
server forced to one slot (`--max-batch 1`: one request at a time), and to each `--against`
URL (any OpenAI-compatible server, such as llama.cpp's `llama-server` on the same GGUF). Each
client sends its requests one after another, streamed, so that the time to the first token is
seen; the requests mix short and long prompts (`PROMPTS`) and outputs (`MAX_TOKENS`), greedy,
in an order fixed by the request's number. Reported per server and client count: requests per
second, generated tokens per second (from each answer's usage; from a server that sends none,
such as llama-cpp-python's, the streamed chunks that carry text, one per token there), and the
median and 99th percentile of the latency and of the time to the first token.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from core.bench import figures
from core.errors import UserError

MAX_TOKENS = (16, 48, 96, 128)
_STORY = (
    "The harbour town woke slowly. Fishing boats came back with the tide, gulls followed them in, "
    "and the baker on the corner opened his shutters to the smell of bread and salt. "
)
PROMPTS = (
    "Write a haiku about rain.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    f"Summarize this story in one sentence: {_STORY * 2}",
    f"Continue this story: {_STORY * 6}",
    "What is the capital of France, and what river runs through it?",
)
ROOT = Path(__file__).resolve().parents[1]


def workload(count: int) -> list[tuple[str, int]]:
    """The `count` requests of a run, as (prompt, max_tokens): every prompt meets every length."""
    return [(PROMPTS[i % len(PROMPTS)], MAX_TOKENS[(i // len(PROMPTS)) % len(MAX_TOKENS)]) for i in range(count)]


def run_load(url: str, model: str, clients: int, requests: int, api_key: str | None = None) -> dict:
    """`clients` threads share `requests` streamed chat completions against `url` (an OpenAI
    base URL, ending in /v1) -> the figures of the module's text."""
    import httpx2 as httpx

    jobs = workload(requests)
    results: list[dict] = []
    lock, failures = threading.Lock(), []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def client(index: int) -> None:
        with httpx.Client(timeout=600, headers=headers) as session:
            for prompt, max_tokens in jobs[index::clients]:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                started, first, tokens, pieces = time.perf_counter(), None, None, 0
                try:
                    with session.stream("POST", f"{url}/chat/completions", json=body) as response:
                        if response.status_code != 200:
                            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:200]!r}")
                        for line in response.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if chunk.get("usage"):
                                tokens = chunk["usage"]["completion_tokens"]
                            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                                pieces += 1
                                if first is None:
                                    first = time.perf_counter() - started
                except Exception as error:  # a failed request is reported, not hidden in the figures
                    with lock:
                        failures.append(str(error))
                    continue
                latency = time.perf_counter() - started
                with lock:
                    results.append({"latency": latency, "first": first, "tokens": pieces if tokens is None else tokens})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if failures:
        raise UserError(f"{len(failures)} of {requests} requests to {url} failed; the first: {failures[0]}")
    latency = np.array([r["latency"] for r in results])
    first = np.array([r["first"] for r in results if r["first"] is not None])
    return {
        "clients": clients,
        "requests": requests,
        "seconds": seconds,
        "requests/s": requests / seconds,
        "tokens/s": sum(r["tokens"] for r in results) / seconds,
        "p50 latency": float(np.percentile(latency, 50)),
        "p99 latency": float(np.percentile(latency, 99)),
        "p50 first token": float(np.percentile(first, 50)) if len(first) else float("nan"),
        "p99 first token": float(np.percentile(first, 99)) if len(first) else float("nan"),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """`apps serve --model MODEL --max-batch N` in a subprocess, for the length of a `with`."""

    def __init__(self, model: str, max_batch: int, context: int | None = None):
        self.model, self.max_batch, self.context = model, max_batch, context

    def __enter__(self) -> str:
        port = _free_port()
        command = [sys.executable, "-m", "cli", "serve", "--model", self.model, "--port", str(port)]
        command += ["--max-batch", str(self.max_batch)]
        if self.context is not None:
            command += ["--context", str(self.context)]
        self.log = open(os.devnull, "w")  # noqa: SIM115 - closed in __exit__
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        import httpx2 as httpx

        deadline = time.monotonic() + 900
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise UserError(f"apps serve --model {self.model} did not start (exit {self.process.poll()}).")
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
    model: str,
    clients: list[int],
    console: Console,
    against: list[str] = (),
    requests: int | None = None,
    context: int | None = None,
) -> list[dict]:
    """The table of the module's text: this server batched and at one slot (each slot `context`
    positions long; None: the server's default), then each other one."""
    if any(c < 1 for c in clients):
        raise UserError("--clients: each count must be at least 1.")
    name = Path(model).name
    rows = []
    table = figures(
        f"apps serve under load: {name}",
        "streamed greedy chat completions, prompts and outputs mixed; tokens from each answer's usage "
        "(or its streamed pieces)",
        ("server", "clients", "requests", "req/s", "tokens/s", "p50 s", "p99 s", "p50 TTFT s", "p99 TTFT s"),
    )
    # Each target: its label and what gives its base URL for the length of its runs.
    targets = [(f"apps serve, {batch} slot{'s' * (batch > 1)}", _Server(model, batch, context)) for batch in (8, 1)]
    targets += [(url, contextlib.nullcontext(url.rstrip("/"))) for url in against]
    for label, server in targets:
        with server as url:
            found = [run_load(url, name, c, requests or max(2 * c, 12)) for c in clients]
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
