"""Decoding watched by the host: the decode loop runs a chunk of steps a call to the device, and
between chunks the host streams the new tokens and asks whether the generation was abandoned
(`core.generation.abandon`), so no step makes a round trip to the host.

`drive(first, then, ...)` takes the two compiled calls of a generator: `first(until)` prefills
and decodes up to step `until`, `then(carry, until)` goes on from a carry (its cache donated).
The tokens are those of one whole loop (`core.generation.sampling.sample`): each step's random
key is the step's, whatever the chunks. A generation abandoned midway is cut after the step the
host was streaming when it learnt of it (its later tokens, already made, are dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from core.generation import abandon
from core.generation.sampling import Carry, OnTokens

# Steps a call runs before the host looks: a round trip per CHUNK tokens, and at most CHUNK - 1
# steps decoded past an abandonment.
CHUNK = 16


def drive(
    first: Callable[[np.int32], Carry],
    then: Callable[[Carry, np.int32], Carry],
    max_new_tokens: int,
    on_tokens: OnTokens | None,
    ticket: np.int32 | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Carry]:
    """-> tokens [B, M], lengths [B] and log-probability sums [B] of the whole generation, and
    its last carry. `on_tokens(tokens [B], active [B])` is called once a step, in order."""
    carry, shown = first(np.int32(CHUNK)), 0
    while True:
        index, tokens, lengths = int(carry[0]), np.array(carry[2]), np.array(carry[3])
        for step in range(shown, index):
            if on_tokens is not None:
                on_tokens(tokens[:, step], step < lengths)
            if ticket is not None and abandon.asked(ticket):
                lengths = np.minimum(lengths, step + 1)
                tokens[:, step + 1 :] = 0
                return tokens, lengths, np.asarray(carry[4]), carry
        shown = index
        if index >= max_new_tokens or bool(np.all(carry[5])):
            return tokens, lengths, np.asarray(carry[4]), carry
        carry = then(carry, np.int32(index + CHUNK))


def drive_search(
    first: Callable[[np.int32], tuple[Carry, Any]],
    then: Callable[[Carry, np.int32], tuple[Carry, Any]],
    ticket: np.int32,
) -> Carry:
    """A beam search (`core.generation.beam`) a chunk of steps a call: `first(until)` and
    `then(carry, until)` -> (the carry, whether the search would go on). It ends where the search
    does or at the first chunk's end after the host abandons `ticket`; -> its last carry."""
    carry, going = first(np.int32(CHUNK))
    while bool(going) and not abandon.asked(ticket):
        carry, going = then(carry, np.int32(int(carry[0]) + CHUNK))
    return carry
