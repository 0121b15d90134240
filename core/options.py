"""Predict options: what a prediction may be asked, the same from Python, the command line
and HTTP. A task declares its options (`PredictOption`); `predict_option_values` is the one
check of given values against them; `RequestLimits` bounds what one request to `apps serve`
may ask of a model.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import UserError


@dataclass(frozen=True)
class PredictOption:
    """One `apps predict` option of a task: `--max-new-tokens 50` for the name "max_new_tokens"."""

    name: str
    type: type  # int, float, str, or bool (a switch: `--chat` alone): how the command line's value is read
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


class PredictOptionError(UserError):
    """A predict option that the task does not take, or a value that its type does not allow:
    `name` is the option's, `detail` the message without it (an HTTP layer names the field
    `options.NAME` and gives the detail)."""

    def __init__(self, message: str, name: str, detail: str):
        super().__init__(message)
        self.name, self.detail = name, detail


@dataclass(frozen=True)
class RequestLimits:
    """What one request to `apps serve` may ask of a model (its operator's settings): inputs per
    request, and seconds of audio per file (checked from the file's header, before decoding)."""

    inputs: int = 64
    audio_seconds: float = 600.0


def predict_option_values(task, given: Mapping[str, Any], *, command_line: bool = False) -> dict[str, Any]:
    """Every option that `task` (a task or its type) declares in `predict_options`, by name: the
    given value, else the default. The one check of predict options, for Python, HTTP requests
    and the command line alike.

    `given` maps option names to values, checked against the declared types (an integer where a
    float is declared becomes that float; None only where the default is None); with
    `command_line`, it maps flags (`--max-new-tokens`) to their text, read with the type (a
    switch: true or false, yes or no, 1 or 0)."""
    by_key = {option.flag if command_line else option.name: option for option in task.predict_options}
    unknown = [key for key in given if key not in by_key]
    if unknown:
        listed, name = ", ".join(by_key) or "none", unknown[0].removeprefix("--").replace("-", "_")
        detail = f"{task.name} takes no such option; its options: {listed}."
        if command_line:
            raise PredictOptionError(
                f"apps predict {task.name} does not take {', '.join(unknown)}; its options: {listed}.", name, detail
            )
        raise PredictOptionError(
            f"{task.name} predictions take no {', '.join(unknown)}; the options are {listed}.", name, detail
        )
    values = {option.name: option.default for option in task.predict_options}
    for key, value in given.items():
        option = by_key[key]
        values[option.name] = _option_text(key, option, value) if command_line else _option_value(option, value)
    return values


def _option_text(flag: str, option: PredictOption, text: str) -> Any:
    """A command line's text for `option`, read with its type."""
    if option.type is bool:
        if text.lower() not in SWITCH_VALUES:
            detail = f"a switch takes no value (or true / false), not {text!r}."
            raise PredictOptionError(
                f"{flag} {text!r}: a switch takes no value (or true / false).", option.name, detail
            )
        return SWITCH_VALUES[text.lower()]
    try:
        return option.type(text)
    except ValueError:
        detail = f"expected {option.type.__name__}, got {text!r}."
        raise PredictOptionError(f"{flag} {text!r}: expected {option.type.__name__}.", option.name, detail) from None


def _option_value(option: PredictOption, value: Any) -> Any:
    """A value given by name for `option`, checked against its type (a bool is no number here)."""
    if value is None and option.default is None:
        return None
    kinds = {bool: bool, int: numbers.Integral, float: numbers.Real}
    allowed = isinstance(value, kinds.get(option.type, option.type)) and (
        isinstance(value, bool) == (option.type is bool)
    )
    if not allowed:
        detail = f"expected {option.type.__name__}, got {value!r}."
        raise PredictOptionError(f"{option.name}: {detail}", option.name, detail)
    return option.type(value)


SWITCH_VALUES = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def switches(declared: Sequence[PredictOption]) -> set[str]:
    """The flags of the boolean options, which the command line gives without a value."""
    return {option.flag for option in declared if option.type is bool}
