"""OpenAI's completions and chat completions over a language model's generation engine.

A request's prompts (each `n` times) become requests of the slot engine (`core.generation.slots`),
which runs them continuously batched with every other request's; each choice is a `Choice` that
turns the tokens the engine emits into text (`core.generation.detokenize`), cuts it at the
first stop sequence and keeps its finish reason. The answer is one JSON body, or server-sent
events as the text comes (`stream`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from core.errors import UserError
from core.generation.detokenize import Detokenizer
from core.generation.grammar import Constraint, json_grammar
from core.generation.slot_sampling import Scores
from core.generation.slots import QueueFull
from core.generation.slots import Request as Generation
from core.serving import logprobs
from core.serving.api import ApiError, Sampling, within
from core.serving.metrics import Metrics
from core.serving.models import Served
from core.task import CompletingFeaturizer


class Completions:
    """Answers completion requests for the served language models, counting into `metrics`."""

    def __init__(self, metrics: Metrics, timeout: float):
        self.metrics, self.timeout = metrics, timeout

    async def answer(
        self, served: Served, body: Sampling, prompts: list[list[int]], kind: str, client: Request, offer=None
    ):
        """The response to `body` (of `kind` "text_completion" or "chat.completion") for the
        tokenized `prompts`, with the functions `offer` gives the model (`core.serving.tools`): a
        JSON body, or an event stream. A `client` who leaves before the answer is whole frees its
        slots at once, streamed or not."""
        choices = self._submit(served, body, prompts, kind, offer)
        chat = kind == "chat.completion"
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        prompt_tokens = sum(len(p) for p in prompts)
        if body.stream:
            usage = prompt_tokens if body.stream_options is not None and body.stream_options.include_usage else None
            return _EventStream(self._events(served, choices, ident, chat, usage), media_type="text/event-stream")
        try:
            await within(_unless_gone(asyncio.gather(*(c.finished for c in choices)), client), self.timeout)
        finally:
            for choice in choices:
                choice.request.cancel()  # a timed-out, failed or abandoned request frees its slot
        self._count(served, choices)
        return {
            "id": ident,
            "object": kind,
            "created": int(time.time()),
            "model": served.name,
            "choices": [
                {"index": c.index, "finish_reason": c.reason, "logprobs": c.logprobs(c.scored)}
                | ({"message": c.message()} if chat else {"text": c.text})
                for c in choices
            ],
            "usage": _usage(prompt_tokens, choices),
        }

    def _submit(self, served: Served, body: Sampling, prompts: list[list[int]], kind: str, offer) -> list[Choice]:
        """Every choice of the request, its generation queued in the engine (or none: a 503)."""
        engine, stops = served.engine, body.stops()
        wanted = len(prompts) * body.n
        if wanted > engine.waiting.maxsize:  # it could never be queued, however idle the server
            raise ApiError(
                400,
                f"{'n' if body.n > 1 else 'prompt'}: {len(prompts)} prompt(s) x n={body.n} make {wanted} "
                f"generations, more than the {engine.waiting.maxsize} this server queues (apps serve --queue).",
                "n" if body.n > 1 else "prompt",
            )
        max_new = _max_new_tokens(engine.context, body, prompts, kind)
        bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
        if any(token >= engine.vocab_size for token in bias):
            outside = max(bias)
            raise ApiError(
                400, f"logit_bias: token {outside} is outside the model's {engine.vocab_size} ids.", "logit_bias"
            )
        alternatives, chat = body.wanted_logprobs(), kind == "chat.completion"
        constraint = _constraint(served, body, offer)
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        events: asyncio.Queue = asyncio.Queue()  # every choice's new text, as it comes (for streaming)
        loop = asyncio.get_running_loop()
        featurizer: CompletingFeaturizer = served.predictor.featurizer
        choices = []
        for index in range(wanted):
            choice = Choice(featurizer.continuation, prompts[index // body.n], stops, index, events, loop, chat, offer)
            choice.request = Generation(
                choice.prompt,
                max_new,
                choice.emit,
                temperature=body.temperature,
                top_p=body.top_p,
                seed=(seed + index) % 2**32,
                stop_ids=frozenset(featurizer.tokenizer.stop_ids),
                min_new=max_new if body.ignore_eos else body.min_tokens,
                logprobs=alternatives,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logit_bias=bias,
                constraint=constraint() if constraint is not None else None,
                adapter=served.adapter,
            )
            choices.append(choice)
        try:
            for choice in choices:
                engine.submit(choice.request)
        except QueueFull:
            for choice in choices:
                choice.request.cancel()
            raise ApiError(503, "The server is at capacity: retry shortly.", kind="overloaded") from None
        return choices

    def _count(self, served: Served, choices: list[Choice]) -> None:
        self.metrics.tokens.labels(served.name).inc(sum(len(c.text_of.ids) for c in choices))
        for choice in choices:
            if choice.first is not None:
                self.metrics.first_token.labels(served.name).observe(choice.first)

    async def _events(
        self, served: Served, choices: list[Choice], ident: str, chat: bool, prompt_tokens: int | None
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece of new text of any choice, a last chunk per
        choice with its finish reason, a chunk of the token counts when `prompt_tokens` is given
        (stream_options.include_usage), then [DONE]. A client that goes away cancels them all."""
        head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion"}
        head |= {"created": int(time.time()), "model": served.name}
        events, open_choices, counted = choices[0].events, len(choices), False
        try:
            if chat:
                for choice in choices:
                    role = {"role": "assistant", "content": ""}
                    yield _event(head | {"choices": [{"index": choice.index, "delta": role, "finish_reason": None}]})
            while open_choices:
                try:
                    index, text, reason, scores = await asyncio.wait_for(events.get(), self.timeout)
                except TimeoutError:
                    yield _event({"error": {"message": "timed out", "type": "timeout", "param": None, "code": 504}})
                    return
                if reason is not None:
                    open_choices -= 1
                content = {"delta": choices[index].delta(text, reason)} if chat else {"text": text}
                yield _event(
                    head | {"choices": [{"index": index, **content, "finish_reason": reason, "logprobs": scores}]}
                )
            self._count(served, choices)  # before the end reaches the client, who may read the metrics next
            counted = True
            if prompt_tokens is not None:
                yield _event(head | {"choices": [], "usage": _usage(prompt_tokens, choices)})
            yield "data: [DONE]\n\n"
        finally:
            for choice in choices:
                choice.request.cancel()
            if not counted:  # cut off, timed out or failed: what was made still counts
                self._count(served, choices)


def _constraint(served: Served, body: Sampling, offer) -> Callable[[], Constraint] | None:
    """What makes each answer's grammar: response_format's, or a forced tool call's (None: free)."""
    schema = body.response_format.schema() if body.response_format is not None else None
    grammar = offer.grammar() if offer is not None else None
    if schema is not None and offer is not None:
        raise ApiError(400, "response_format: give it or tools (with tool_choice none), not both.", "response_format")
    if schema is not None:
        try:
            grammar = json_grammar(schema)
        except UserError as error:
            raise ApiError(400, f"response_format: {error}.", "response_format") from None
    for field in ("min_tokens", "ignore_eos"):
        if grammar is not None and getattr(body, field):
            raise ApiError(400, f"{field}: an answer kept to a grammar ends where its grammar does.", field)
    return served.constraints(grammar, "response_format" if schema is not None else "tools")


def _max_new_tokens(context: int, body: Sampling, prompts: list[list[int]], kind: str) -> int:
    """The request's max_tokens, checked against the room its longest prompt leaves in a slot
    (OpenAI's default: 16 for a completion, the rest of the context for a chat)."""
    room = context - max(len(p) for p in prompts)
    name, asked = body.new_tokens()
    max_new = asked if asked is not None else min(room, 16 if kind == "text_completion" else room)
    if room < 1 or max_new > room:
        raise ApiError(
            400,
            f"{name}: the prompt takes {context - room} of the {context} positions of the "
            f"context, which leaves {max(room, 0)} for new tokens.",
            name,
        )
    if body.min_tokens > max_new:
        raise ApiError(400, f"min_tokens: {body.min_tokens} is more than {name} ({max_new}).", "min_tokens")
    return max_new


async def _unless_gone(answer: asyncio.Future, client: Request):
    """`answer`'s result, or ApiError 499 once `client` has hung up (a non-streamed request:
    Starlette tells its handler nothing, so the connection is asked every POLL seconds)."""
    answer.add_done_callback(_retrieved)
    watch = asyncio.ensure_future(_gone(client))
    try:
        done, _ = await asyncio.wait({answer, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not answer.done():  # gone, or this wait cut off by the timeout
            answer.cancel()
    if answer not in done:
        raise ApiError(499, "The client closed the connection before the answer was ready.", kind="client_closed")
    return answer.result()


def _retrieved(future: asyncio.Future) -> None:
    """Marks the outcome of a future nobody may await again as seen: a gathering of choices whose
    client left ends in a CancelledError that asyncio would otherwise log as never retrieved,
    three ERROR lines a request."""
    if not future.cancelled():
        future.exception()


POLL = 0.1


async def _gone(client: Request) -> None:
    while not await client.is_disconnected():
        await asyncio.sleep(POLL)


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


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion_tokens = sum(len(c.text_of.ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _undecided(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that begins some stop sequence."""
    return max((k for s in stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])), default=0)


class Choice:
    """One choice: its tokens as the engine emits them (on the engine's thread, handed to the
    event loop), turned into text, cut at the first stop sequence, with its finish reason and
    the tool calls read from it (where `offer` offers functions). Each change goes to `events`
    as (index, new text, finish reason); text that may begin a stop sequence or a tool call is
    held back until it is decided, so a stream never sends a part of one."""

    def __init__(
        self, continuation, prompt: list[int], stops: list[str], index: int, events, loop, chat: bool, offer=None
    ):
        self.prompt, self.stops, self.index, self.events, self.loop = prompt, stops, index, events, loop
        self.text_of = Detokenizer(continuation, prompt)
        self.chat, self.offer = chat, offer
        self.calls: list[dict] = []  # the tool calls of a finished answer, in OpenAI's shape
        self.scored: list[logprobs.Entry] = []  # each token's scores, if the request asked
        self.streamed = 0  # of them, sent in a stream's chunks
        self.text, self.sent, self.reason = "", 0, None
        self.first: float | None = None
        self.request: Generation | None = None
        self.finished: asyncio.Future = loop.create_future()
        self._started = time.perf_counter()

    def emit(self, token: int | None, reason: str | None, scores: Scores | None = None) -> None:
        self.loop.call_soon_threadsafe(self._take, token, reason, scores)  # from the engine's thread

    def _take(self, token: int | None, reason: str | None, scores: Scores | None = None) -> None:
        if self.reason is not None:
            return
        if token is not None:
            if self.first is None:
                self.first = time.perf_counter() - self._started
            if scores is not None:
                self.scored.append(((self.text_of.ids or self.prompt)[-1], token, scores))
            text = self.text_of.add(token)
            if text is None:
                return  # the rest of a character is still to come
            cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut < 0:  # what may begin a stop sequence waits until the next tokens decide
                self._send(self._shown(text), None)
                return
            self.request.cancel()
            self._end(text[:cut], "stop")
            return
        if reason.startswith("error"):
            self._fail(reason)
            return
        self._end(self.text_of.text(), "length" if reason == "length" else "stop")

    def _shown(self, text: str) -> str:
        """What a stream may send of the answer so far: not what may begin a stop sequence and,
        where functions are offered, nothing from a call on, nor the space before one (an
        answer that opens with JSON may be a bare call: it waits whole; a forced answer is calls
        alone)."""
        held = self.stops
        if self.offer is not None:
            if self.offer.forced is not None or not text.strip() or text.lstrip().startswith(("{", "[")):
                return ""
            opening = self.offer.format.OPENING
            text, held = text.split(opening, 1)[0], [*held, opening]
            return text[: len(text) - _undecided(text, held)].rstrip()
        return text[: len(text) - _undecided(text, held)]

    def _end(self, text: str, reason: str) -> None:
        if self.offer is not None:
            content, self.calls = self.offer.read(text)
            if self.calls:
                text, reason = content, "tool_calls"
        self._send(text, reason)

    def message(self) -> dict:
        """The finished answer as a chat message: its text, or its tool calls and any text beside."""
        if self.calls:
            return {"role": "assistant", "content": self.text or None, "tool_calls": self.calls}
        return {"role": "assistant", "content": self.text}

    def delta(self, text: str, reason: str | None) -> dict:
        """A stream chunk's change to the message: new text, and the calls with the end of an answer that made them."""
        delta = {"content": text} if text else {}
        if reason == "tool_calls":
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(self.calls)]
        return delta

    def _send(self, text: str, reason: str | None) -> None:
        # The text sent so far, then the rest (an answer's text besides its calls may be trimmed).
        new, offset = (text[self.sent :] if text.startswith(self.text[: self.sent]) else ""), self.sent
        self.text, self.sent = text, len(text)
        if reason is not None:
            self.reason = reason
        if new or reason is not None:
            scored, self.streamed = self.scored[self.streamed :], len(self.scored)
            self.events.put_nowait((self.index, new, reason, self.logprobs(scored, offset)))
        if reason is not None and not self.finished.done():
            self.finished.set_result(None)

    def logprobs(self, scored: list[logprobs.Entry], offset: int = 0) -> dict | None:
        """`scored` tokens' log-probabilities in the endpoint's shape (None: not asked)."""
        if self.request.logprobs is None:
            return None
        if self.chat:
            return logprobs.chat(scored, self.text_of.continuation)
        return logprobs.completion(scored, self.text_of.continuation, offset)

    def _fail(self, reason: str) -> None:
        self.reason = "error"
        self.events.put_nowait((self.index, "", "error", None))
        if not self.finished.done():
            self.finished.set_exception(RuntimeError(reason))
