"""Typed values from text: a `--set` literal parsed, and any value checked against a dataclass
field's annotation (Literal choices, unions, tuples; ints widen to floats; `true`/`false` as
booleans). `core.config` reads overrides and saved configs through it.
"""

from __future__ import annotations

import ast
import types
import typing
from typing import Any, Literal

from core.errors import UserError


def parse_literal(text: str, item: str) -> Any:
    """The Python literal `text` of the `--set` item `item`; a bare word is a string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        # Bare words such as `rmsnorm` are strings; quoting them on a shell line is a chore.
        if text.replace("_", "").replace("-", "").isalnum():
            return text
        raise UserError(f"--set {item!r}: {text!r} is not a Python literal.") from None


def checked(value: Any, hint: Any, where: str) -> Any:
    """Returns `value` if it fits the annotation `hint` (ints widen to floats), else raises."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value in typing.get_args(hint):
            return value
        choices = ", ".join(repr(c) for c in typing.get_args(hint))
        raise UserError(f"{where}: {value!r} is not one of {choices}.")
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return checked(value, option, where)
            except UserError:
                continue
        raise UserError(f"{where}: {value!r} does not fit {hint}.")
    if hint is type(None):
        if value is None:
            return value
    elif origin is tuple:
        if isinstance(value, (tuple, list)):
            return tuple(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is bool:
        # `true` and `false` as a shell user types them, beside Python's True and False.
        if isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("true", "false")):
            return value is True or str(value).lower() == "true"
    elif isinstance(hint, type):
        if isinstance(value, hint):
            return value
    else:
        return value
    name = getattr(hint, "__name__", str(hint))
    raise UserError(f"{where}: expected {name}, got {value!r}.")
