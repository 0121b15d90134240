"""`apps bench embed`: texts embedded per second by `apps serve`'s `POST /v1/embeddings`.

    apps bench embed                              # SmolLM2's mean-pooled states (its instruct model)
    apps bench embed --workdir runs/minilm-10     # a sentiment run's encoder (MiniLM fine-tuned)

The server (`--max-batch 32`) is loaded three ways, each for `seconds`: one client sending one
text a request (batch 1), one client sending 32 texts a request (batch 32), and 32 clients
sending one text each, which the server's batcher gathers into calls. The texts are sentences
of 6 to 40 words in a fixed cycle. Reported: texts and their tokens embedded per second, and
the median latency, of the requests finished within the window.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from core.bench.timing import figures
from core.errors import UserError
from core.serving.load import STORY, Server

TEXTS = (
    "The train was late again this morning.",
    "Please send me the report before the meeting on Thursday afternoon.",
    "A good dress fits well, washes well and does not need ironing.",
    STORY.strip(),
    "Why is the sky blue?",
    f"{STORY}{STORY}".strip(),
)
LOADS = ((1, 1), (1, 32), (32, 1))  # (clients, texts a request)
MAX_BATCH = 32


def run_embeddings(url: str, model: str, clients: int, per_request: int, seconds: float, api_key=None) -> dict:
    """`clients` threads send embeddings requests of `per_request` texts to `url` (an OpenAI
    base URL) one after another for `seconds` -> texts/s, tokens/s (the answers' usage) and the
    median latency."""
    import httpx2 as httpx

    deadline, lock, latencies, failures, tokens = time.perf_counter() + seconds, threading.Lock(), [], [], []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def client(index: int) -> None:
        with httpx.Client(timeout=120, headers=headers) as session:
            number = index
            while time.perf_counter() < deadline:
                texts = [TEXTS[(number + k) % len(TEXTS)] for k in range(per_request)]
                sent = time.perf_counter()
                response = session.post(f"{url}/embeddings", json={"model": model, "input": texts})
                if response.status_code != 200 or len(response.json()["data"]) != per_request:
                    with lock:
                        failures.append(f"HTTP {response.status_code}: {response.text[:200]}")
                    return
                if time.perf_counter() <= deadline:
                    with lock:
                        latencies.append(time.perf_counter() - sent)
                        tokens.append(response.json()["usage"]["prompt_tokens"])
                number += clients

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise UserError(f"{len(failures)} embeddings requests to {url} failed; the first: {failures[0]}")
    return {
        "clients": clients,
        "texts per request": per_request,
        "requests": len(latencies),
        "texts/s": len(latencies) * per_request / seconds,
        "tokens/s": sum(tokens) / seconds,
        "p50 latency": float(np.median(latencies)) if latencies else float("nan"),
    }


def main(model: str | None, workdir: Path | None, console: Console, seconds: float = 20.0) -> list[dict]:
    """The table of the module's text for a pretrained decoder `model` (SmolLM2's instruct model
    by default) or a trained run's `workdir` (a sentiment, protein or lm run)."""
    if workdir is not None and model is not None:
        raise UserError("apps bench embed: give --model or --workdir, not both.")
    if seconds <= 0:
        raise UserError(f"--seconds {seconds:g}: must be positive.")
    from core.serving.models import served_name

    model = (model or "smollm2-135m-instruct") if workdir is None else None
    name = served_name(model=model, workdir=workdir)
    source = ["--model", model] if workdir is None else ["--workdir", str(workdir)]
    table = figures(
        f"apps serve /v1/embeddings: {name}",
        f"sentences of 6-40 words, {seconds:g} s a load; requests finished within it",
        ("clients", "texts a request", "requests", "texts/s", "tokens/s", "p50 s"),
    )
    with Server(source, MAX_BATCH) as url:
        run_embeddings(url, name, 1, MAX_BATCH, 1.0)  # the first calls compile
        rows = [run_embeddings(url, name, c, n, seconds) for c, n in LOADS]
    for row in rows:
        table.add_row(
            str(row["clients"]), str(row["texts per request"]), str(row["requests"]), f"{row['texts/s']:.1f}",
            f"{row['tokens/s']:.0f}", f"{row['p50 latency']:.3f}",
        )  # fmt: skip
    console.print(table)
    return rows
