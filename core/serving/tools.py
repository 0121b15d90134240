"""Tool calling over chat completions, as OpenAI's API does it: `tools`, `tool_choice` and
`parallel_tool_calls` in, `tool_calls` out.

The chat template offers the functions (`core.task.ToolFormat`: the tokenizer's format says how a
model writes its calls); what the server adds is the choice. `auto` lets the model answer or
call, and reads the calls back from its answer (as vLLM's tool parsers do); `required` or a
named function forces calls by constrained decoding, each call's arguments kept to its
function's parameter schema (as llama.cpp's grammars do for a forced call); `none` leaves the
functions out of the prompt, so that the model answers in words. Without
`parallel_tool_calls`, an answer makes at most one call.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from core.errors import UserError
from core.generation.grammar import json_grammar, lark_grammar
from core.serving.api import ApiError, ChatBody
from core.task import ToolFormat


@dataclass(frozen=True)
class Offer:
    """The functions a request offers (their definitions as a chat template reads them), those
    a forced answer must call (None: the model chooses), whether it may call several, and how
    the model writes calls."""

    functions: list[dict[str, Any]]
    forced: list[dict[str, Any]] | None
    parallel: bool
    format: ToolFormat

    def grammar(self) -> str | None:
        """The grammar a forced answer follows (None: the answer is free)."""
        if self.forced is None:
            return None
        try:
            return lark_grammar(self.format.grammar(self.forced, self.parallel), "tool_choice's functions")
        except UserError as error:
            raise ApiError(400, f"tools: {error}.", "tools") from None

    def read(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The answer's text besides its calls, and the calls in OpenAI's shape (each with an id;
        its arguments a JSON text)."""
        content, calls = self.format.parse(text, [f["name"] for f in self.functions])
        return content, [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
            for name, arguments in calls[: None if self.parallel else 1]
        ]


def offer(body: ChatBody, tool_format: ToolFormat | None) -> Offer | None:
    """What `body` offers the model, checked (None: no functions, or tool_choice none)."""
    if not body.tools:
        if body.tool_choice is not None:
            raise ApiError(400, "tool_choice: give tools with it.", "tool_choice")
        return None
    functions = [tool.function.definition() for tool in body.tools]
    names = [f["name"] for f in functions]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise ApiError(400, f"tools: the function {twice!r} is given twice.", "tools")
    for index, function in enumerate(functions):
        if "parameters" in function:
            try:
                json_grammar(function["parameters"])
            except UserError as error:
                where = f"tools.{index}.function.parameters"
                raise ApiError(400, f"{where}: {error}.", where) from None
    choice = body.tool_choice or "auto"
    if choice == "none":
        return None
    if tool_format is None:
        raise ApiError(400, "tools: this model's tokenizer has no format for tool calls.", "tools")
    forced = None if choice == "auto" else functions
    if not isinstance(choice, str):
        forced = [f for f in functions if f["name"] == choice.function.name]
        if not forced:
            where = "tool_choice.function.name"
            raise ApiError(400, f"{where}: {choice.function.name!r} is not among the tools given.", where)
    # A named function is called once; `required` and `auto` call as many as parallel_tool_calls allows.
    return Offer(functions, forced, body.parallel_tool_calls and isinstance(choice, str), tool_format)
