"""Tool calls in a chat: how the offered functions reach the model and how its calls are read back.

The format is the one most open chat models are trained on (Hermes, Qwen 2.5, SmolLM3): the
functions listed as JSON inside <tools></tools>, each call written as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and a function's result given back inside <tool_response></tool_response>. A chat template
with a tools section of its own (it reads `tools`) renders the functions and the tool turns
itself, as Hugging Face's `apply_chat_template` passes them; a template without one (SmolLM2's,
ChatML) gets the list as the system message's text and the calls and results as plain turns.
A model whose own template speaks another format may answer with a bare JSON call
({"name": ..., "arguments" or "parameters": ...}): that is read too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from typing import Any

Call = tuple[str, dict[str, Any]]  # a function's name and its arguments

OPENING, CLOSING = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPENING) + r"(.*?)(?:" + re.escape(CLOSING) + r"|\Z)", re.DOTALL)


def instructions(functions: Sequence[dict[str, Any]]) -> str:
    """The functions offered, as a system message's text for a template without a tools section."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return (
        "# Tools\n\nYou may call one or more functions to answer the user. The functions, each given by its "
        f"JSON signature, are listed within <tools></tools> tags:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a function, write a JSON object of its name and arguments within <tool_call></tool_call> "
        'tags:\n<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
    )


def written(name: str, arguments: dict[str, Any]) -> str:
    """One call as the model writes it."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPENING}\n{call}\n{CLOSING}"


def plain(messages: Sequence[dict[str, Any]], functions: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """A conversation with tools for a template that knows only system, user and assistant
    turns: the functions (if offered) in the system message, an assistant's calls written in its
    text, and the results of a run of tool messages as one user turn."""
    turns: list[dict[str, str]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if turns and turns[-1].get("from_tools"):
                turns[-1]["content"] += "\n" + result
            else:
                turns.append({"role": "user", "content": result, "from_tools": True})
            continue
        calls = [written(c["name"], c["arguments"]) for c in message.get("tool_calls") or ()]
        turns.append({"role": role, "content": "\n".join(filter(None, [content, *calls]))})
    if functions:
        offered = instructions(functions)
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{offered}"
        else:
            turns.insert(0, {"role": "system", "content": offered})
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def parse(text: str, names: Collection[str]) -> tuple[str, list[Call]]:
    """The answer's text besides its calls, and the calls to the functions named `names`, in
    order: <tool_call> blocks (the last may be cut before its closing tag, and dropped where it
    was cut before its call was whole), or a whole answer that is one bare JSON call or a list
    of them. An answer with any call that cannot be read
    (not JSON, or an unknown function) is text alone, as it was written."""
    blocks = list(_BLOCK.finditer(text))
    if blocks:
        calls = [_call(block.group(1).strip(), names) for block in blocks]
        if len(calls) > 1 and calls[-1] is None and not blocks[-1].group(0).endswith(CLOSING):
            calls = calls[:-1]  # the last call cut short (max_tokens): the whole ones before it stand
        rest = _BLOCK.sub("", text).strip()
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        values = value if isinstance(value, list) and value else [value]
        calls, rest = [_call(v, names) for v in values], ""
    if any(call is None for call in calls):
        return text, []
    return rest, calls


def _call(value: str | Any, names: Collection[str]) -> Call | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON text, as OpenAI's API does
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def grammar(functions: Sequence[dict[str, Any]], parallel: bool) -> str:
    """The grammar (llguidance's Lark) of an answer that is calls and nothing else: one, or with
    `parallel` one or more, each to one of `functions` with arguments valid under its parameters'
    schema, written compactly. The arguments hold the parameters the schema lists and no others
    unless it says otherwise (a function called with a made-up parameter fails); a function
    without parameters takes none, as OpenAI's API reads it."""
    bodies = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": _closed(f.get("parameters"))},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    body = {**body, "x-guidance": {"whitespace_flexible": False}}
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    call = f"call: {json.dumps(OPENING + chr(10))} body {json.dumps(chr(10) + CLOSING)}"
    return f"{start}\n{call}\nbody: %json {json.dumps(body, ensure_ascii=False)}\n"


def _closed(parameters: dict[str, Any] | None) -> dict[str, Any]:
    if parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if "properties" in parameters and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters
