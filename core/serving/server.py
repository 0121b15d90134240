"""`apps serve`: trained runs and shipped checkpoints behind HTTP (FastAPI on uvicorn).

    apps serve --workdir runs/sentiment --workdir runs/lm --port 8000
    apps serve --model smollm2-135m-instruct --api-key "$KEY"

Every task: `POST /v1/{task}/predict` with {"inputs": [...], "options": {...}, "model": ...}:
the inputs and options that `apps predict` takes (by option name, JSON-typed), answered with
the rows that it prints. Requests with the same options that arrive within `--max-wait-ms` of
each other run as one call of up to `--max-batch` inputs (`Batcher`), padded as evaluation pads
(fixed shapes: nothing recompiles once warm).

Language models (the lm task's runs and the pretrained decoders) also answer OpenAI's API:
`GET /v1/models`, `POST /v1/completions` and, with a chat template, `POST /v1/chat/completions`
(max_tokens, temperature, top_p, stop, seed, n, stream as server-sent events), continuously
batched in `--max-batch` slots of one KV cache (`core.generation.slots`): the official `openai` client
works against it unchanged.

`GET /health` answers without a key; `GET /metrics` gives Prometheus counters and histograms
(requests by endpoint and status, latencies, batch sizes, queue depth, tokens generated, time
to the first token). With `--api-key` (or APPS_API_KEY) every other request needs
`Authorization: Bearer KEY`, compared in constant time. Errors are OpenAI-shaped JSON
({"error": {"message", "type", "param", "code"}}): 400 for a bad request, naming the field;
401 without the key; 404 for an unknown model or task; 413 past `--max-body`; 503 with
Retry-After when the queue is full; 504 past `--timeout`; 500 for a failure inside the model,
for that request alone. No request value is ever read as a path: inputs are texts and
sequences (`Task.parse_request`). On SIGTERM uvicorn stops accepting, the requests in flight
finish, then the engines stop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from core.errors import UserError
from core.generation.slots import Engine, QueueFull
from core.generation.slots import Request as Generation

log = logging.getLogger("apps")


ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
PREDICT = re.compile(r"/v1/[a-z0-9-]+/predict")


class ApiError(Exception):
    """A request's failure as its status and OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self, headers: dict | None = None) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=headers)


# Request bodies: unknown fields are refused (a misspelt option should not pass silently).


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PredictBody(Strict):
    inputs: list[str] = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class StreamOptions(Strict):
    include_usage: bool = False  # a last chunk with the token counts, before [DONE]


class Sampling(Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    # As vLLM's and llama-cpp-python's servers take it: the model's end tokens cannot be drawn
    # before this many new tokens (min_tokens = max_tokens fixes a load benchmark's output lengths).
    min_tokens: int = Field(default=0, ge=0)
    user: str | None = None
    stream_options: StreamOptions | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop: at most 4 sequences, none empty.", "stop")
        return stops


class CompletionBody(Sampling):
    prompt: str | list[str]


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)


# Metrics --------------------------------------------------------------------------------------


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("apps_requests", "Requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.latency = Histogram("apps_request_seconds", "Request latency", ["endpoint"], registry=r)
        self.batch = Histogram(
            "apps_batch_requests", "Requests per predict call", ["model"], buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.slots = Histogram(
            "apps_decode_slots", "Active slots per decode step", ["model"], buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.queue = Gauge("apps_queue_depth", "Requests waiting", ["model"], registry=r)
        self.tokens = Counter("apps_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.first_token = Histogram(
            "apps_time_to_first_token_seconds", "Time to the first token", ["model"], registry=r
        )
        self.busy = Gauge("apps_busy_slots", "Generation slots in use", ["model"], registry=r)
        self.prefills = Gauge("apps_prefills", "Requests prefilled into a slot so far", ["model"], registry=r)

    def watch(self, served: Served) -> None:
        """Reads a language model's engine: its slots in use at each scrape, its batch at each step."""
        engine = served.engine
        if engine is not None:
            self.busy.labels(served.name).set_function(engine.busy)
            self.prefills.labels(served.name).set_function(lambda: engine.prefills)
            engine.on_step = self.slots.labels(served.name).observe


# Predict batching -----------------------------------------------------------------------------


@dataclass
class _Pending:
    examples: list[dict]
    values: dict[str, Any]
    key: str
    future: asyncio.Future


class Batcher:
    """Collects predict requests for up to `max_wait` seconds or `max_batch` inputs and runs
    those with the same options as one call, on the model's one worker thread."""

    def __init__(self, served: Served, max_batch: int, max_wait: float, queue_size: int, metrics: Metrics):
        self.served, self.max_batch, self.max_wait, self.metrics = served, max_batch, max_wait, metrics
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=queue_size)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def predict(self, examples: list[dict], values: dict[str, Any]) -> list[dict]:
        future = asyncio.get_running_loop().create_future()
        try:
            self.queue.put_nowait(_Pending(examples, values, json.dumps(values, sort_keys=True, default=str), future))
        except asyncio.QueueFull:
            raise ApiError(503, "The server is at capacity: retry shortly.", kind="overloaded") from None
        self.metrics.queue.labels(self.served.name).set(self.queue.qsize())
        return await future

    async def _loop(self) -> None:
        held: list[_Pending] = []
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
            self.metrics.queue.labels(self.served.name).set(self.queue.qsize() + len(held))
            self.metrics.batch.labels(self.served.name).observe(len(batch))
            batch = [p for p in batch if not p.future.done()]  # timed out while waiting
            if batch:
                await self._run(batch)

    async def _run(self, batch: list[_Pending]) -> None:
        groups = [p.examples for p in batch]
        try:
            rows = await asyncio.get_running_loop().run_in_executor(
                self.served.worker, self.served.rows, groups, batch[0].values
            )
        except Exception as error:
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(error)
            return
        for pending, found in zip(batch, rows):
            if not pending.future.done():
                pending.future.set_result(found)


# What is served -------------------------------------------------------------------------------


@dataclass
class Served:
    """One model: a trained run or a checkpoint, loaded once (`core.run.Predictor`), with its
    worker thread, its predict batcher and, for a language model, its generation engine."""

    name: str
    predictor: Any
    engine: Engine | None = None
    worker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))
    batcher: Batcher | None = None

    @property
    def task(self):
        return self.predictor.task

    def rows(self, groups: list[list[dict]], values: dict[str, Any]) -> list[list[dict]]:
        """Each request's rows, its examples run with every other request's in one call."""
        examples = [e for group in groups for e in group]
        predictions = self.predictor.run_examples(examples, values)
        featurizer = self.predictor.featurizer
        rows = self.task.render(predictions, examples, featurizer)
        bounds = np.cumsum([0, *(len(group) for group in groups)])
        if len(rows) == len(examples):  # a row per example (most tasks)
            return [rows[a:b] for a, b in zip(bounds, bounds[1:])]
        # Several rows per example (recsys: one per recommended item): predictions indexed by
        # example are cut per request and rendered apart.
        if not all(len(value) == len(examples) for value in predictions.values()):
            raise RuntimeError(f"{self.task.name}'s predictions cannot be told apart by request")
        return [
            self.task.render({k: v[a:b] for k, v in predictions.items()}, group, featurizer)
            for group, a, b in zip(groups, bounds, bounds[1:])
        ]


def typed_options(task, given: dict[str, Any]) -> dict[str, Any]:
    """A predict request's options by name, checked against the task's declared types."""
    declared = {option.name: option for option in task.predict_options}
    values = {name: option.default for name, option in declared.items()}
    for name, value in given.items():
        option = declared.get(name)
        if option is None:
            names = ", ".join(declared) or "none"
            raise ApiError(
                400, f"options.{name}: {task.name} takes no such option; its options: {names}.", f"options.{name}"
            )
        expected = (int, float) if option.type is float else option.type
        if isinstance(value, bool) != (option.type is bool) or not isinstance(value, expected):
            if not (value is None and option.default is None):
                raise ApiError(
                    400, f"options.{name}: expected {option.type.__name__}, got {value!r}.", f"options.{name}"
                )
        values[name] = value
    return values


class Server:
    """The FastAPI application over the served models (see the module's text)."""

    def __init__(
        self,
        served: list[Served],
        *,
        api_key: str | None = None,
        max_batch: int = 8,
        max_wait_ms: float = 5.0,
        queue_size: int = 256,
        timeout_s: float = 300.0,
        max_body: int = 4 * 1024 * 1024,
    ):
        if not served:
            raise UserError("Nothing to serve: give --workdir DIR (repeatable) or --model NAME.")
        names = [s.name for s in served]
        if len(set(names)) != len(names):
            raise UserError(
                f"Two served models share a name: {', '.join(names)}; give their runs distinct folder names."
            )
        self.served = {s.name: s for s in served}
        self.api_key, self.timeout, self.max_body = api_key, timeout_s, max_body
        self.metrics = Metrics()
        for item in served:
            self.metrics.watch(item)
        self.max_batch, self.max_wait, self.queue_size = max_batch, max_wait_ms / 1000, queue_size
        self.app = FastAPI(title="apps serve", lifespan=self._lifespan)
        self._routes()

    async def _lifespan(self, app):
        for served in self.served.values():
            served.batcher = Batcher(served, self.max_batch, self.max_wait, self.queue_size, self.metrics)
            served.batcher.start()
            if served.engine is not None:
                served.engine.start()
        yield
        for served in self.served.values():
            if served.engine is not None:
                served.engine.stop(30)
            served.worker.shutdown(wait=True)

    # Lookup ---------------------------------------------------------------------------------

    def model(self, name: str | None, task: str | None = None, generates: bool = False) -> Served:
        candidates = [
            s for s in self.served.values() if (task is None or s.task.name == task) and (not generates or s.engine)
        ]
        if name is not None:
            found = self.served.get(name)
            if found is None or found not in candidates:
                kind = "language model" if generates else f"{task} model" if task else "model"
                known = ", ".join(s.name for s in candidates) or "none"
                raise ApiError(404, f"model: no {kind} {name!r} is served; served: {known}.", "model", "not_found")
            return found
        if len(candidates) == 1:
            return candidates[0]
        if not candidates:
            what = "language model (lm run or pretrained decoder)" if generates else f"{task} model"
            raise ApiError(404, f"No {what} is served here.", "model", "not_found")
        raise ApiError(400, f"model: several are served ({', '.join(s.name for s in candidates)}); name one.", "model")

    # Routes ---------------------------------------------------------------------------------

    def _routes(self) -> None:
        app, metrics = self.app, self.metrics

        @app.middleware("http")
        async def guard(request: Request, call_next):
            path = request.url.path
            # A label per route, not per path: a client's stray URLs must not grow the metrics.
            endpoint = path if path in ENDPOINTS else "/v1/{task}/predict" if PREDICT.fullmatch(path) else "other"
            started = time.perf_counter()
            try:
                self._check(request)
                response = await call_next(request)
            except ApiError as error:
                response = error.response()
            metrics.requests.labels(endpoint, str(response.status_code)).inc()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
            return response

        @app.exception_handler(ApiError)
        async def api_error(request: Request, error: ApiError):
            headers = {"Retry-After": "1"} if error.status == 503 else None
            return error.response(headers)

        @app.exception_handler(Exception)
        async def failed(request: Request, error: Exception):
            log.exception("A request failed.")
            message = f"The server failed on this request ({type(error).__name__}: {error})."
            return ApiError(500, message, kind="server_error").response()

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, error: RequestValidationError):
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
            if first["type"] == "json_invalid":
                return ApiError(400, f"The body is not valid JSON ({first['msg']}).", "body").response()
            return ApiError(400, f"{where}: {first['msg']}.", where).response()

        @app.get("/health")
        async def health():
            return {"status": "ok", "models": list(self.served)}

        @app.get("/metrics")
        async def prometheus():
            return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            data = [
                {"id": name, "object": "model", "created": 0, "owned_by": "apps", "task": s.task.name}
                for name, s in self.served.items()
            ]
            return {"object": "list", "data": data}

        @app.post("/v1/{task}/predict")
        async def predict(task: str, body: PredictBody):
            served = self.model(body.model, task)
            values = typed_options(served.task, body.options)
            try:  # off the event loop: audio is decoded and resampled here
                examples = await asyncio.to_thread(served.task.parse_request, body.inputs, values)
            except UserError as error:
                raise ApiError(400, str(error), "inputs") from None
            rows = await self._within(served.batcher.predict(examples, values))
            return {"model": served.name, "task": served.task.name, "predictions": rows}

        @app.post("/v1/completions")
        async def completions(body: CompletionBody):
            served = self.model(body.model, generates=True)
            prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            if not prompts or any(not p for p in prompts):
                raise ApiError(400, "prompt: give a non-empty text (or a list of them).", "prompt")
            ids = [served.predictor.featurizer.prompt({"text": p}) for p in prompts]
            return await self._generate(served, body, ids, "text_completion")

        @app.post("/v1/chat/completions")
        async def chat(body: ChatBody):
            served = self.model(body.model, generates=True)
            featurizer = served.predictor.featurizer
            if featurizer.tokenizer.chat_template is None:
                raise ApiError(400, f"model: {served.name} has no chat template; use /v1/completions.", "model")
            messages = [m.model_dump() for m in body.messages]
            ids = [featurizer.prompt({"text": messages[-1]["content"], "messages": messages})]
            return await self._generate(served, body, ids, "chat.completion")

    def _check(self, request: Request) -> None:
        """The key (all but /health) and the body's size, before the body is read."""
        if self.api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.api_key.encode()):
                raise ApiError(
                    401, "A valid API key is needed: send Authorization: Bearer KEY.", None, "authentication_error"
                )
        length = request.headers.get("content-length")
        if request.method == "POST" and length is None:
            # A chunked body's size is known only once read: the limit needs it up front.
            raise ApiError(411, "Send the body with a Content-Length header.", "body")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            raise ApiError(413, f"The body is larger than the {self.max_body} bytes this server takes.", "body")

    async def _within(self, awaitable):
        try:
            return await asyncio.wait_for(awaitable, self.timeout)
        except TimeoutError:
            raise ApiError(
                504, f"The request took longer than the server's {self.timeout:g} s timeout.", kind="timeout"
            ) from None
        except UserError as error:
            raise ApiError(400, str(error)) from None
        except ApiError:
            raise
        except Exception as error:
            log.exception("A request failed inside the model.")
            raise ApiError(
                500, f"The model failed on this request ({type(error).__name__}: {error}).", kind="server_error"
            ) from None

    # Generation -----------------------------------------------------------------------------

    async def _generate(self, served: Served, body: Sampling, prompts: list[list[int]], kind: str):
        engine = served.engine
        stops = body.stops()
        room = engine.context - max(len(p) for p in prompts)
        max_new = (
            body.max_tokens if body.max_tokens is not None else min(room, 16 if kind == "text_completion" else room)
        )
        if room < 1 or max_new > room:
            raise ApiError(
                400,
                f"max_tokens: the prompt takes {engine.context - room} of the {engine.context} positions of the "
                f"context, which leaves {max(room, 0)} for new tokens.",
                "max_tokens",
            )
        if body.min_tokens > max_new:
            raise ApiError(400, f"min_tokens: {body.min_tokens} is more than max_tokens ({max_new}).", "min_tokens")
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        events: asyncio.Queue = asyncio.Queue()  # every choice's new text, as it comes (for streaming)
        streams = [
            _Stream(served, prompt, stops, index, events)
            for index, prompt in enumerate(prompts[i // body.n] for i in range(len(prompts) * body.n))
        ]
        loop = asyncio.get_running_loop()
        requests = [
            Generation(
                s.prompt,
                max_new,
                s.emitter(loop),
                temperature=body.temperature,
                top_p=body.top_p,
                seed=(seed + s.index) % 2**32,
                stop_ids=frozenset(served.predictor.featurizer.tokenizer.stop_ids),
                min_new=body.min_tokens,
            )
            for s in streams
        ]
        for stream, request in zip(streams, requests):
            stream.request = request
        try:
            for request in requests:
                engine.submit(request)
        except QueueFull:
            for request in requests:
                request.cancel()
            raise ApiError(503, "The server is at capacity: retry shortly.", kind="overloaded") from None
        self.metrics.queue.labels(served.name).set(engine.waiting.qsize())
        chat = kind == "chat.completion"
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        prompt_tokens = sum(len(p) for p in prompts)
        if body.stream:
            usage = prompt_tokens if body.stream_options is not None and body.stream_options.include_usage else None
            events_stream = self._events(served, streams, events, ident, chat, usage)
            return _EventStream(events_stream, media_type="text/event-stream")
        try:
            await self._within(asyncio.gather(*(s.finished for s in streams)))
        finally:
            for request in requests:
                request.cancel()  # a timed-out or failed request frees its slot
        self._count(served, streams)
        choices = [
            {"index": s.index, "finish_reason": s.reason, "logprobs": None}
            | ({"message": {"role": "assistant", "content": s.text}} if chat else {"text": s.text})
            for s in streams
        ]
        return {
            "id": ident,
            "object": kind,
            "created": int(time.time()),
            "model": served.name,
            "choices": choices,
            "usage": _usage(prompt_tokens, streams),
        }

    def _count(self, served: Served, streams: list[_Stream]) -> None:
        self.metrics.tokens.labels(served.name).inc(sum(len(s.ids) for s in streams))
        for stream in streams:
            if stream.first is not None:
                self.metrics.first_token.labels(served.name).observe(stream.first)

    async def _events(
        self,
        served: Served,
        streams: list[_Stream],
        events: asyncio.Queue,
        ident: str,
        chat: bool,
        prompt_tokens: int | None,
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece of new text of any choice, a last chunk per
        choice with its finish reason, a chunk of the token counts when `prompt_tokens` is given
        (stream_options.include_usage), then [DONE]. A client that goes away cancels them all."""
        head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion"}
        head |= {"created": int(time.time()), "model": served.name}
        open_streams, counted = len(streams), False
        try:
            if chat:
                for stream in streams:
                    role = {"role": "assistant", "content": ""}
                    yield _event(head | {"choices": [{"index": stream.index, "delta": role, "finish_reason": None}]})
            while open_streams:
                try:
                    index, text, reason = await asyncio.wait_for(events.get(), self.timeout)
                except TimeoutError:
                    yield _event({"error": {"message": "timed out", "type": "timeout", "param": None, "code": 504}})
                    return
                if reason is not None:
                    open_streams -= 1
                content = {"delta": {"content": text} if text else {}} if chat else {"text": text}
                yield _event(
                    head | {"choices": [{"index": index, **content, "finish_reason": reason, "logprobs": None}]}
                )
            self._count(served, streams)  # before the end reaches the client, who may read the metrics next
            counted = True
            if prompt_tokens is not None:
                yield _event(head | {"choices": [], "usage": _usage(prompt_tokens, streams)})
            yield "data: [DONE]\n\n"
        finally:
            for stream in streams:
                stream.request.cancel()
            if not counted:  # cut off, timed out or failed: what was made still counts
                self._count(served, streams)


class _EventStream(StreamingResponse):
    """Server-sent events that close their generator however the response ends. Starlette leaves
    a generator cut off at a `yield` (the client gone while a chunk was being sent) to garbage
    collection, which may come much later: till then its finally block, which frees the slots and
    counts the tokens, would not run."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _usage(prompt_tokens: int, streams: list[_Stream]) -> dict[str, int]:
    completion_tokens = sum(len(s.ids) for s in streams)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Stream:
    """One choice: its tokens as the engine emits them, turned into text (held back while a
    piece ends inside a character), cut at the first stop sequence, with its finish reason."""

    def __init__(self, served: Served, prompt: list[int], stops: list[str], index: int, events: asyncio.Queue):
        self.featurizer, self.prompt, self.stops, self.index = served.predictor.featurizer, prompt, stops, index
        self.events = events  # (index, new text, finish reason) of each change
        self.ids: list[int] = []
        self.text, self.sent, self.reason = "", 0, None
        self.first: float | None = None
        self.request: Generation | None = None
        self.finished: asyncio.Future | None = None
        self._started = time.perf_counter()

    def emitter(self, loop: asyncio.AbstractEventLoop):
        self.finished = loop.create_future()

        def emit(token: int | None, reason: str | None) -> None:  # on the engine's thread
            loop.call_soon_threadsafe(self._take, token, reason)

        return emit

    def _take(self, token: int | None, reason: str | None) -> None:
        if self.reason is not None:
            return
        if token is not None:
            if self.first is None:
                self.first = time.perf_counter() - self._started
            self.ids.append(token)
            text = self.featurizer.continuation(self.prompt, self.ids)
            if text.endswith("\ufffd"):
                return  # the rest of a character is still to come
            cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut < 0:
                self._send(text, None)
                return
            self.request.cancel()
            self._send(text[:cut], "stop")
            return
        if reason.startswith("error"):
            self._fail(reason)
            return
        text = self.featurizer.continuation(self.prompt, self.ids)
        self._send(text, "length" if reason == "length" else "stop")

    def _send(self, text: str, reason: str | None) -> None:
        new = text[self.sent :]
        self.text, self.sent = text, len(text)
        if reason is not None:
            self.reason = reason
        if new or reason is not None:
            self.events.put_nowait((self.index, new, reason))
        if reason is not None and not self.finished.done():
            self.finished.set_result(None)

    def _fail(self, reason: str) -> None:
        self.reason = "error"
        error = RuntimeError(reason)
        self.events.put_nowait((self.index, "", "error"))
        if not self.finished.done():
            self.finished.set_exception(error)


def load(
    workdirs: list[Path],
    models: list[str],
    task_named: Callable[[str], type],
    decoder_task: type,
    *,
    slots: int,
    context: int | None,
    queue: int,
    dtype: str = "float32",
) -> list[Served]:
    """The served models: each run of `workdirs` (its task read from its config.json and found
    by `task_named`, the registry's lookup) and each pretrained decoder of `models` (served by
    `decoder_task`, which `completes`), loaded and, for a language model, given an engine whose
    weights are in `dtype` (`core.model.precision.narrowed`)."""
    from core import run
    from core.training.checkpoints import read_json

    served = []
    for workdir in workdirs:
        config = Path(workdir) / "config.json"
        if not config.is_file():
            raise UserError(f"{workdir} holds no trained run (no config.json).")
        name = read_json(config, "train the run again into a new --workdir.").get("task")
        predictor = run.Predictor(task_named(name), workdir)
        served.append(Served(served_name(workdir=workdir), predictor, _engine(predictor, slots, context, queue, dtype)))
    for model in models:
        predictor = run.Predictor(decoder_task, model=model)
        served.append(Served(served_name(model=model), predictor, _engine(predictor, slots, context, queue, dtype)))
    return served


def served_name(*, model: str | None = None, workdir: str | Path | None = None) -> str:
    """The name a served model answers to (`"model"` in requests, GET /v1/models): a run's
    folder name, or a checkpoint's name or file name."""
    return Path(workdir).resolve().name if workdir is not None else Path(model).name


DEFAULT_CONTEXT = 2048


def _engine(predictor, slots: int, context: int | None, queue: int, dtype: str) -> Engine | None:
    """A generation engine for a language model (a task that `completes`), its slots `context` positions
    long (default: the model's, at most DEFAULT_CONTEXT: each slot's cache is that long), at
    most `queue` requests waiting; None for any other task."""
    if not predictor.task.completes:
        return None
    limit = predictor.task.config.model.max_len
    if context is not None and not 2 <= context <= limit:
        raise UserError(f"--context {context}: must be from 2 to the model's {limit} positions.")
    context = context or min(limit, DEFAULT_CONTEXT)
    return Engine(predictor.model, slots=slots, context=context, queue_size=queue, dtype=dtype)
