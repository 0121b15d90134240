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
({"error": {"message", "type", "param", "code"}}): 400 for a bad request, naming the field
(past a deployment's `RequestLimits` too); 401 without the key; 404 for an unknown model, task
or route; 405; 413 past `--max-body`; 499 (in the metrics) for a client gone; 503 with
Retry-After when the queue is full; 504 past `--timeout`; 500 for a failure inside the model,
for that request alone; 408 for a body that stops arriving for `--read-timeout` (`timeouts`,
which closes a connection slow to send a request's head too). No request value is ever read as
a path: inputs are texts and sequences (`Task.parse_request`). On SIGTERM uvicorn stops
accepting, the requests in flight finish, then the engines stop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import UserError
from core.options import PredictOptionError, RequestLimits, predict_option_values
from core.serving import audio, embeddings, tools
from core.serving.api import ApiError, ChatBody, CompletionBody, Deadline, EmbeddingsBody, PredictBody, within
from core.serving.batcher import Batcher
from core.serving.completions import Completions
from core.serving.metrics import Metrics
from core.serving.models import Served
from core.serving.timeouts import TIMED_OUT
from core.task import CompletingFeaturizer

log = logging.getLogger("apps")

ENDPOINTS = (
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
)
# The metrics' label of a path with a name in it: a label per route, not per path, so that a
# client's stray URLs do not grow the metrics.
ROUTES = (
    (re.compile(r"/v1/[a-z0-9-]+/predict"), "/v1/{task}/predict"),
    (re.compile(r"/v1/models/[^/]+"), "/v1/models/{id}"),
)


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
        limits: RequestLimits = RequestLimits(),
    ):
        if not served:
            raise UserError("Nothing to serve: give --workdir DIR (repeatable) or --model NAME.")
        names = [s.name for s in served]
        if len(set(names)) != len(names):
            raise UserError(
                f"Two served models share a name: {', '.join(names)}; give their runs distinct folder names."
            )
        self.served = {s.name: s for s in served}
        self.api_key, self.timeout, self.max_body, self.limits = api_key, timeout_s, max_body, limits
        self.metrics = Metrics()
        self.completions = Completions(self.metrics, timeout_s)
        for item in served:
            if item.engine is not None:
                self.metrics.watch(item.name, item.engine, item.adapter)
        self.max_batch, self.max_wait, self.queue_size = max_batch, max_wait_ms / 1000, queue_size
        self.app = FastAPI(title="apps serve", lifespan=self._lifespan)
        self._routes()

    async def _lifespan(self, app):
        for served in self.served.values():
            batching = dict(max_batch=self.max_batch, max_wait=self.max_wait, queue_size=self.queue_size)
            served.batcher = Batcher(served.name, served.rows, served.worker, **batching, metrics=self.metrics)
            served.batcher.start()
            if served.embeds:
                served.embedder = Batcher(served.name, served.states, served.worker, **batching, metrics=self.metrics)
                served.embedder.start()
            self.metrics.queue.labels(served.name).set_function(served.waiting)
        engines = list({id(s.engine): s.engine for s in self.served.values() if s.engine is not None}.values())
        for engine in engines:  # one per base, whatever adapters share it
            engine.start()
        yield
        for engine in engines:
            engine.stop(30)
        for served in self.served.values():
            served.worker.shutdown(wait=True)

    # Lookup ---------------------------------------------------------------------------------

    def model(self, name: str | None, task: str | None = None, generates: bool = False, embeds: bool = False) -> Served:
        candidates = [
            s
            for s in self.served.values()
            if (task is None or s.task.name == task) and (not generates or s.engine) and (not embeds or s.embeds)
        ]
        if name is not None:
            found = self.served.get(name)
            if found is None or found not in candidates:
                kind = (
                    "language model"
                    if generates
                    else "model that embeds"
                    if embeds
                    else f"{task} model"
                    if task
                    else "model"
                )
                known = ", ".join(s.name for s in candidates) or "none"
                raise ApiError(404, f"model: no {kind} {name!r} is served; served: {known}.", "model", "not_found")
            return found
        if len(candidates) == 1:
            return candidates[0]
        if not candidates:
            what = (
                "language model (lm run or pretrained decoder)"
                if generates
                else "model that embeds (a decoder or a protein run)"
                if embeds
                else f"{task} model"
            )
            raise ApiError(404, f"No {what} is served here.", "model", "not_found")
        raise ApiError(400, f"model: several are served ({', '.join(s.name for s in candidates)}); name one.", "model")

    # Routes ---------------------------------------------------------------------------------

    def _routes(self) -> None:
        self._guards()
        self._endpoints()
        self._completion_endpoints()
        self._embeddings_endpoint()
        self._audio_endpoints()

    def _guards(self) -> None:
        """The key and size checks and the metrics of every request, and errors as OpenAI's."""
        app, metrics = self.app, self.metrics

        app.add_middleware(_Guard, check=self._check, metrics=metrics)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, error: ApiError):
            headers = {"Retry-After": "1"} if error.status == 503 else None
            return error.response(headers)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, error: StarletteHTTPException):
            # Starlette's own refusals (no such route, a method the route lacks, a body that is
            # not UTF-8), in the same shape as every other error.
            param = "body" if error.status_code == 400 else None
            kind = "not_found" if error.status_code == 404 else "invalid_request_error"
            message = f"{request.method} {request.url.path}: {error.detail}."
            return ApiError(error.status_code, message, param, kind).response(error.headers)

        @app.exception_handler(Exception)
        async def failed(request: Request, error: Exception):
            log.exception("A request failed.")  # the detail, once, in the log; none of it in the body
            message = "The server failed on this request; its log has the details."
            return ApiError(500, message, kind="server_error").response()

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, error: RequestValidationError):
            # A field of several types (a text or a list of texts) fails once per type: the
            # error that got furthest says what is wrong. Its place is the body's own, without
            # the tags pydantic gives each type of a union ("list[str]").
            found = max(error.errors(), key=lambda e: (e["type"] == "value_error", len(e["loc"])))
            place = [str(part) for part in found["loc"] if part != "body" and "[" not in str(part)]
            where = ".".join(place) or "body"
            if found["type"] == "json_invalid":
                return ApiError(400, f"The body is not valid JSON ({found['msg']}).", "body").response()
            message = found["msg"].removeprefix("Value error, ")
            return ApiError(400, f"{where}: {message}.", where).response()

    def _endpoints(self) -> None:
        app = self.app

        @app.get("/health")
        async def health():
            return {"status": "ok", "models": list(self.served)}

        @app.get("/metrics")
        async def prometheus():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        def described(name: str) -> dict:
            return {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "apps",
                "task": self.served[name].task.name,
            }

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [described(name) for name in self.served]}

        @app.get("/v1/models/{name}")
        async def model(name: str):
            return described(self.model(name).name)

        @app.post("/v1/{task}/predict")
        async def predict(task: str, body: PredictBody):
            served = self.model(body.model, task)
            try:
                values = predict_option_values(served.task, body.options)
            except PredictOptionError as error:
                where = f"options.{error.name}"
                raise ApiError(400, f"{where}: {error.detail}", where) from None
            self._check_inputs(body.inputs)
            deadline = Deadline(self.timeout)
            try:  # off the event loop, on the request's clock: audio is decoded and resampled here
                parsed = asyncio.to_thread(served.task.parse_request, body.inputs, values, self.limits)
                examples = await within(parsed, deadline)
            except ApiError as error:
                if error.status != 400:
                    raise
                raise ApiError(400, error.message, error.param or "inputs") from None
            if served.engine is not None:  # a decoder: each prompt and its new tokens within the context
                served.check_room(examples, values)
            rows = await within(served.batcher.predict(examples, values), deadline)
            return {"model": served.name, "task": served.task.name, "predictions": rows}

    def _completion_endpoints(self) -> None:
        """OpenAI's completions and chat completions, for the language models."""
        app = self.app

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, client: Request):
            served = self.model(body.model, generates=True)
            return await self.completions.answer(
                served, body, _prompt_ids(served, body.prompt), "text_completion", client
            )

        @app.post("/v1/chat/completions")
        async def chat(body: ChatBody, client: Request):
            served = self.model(body.model, generates=True)
            featurizer: CompletingFeaturizer = served.predictor.featurizer
            if featurizer.tokenizer.chat_template is None:
                raise ApiError(400, f"model: {served.name} has no chat template; use /v1/completions.", "model")
            offer = tools.offer(body, featurizer.tokenizer.tool_format)
            messages = [m.plain() for m in body.messages]
            example = {"text": messages[-1]["content"], "messages": messages, "content_markers": body.content_markers}
            ids = [featurizer.prompt(example | ({"tools": offer.functions} if offer is not None else {}))]
            return await self.completions.answer(served, body, ids, "chat.completion", client, offer)

    def _embeddings_endpoint(self) -> None:
        @self.app.post("/v1/embeddings")
        async def embed(body: EmbeddingsBody):
            return await embeddings.answer(self.model(body.model, embeds=True), body, self.limits, self.timeout)

    def _audio_endpoints(self) -> None:
        """OpenAI's transcriptions and translations, for the speech task's runs and Whisper."""

        async def answer(client: Request, translate: bool):
            fields = await audio.read_form(client)
            served = self.model(fields.get("model"), task="speech")
            return await audio.answer(served, fields, translate, self.limits, self.timeout)

        @self.app.post("/v1/audio/transcriptions")
        async def transcriptions(client: Request):
            return await answer(client, translate=False)

        @self.app.post("/v1/audio/translations")
        async def translations(client: Request):
            return await answer(client, translate=True)

    def _check_inputs(self, inputs: list[str]) -> None:
        if len(inputs) > self.limits.inputs:
            raise ApiError(
                400,
                f"inputs: {len(inputs)} inputs, more than the {self.limits.inputs} a request may hold here.",
                "inputs",
            )
        blank = next((i for i, text in enumerate(inputs) if not text.strip()), None)
        if blank is not None:
            raise ApiError(400, f"inputs.{blank}: an empty input; give text (or an upload) in each.", f"inputs.{blank}")

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


def _prompt_ids(served: Served, prompt) -> list[list[int]]:
    """A completion request's prompts as ids: texts tokenized as documents begin (after the
    start id), ids taken as given, each id within the vocabulary."""
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    if not prompts or any(not p for p in prompts):
        raise ApiError(400, "prompt: give a non-empty text or list of ids (or a list of them).", "prompt")
    if isinstance(prompts[0], str):
        return [served.predictor.featurizer.prompt({"text": p}) for p in prompts]
    vocabulary = served.engine.vocab_size
    for index, ids in enumerate(prompts):
        if not all(0 <= i < vocabulary for i in ids):
            where = "prompt" if prompts is not prompt else f"prompt.{index}"
            raise ApiError(400, f"{where}: token ids are from 0 to {vocabulary - 1} for this model.", where)
    return [list(ids) for ids in prompts]


class _Guard:
    """The key and size checks and the metrics of every request, as plain ASGI middleware: a
    request's time runs to the end of its body (a stream's whole length, not the time to its
    headers), and the handler keeps the connection's own `receive`, through which it learns that
    a client has gone (Starlette's `BaseHTTPMiddleware` hides that from it)."""

    def __init__(self, app, check, metrics: Metrics):
        self.app, self.check, self.metrics = app, check, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else next((r for p, r in ROUTES if p.fullmatch(path)), "other")
        started = time.perf_counter()

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                # A body that timed out was answered 408 by the protocol (`timeouts`), whatever the route then says.
                status = 408 if scope.get(TIMED_OUT) else message["status"]
                self.metrics.requests.labels(endpoint, str(status)).inc()
            await send(message)

        if scope["method"] == "POST":
            scope = _json_by_default(scope)
        try:
            self.check(Request(scope))
        except ApiError as error:
            await error.response()(scope, receive, counted)
        else:
            await self.app(scope, receive, counted)
        finally:
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)


def _json_by_default(scope: dict) -> dict:
    """A POST's scope with its body read as JSON unless it says it is a form's upload: OpenAI and
    llama-server parse a body without a Content-Type, or with curl's default form type, as JSON."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    given = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
    if given.lower().startswith(b"multipart/form-data") or given.lower().startswith(b"application/json"):
        return scope
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
