"""Chat conversations: messages read from JSON and rendered with a checkpoint's chat template.

A conversation is a list of messages {"role": "system" | "user" | "assistant", "content": text}
(the server's also carry tool calls and tool results: `tasks.common.tools`). The template (a
jinja2 text in the checkpoint's metadata) is rendered as Hugging Face's `apply_chat_template`
does: a sandboxed environment that trims blocks, with `raise_exception` and a `tojson` filter,
given the messages, `add_generation_prompt`, the special tokens and the tools offered.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence

from core.errors import UserError
from tasks.common import tools as tool_calls

ROLES = ("system", "user", "assistant")
Message = dict[str, str]


def read_messages(value, where: str) -> list[Message]:
    """A conversation from parsed JSON: a list of messages, or {"messages": [...]}; every
    problem named with `where` (a file and line, or "the request")."""
    if isinstance(value, str):  # a CSV or TSV cell holds the conversation as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise UserError(f"{where}: not valid JSON ({error.msg} at column {error.colno}).") from None
    if isinstance(value, dict) and "messages" in value:
        value = value["messages"]
    if not isinstance(value, list) or not value:
        raise UserError(f'{where}: a conversation is a non-empty list of messages, {{"role": ..., "content": ...}}.')
    messages = []
    for i, message in enumerate(value):
        # A table's loader gives every message the keys any message has, None where it lacks them.
        if isinstance(message, dict):
            message = {key: value for key, value in message.items() if value is not None}
        if not isinstance(message, dict) or set(message) - {"role", "content"} or "role" not in message:
            raise UserError(f"{where}: message {i} is not an object with a role and a content: {message!r:.80}.")
        role, content = message["role"], message.get("content")
        if role not in ROLES:
            raise UserError(f"{where}: message {i} has role {role!r}; roles are {', '.join(ROLES)}.")
        if not isinstance(content, str):
            raise UserError(f"{where}: message {i} ({role}) needs a text content, not {content!r:.40}.")
        messages.append({"role": role, "content": content})
    return messages


def parse_line(line: str, where: str) -> list[Message] | None:
    """The conversation a JSON line holds, or None for a line of plain text (a user's prompt)."""
    text = line.strip()
    if not text.startswith(("[", "{")):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{where}: not valid JSON ({error.msg} at column {error.colno}).") from None
    return read_messages(value, where)


def with_system(messages: Sequence[Message], system: str) -> list[Message]:
    """The conversation with `system` as its system message (replacing one it has), if given."""
    if not system:
        return list(messages)
    return [{"role": "system", "content": system}, *(m for m in messages if m["role"] != "system")]


@functools.cache
def _compiled(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise UserError(f"The chat template refuses the conversation: {message}")

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    environment.globals["raise_exception"] = raise_exception
    try:
        return environment.from_string(template)
    except jinja2.TemplateError as error:
        raise UserError(f"The checkpoint's chat template does not parse: {error}") from None


@functools.cache
def has_tools_section(template: str) -> bool:
    """Whether the template renders the functions offered itself (it reads `tools`)."""
    from jinja2 import meta

    return "tools" in meta.find_undeclared_variables(_compiled(template).environment.parse(template))


def with_tools(template: str, messages: Sequence[Message], tools: Sequence[dict] | None) -> tuple[list, dict]:
    """The messages and the template's extra arguments for a conversation that may hold tool
    calls and results, with `tools` (function definitions) offered: in Hugging Face's shape for a
    template with a tools section, else as plain turns (`tasks.common.tools.plain`)."""
    if not tools and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        return list(messages), {}
    if not has_tools_section(template):
        return tool_calls.plain(messages, tools or []), {}
    shaped = [
        {**m, "tool_calls": [_hf_call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages
    ]
    return shaped, ({"tools": [{"type": "function", "function": f} for f in tools]} if tools else {})


def _hf_call(call: dict) -> dict:
    function = {"name": call["name"], "arguments": call["arguments"]}
    return {"type": "function", "function": function} | ({"id": call["id"]} if "id" in call else {})


def render(
    template: str | None,
    messages: Sequence[Message],
    special: dict[str, str],
    where: str,
    generation_prompt: bool = True,
    tools: Sequence[dict] | None = None,
) -> str:
    """The conversation as the model reads it, with the functions `tools` offered; with
    `generation_prompt`, up to where the assistant's answer begins."""
    import jinja2

    if not template:
        raise UserError(f"{where} has no chat template: use plain prompts (without --chat).")
    messages, extra = with_tools(template, messages, tools)
    try:
        return _compiled(template).render(
            messages=messages, add_generation_prompt=generation_prompt, **special, **extra
        )
    except (jinja2.TemplateError, TypeError, IndexError, KeyError) as error:
        raise UserError(f"The chat template of {where} fails on this conversation: {error}") from None


def parts(render: Callable[[Sequence[Message]], str], messages: Sequence[Message]) -> list[tuple[str, bool]]:
    """The rendered conversation (`render(messages)`) in pieces, each (text, whether a message's
    content wrote it), found by rendering once more with a mark in place of each content. A
    template that trims a content (Gemma's) writes it trimmed; one that changes it otherwise
    gets it as given."""
    whole = render(messages)
    marked = render([{**m, "content": f"\ue000{i}\ue001"} if m.get("content") else m for i, m in enumerate(messages)])
    found, at = [], 0
    pieces = re.split("\ue000(\\d+)\ue001", marked)
    for index, piece in enumerate(pieces):
        if index % 2 == 0:
            found.append((piece, False))
            at += len(piece)
            continue
        content, after = messages[int(piece)]["content"], pieces[index + 1]
        ways = (content, content.strip(), content.lstrip(), content.rstrip())
        written = next((w for w in ways if whole.startswith(w + after, at)), content)
        found.append((written, True))
        at += len(written)
    return [(text, is_content) for text, is_content in found if text]
