"""Generations that the thread running them may abandon midway: a served request past its
timeout, whose client has had its 504 and will never read the answer.

`run(event, function, *args)` calls `function` with every generation it starts abandonable:
its decode loop runs a chunk of steps a call and the host asks between calls whether `event` is
set (`core.generation.chunks`): sampling cuts every row at the step it learnt it, beam search
ends with its chunk. Outside `run` a generation runs in one call and nothing is asked. Work that
loops on the host (a decoder's embeddings, one text at a time; Whisper's rounds of windows) calls
`check` between its pieces, which raises `Abandoned` once the event is set.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import numpy as np

_events: dict[int, threading.Event] = {}
_current: ContextVar[int | None] = ContextVar("apps_abandon_ticket", default=None)
_tickets = itertools.count()


def run(event: threading.Event, function: Callable[..., Any], *args) -> Any:
    """`function(*args)`, its generations ended at their next step once `event` is set."""
    ticket = next(_tickets) % 2**31
    _events[ticket] = event
    token = _current.set(ticket)
    try:
        return function(*args)
    finally:
        _current.reset(token)
        del _events[ticket]


def current() -> np.int32 | None:
    """The ticket of the `run` this thread is in (what a generation asks `asked` with), or None."""
    ticket = _current.get()
    return None if ticket is None else np.int32(ticket)


def asked(ticket: np.ndarray) -> np.bool_:
    """Whether the generations of `ticket` are abandoned."""
    event = _events.get(int(ticket))
    return np.bool_(event is not None and event.is_set())


class Abandoned(Exception):
    """Raised by `check` in work whose requests have all given up: nobody reads its result."""


def check() -> None:
    """Raise `Abandoned` if the `run` this thread is in has been abandoned (else nothing)."""
    ticket = _current.get()
    if ticket is not None and asked(np.int32(ticket)):
        raise Abandoned("every request of this call has given up")
