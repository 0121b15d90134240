"""What the server's HTTP layer speaks: OpenAI-shaped errors and the request bodies it accepts.

Errors are {"error": {"message", "type", "param", "code"}} with the request's status; bodies are
pydantic models that refuse unknown fields, so that a misspelt option is a 400 naming it, and
take JSON's types strictly, as OpenAI's API does (`"10"` or `true` is not a number of tokens).
Every text is checked to be one that UTF-8 can carry: JSON's escapes can spell half of a
surrogate pair (`"\ud800"`), which no tokenizer can encode.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from core.errors import UserError
from core.generation.slot_sampling import BIASED
from core.options import PredictOptionError

log = logging.getLogger("apps")


class ApiError(Exception):
    """A request's failure as its status and OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self, headers: dict | None = None) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=headers)


class Deadline:
    """A request's `seconds` from now, shared by the steps of its work (decoding an upload, then
    the model): each waits for what the ones before it left."""

    def __init__(self, seconds: float):
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def left(self) -> float:
        return max(self.end - time.monotonic(), 0.0)


async def within(awaitable, timeout: float | Deadline):
    """`awaitable`'s result within `timeout` seconds (or what is left of a request's `Deadline`),
    its failures as the request's status: 504 past the time, 400 for a UserError, 500 for
    anything else inside the model."""
    deadline = timeout if isinstance(timeout, Deadline) else Deadline(timeout)
    try:
        return await asyncio.wait_for(awaitable, deadline.left())
    except TimeoutError:
        raise ApiError(
            504, f"The request took longer than the server's {deadline.seconds:g} s timeout.", kind="timeout"
        ) from None
    except PredictOptionError as error:  # the task's own check of an option, named as the request names it
        raise ApiError(400, f"options.{error.name}: {error.detail}", f"options.{error.name}") from None
    except UserError as error:
        raise ApiError(400, str(error)) from None
    except ApiError:
        raise
    except Exception:
        log.exception("A request failed inside the model.")
        raise ApiError(
            500, "The model failed on this request; the server's log has the details.", kind="server_error"
        ) from None


def _texts(value: Any):
    """Every text in `value`: strings, and an object's keys as well as its values."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _texts(key)
            yield from _texts(item)
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)


def encodable(value: Any) -> Any:
    """`value` (a text, or JSON holding texts), refused if a text holds a lone surrogate."""
    for text in _texts(value):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            where = f"{text[error.start]!r} at character {error.start}"
            raise ValueError(f"holds a lone surrogate ({where}), which is not text") from None
    return value


Text = Annotated[str, AfterValidator(encodable)]


def token_biases(value: dict[str, float]) -> dict[str, float]:
    """A logit_bias as OpenAI's API takes it: token ids (JSON's keys are text) to -100..100."""
    if len(value) > BIASED:
        raise ValueError(f"names {len(value)} tokens, more than {BIASED}")
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"{key!r} is not a token id")
        if not -100 <= bias <= 100:
            raise ValueError(f"token {key}: {bias} is outside -100 to 100")
    return value


class Strict(BaseModel):
    """A request body whose unknown fields are refused (a misspelt option should not pass
    silently) and whose values have JSON's types as given."""

    model_config = ConfigDict(extra="forbid", strict=True)


class PredictBody(Strict):
    inputs: list[Text] = Field(min_length=1)
    options: Annotated[dict[str, Any], AfterValidator(encodable)] = Field(default_factory=dict)
    model: Text | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: Text


def json_object(text: str) -> str:
    """A function call's arguments: a JSON object, written as a text (as OpenAI's API has them)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"is not JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(value, dict):
        raise ValueError("is not a JSON object")
    return text


class Function(Strict):
    """A function offered to the model: its name, what it does, its parameters' JSON schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(encodable)] | None = None
    strict: bool | None = None  # a forced call's arguments always follow the schema

    def definition(self) -> dict[str, Any]:
        """The function as a chat template reads it."""
        return self.model_dump(exclude_none=True, exclude={"strict"})


class Tool(Strict):
    type: Literal["function"]
    function: Function


class CalledFunction(Strict):
    name: Text
    arguments: Annotated[str, AfterValidator(encodable), AfterValidator(json_object)]


class ToolCall(Strict):
    """A call an assistant's message made, sent back in the conversation."""

    id: Text
    type: Literal["function"]
    function: CalledFunction


class FunctionName(Strict):
    name: Text


class NamedTool(Strict):
    """tool_choice naming the one function the answer calls."""

    type: Literal["function"]
    function: FunctionName


class Message(Strict):
    """A chat message as current clients send it: its content a text or a list of text parts
    (joined by newlines, as vLLM joins them), `developer` the system role under its newer name
    (OpenAI's), an assistant's `tool_calls` (its content then may be null) and a `tool`
    message's result of the call `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    # A participant's name, which OpenAI accepts on any message; the chat templates here have no
    # place for it, so it is read and not used.
    name: Text | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, min_length=1)
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _whole(self) -> Message:
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs a content (an assistant's message of tool_calls may go without)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant's message holds tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, gives the tool_call_id it answers")
        return self

    def plain(self) -> dict[str, Any]:
        """The message as a chat template reads it: its role, one text, and the calls it made
        ({"id", "name", "arguments": a dict}) or the call it answers (`tool_call_id`)."""
        content = self.content if not isinstance(self.content, list) else "\n".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "name": c.function.name, "arguments": json.loads(c.function.arguments)}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class StreamOptions(Strict):
    include_usage: bool = False  # a last chunk with the token counts, before [DONE]


class JsonSchema(Strict):
    """response_format's json_schema: the schema an answer follows (OpenAI's fields). Every
    answer is held to it, so `strict` is accepted either way."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: Annotated[dict[str, Any], AfterValidator(encodable)] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """What an answer is: text, any JSON object, or JSON valid under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def schema(self) -> dict[str, Any] | None:
        """The schema an answer follows ({"type": "object"} for json_object), None for text."""
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ApiError(
                400, "response_format: json_schema goes with type json_schema, and only with it.", "response_format"
            )
        if self.type == "text":
            return None
        return self.json_schema.schema_ if self.json_schema is not None else {"type": "object"}


class Sampling(Strict):
    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # what current clients send instead
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stop: Text | list[Text] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    # As vLLM's and llama-cpp-python's servers take it: the model's end tokens cannot be drawn
    # before this many new tokens (min_tokens = max_tokens fixes a load benchmark's output lengths).
    min_tokens: int = Field(default=0, ge=0)
    # As vLLM's and llama-server's take it: the end tokens never end the answer (it runs to
    # max_tokens, or a stop sequence), what a load benchmark sends to fix its output lengths.
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: Annotated[dict[str, float], AfterValidator(token_biases)] | None = None
    response_format: ResponseFormat | None = None
    user: Text | None = None
    stream_options: StreamOptions | None = None

    def new_tokens(self) -> tuple[str, int | None]:
        """The most new tokens asked and the field that asked (its value None: the endpoint's
        default), by either name."""
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ApiError(400, "max_completion_tokens: give it or max_tokens, not both.", "max_completion_tokens")
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def wanted_logprobs(self) -> int | None:
        """How many alternatives each token's log-probability lists (None: no log-probabilities)."""
        return None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop: at most 4 sequences, none empty.", "stop")
        return stops


class CompletionBody(Sampling):
    # A text, texts, or prompts already tokenized (ids, lists of ids), as OpenAI's API takes them.
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the alternatives listed per token

    def wanted_logprobs(self) -> int | None:
        return self.logprobs


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    # Ours: read control tokens typed in message content as the template's own (`<|im_end|>`
    # ending a turn); by default content is text and only the template places them.
    content_markers: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True

    def wanted_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: give logprobs: true with it.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class EmbeddingsBody(Strict):
    # A text, texts, or token ids (a list, or lists of them), as OpenAI's API takes them.
    input: Text | list[Text] | list[int] | list[list[int]]
    model: Text | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: Text | None = None
