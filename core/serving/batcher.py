"""Predict batching: requests with the same options that arrive close together run as one call.

Requests wait up to `max_wait` seconds, or until `max_batch` inputs have gathered, and run on
the model's one worker thread, padded as evaluation pads (fixed shapes: nothing recompiles once
warm). A request with other options waits for the next call.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from core.generation import abandon
from core.serving.api import ApiError
from core.serving.metrics import Metrics


@dataclass
class _Pending:
    examples: list[dict]
    values: dict[str, Any]
    key: str
    future: asyncio.Future


class Batcher:
    """Collects predict requests for up to `max_wait` seconds or `max_batch` inputs and runs
    those with the same options as one call of `rows` (each request's examples -> each one's
    rows) on `worker`, the model's one thread; `name` labels its metrics."""

    def __init__(
        self,
        name: str,
        rows: Callable[[list[list[dict]], dict[str, Any]], list[list[dict]]],
        worker: Executor,
        *,
        max_batch: int,
        max_wait: float,
        queue_size: int,
        metrics: Metrics,
    ):
        self.name, self.rows, self.worker = name, rows, worker
        self.max_batch, self.max_wait, self.metrics = max_batch, max_wait, metrics
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=queue_size)
        self.task: asyncio.Task | None = None
        self.held: list[_Pending] = []  # taken from the queue, waiting for a call with their options

    def waiting(self) -> int:
        return self.queue.qsize() + len(self.held)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def predict(self, examples: list[dict], values: dict[str, Any]) -> list[dict]:
        future = asyncio.get_running_loop().create_future()
        try:
            self.queue.put_nowait(_Pending(examples, values, json.dumps(values, sort_keys=True, default=str), future))
        except asyncio.QueueFull:
            raise ApiError(503, "The server is at capacity: retry shortly.", kind="overloaded") from None
        return await future

    async def _loop(self) -> None:
        held = self.held
        while True:
            first = held.pop(0) if held else await self.queue.get()
            batch, size = [first], len(first.examples)
            deadline = time.monotonic() + self.max_wait
            while size < self.max_batch:
                same = next((p for p in held if p.key == first.key), None)
                if same is not None:
                    held.remove(same)
                else:
                    try:
                        left = deadline - time.monotonic()
                        # Past the wait, what has already arrived still joins.
                        same = await asyncio.wait_for(self.queue.get(), left) if left > 0 else self.queue.get_nowait()
                    except (TimeoutError, asyncio.QueueEmpty):
                        break
                    if same.key != first.key:
                        held.append(same)
                        continue
                batch.append(same)
                size += len(same.examples)
            self.metrics.batch.labels(self.name).observe(len(batch))
            batch = [p for p in batch if not p.future.done()]  # timed out while waiting
            if batch:
                await self._run(batch)

    async def _run(self, batch: list[_Pending]) -> None:
        groups = [p.examples for p in batch]
        # Once every request of the call has given up (each past its timeout: a 504 sent), the
        # call's generations end at their next step, freeing the worker for those still waiting.
        gone = threading.Event()

        def given_up(_) -> None:
            if all(p.future.done() for p in batch):
                gone.set()

        for pending in batch:
            pending.future.add_done_callback(given_up)
        try:
            call = functools.partial(abandon.run, gone, self.rows, groups, batch[0].values)
            rows = await asyncio.get_running_loop().run_in_executor(self.worker, call)
        except Exception as error:
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(error)
            return
        for pending, found in zip(batch, rows):
            if not pending.future.done():
                pending.future.set_result(found)
