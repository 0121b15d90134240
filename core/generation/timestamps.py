"""Whisper's timestamp tokens: the rules that keep them well formed at every decoding step.

With timestamps, Whisper writes a window's transcript as segments, each between two timestamp
tokens (<|0.00|> ... <|30.00|>, one every 20 ms): `<|0.00|> Hello there.<|1.52|><|1.52|> How
are you?<|3.10|>` then the end token. Its own decoding (openai-whisper's `ApplyTimestampRules`,
which CTranslate2 and so faster-whisper apply too) keeps the sequence in that shape by banning
tokens at each step, given the tokens generated so far:

- the first token is a timestamp, at most `max_initial` steps in (1 s);
- after a timestamp that follows text (a segment's end), another timestamp (the next segment's
  start) or the end token; after two timestamps (or the first one), text or the end token;
- timestamps never go back, and a segment has a length: below the last timestamp is banned, and
  the last one itself too unless it would open the next segment;
- where the timestamps together are likelier than the likeliest text token, a timestamp.

`rules` applies them to logits; sampling (`core.generation.sampling`) and beam search
(`core.generation.beam`) call it when their settings carry `Timestamps`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

PRECISION = 0.02  # seconds per timestamp step


class Timestamps(NamedTuple):
    """The ids that matter (hashable: a static setting of the compiled programs): `begin`,
    <|0.00|>, every later id a timestamp; `end`, the end token, every earlier id text; the latest
    timestamp a window may open with, in steps (openai-whisper's default: 1 s)."""

    begin: int
    end: int
    max_initial: int = round(1.0 / PRECISION)


def rules(logits: jax.Array, generated: jax.Array, length: jax.Array, timestamps: Timestamps) -> jax.Array:
    """Next-token `logits` [R, V] of rows whose first `length` (a scalar) tokens of `generated`
    [R, M] are their output so far, with what the timestamp rules ban at -inf."""
    begin, end = timestamps.begin, timestamps.end
    ids = jnp.arange(logits.shape[-1])[None, :]
    is_time = ids >= begin
    written = jnp.arange(generated.shape[1])[None, :] < length
    last = jnp.take(generated, jnp.maximum(length - 1, 0), axis=1)
    before = jnp.take(generated, jnp.maximum(length - 2, 0), axis=1)
    last_time = (length >= 1) & (last >= begin)
    before_time = (length < 2) | (before >= begin)
    latest = jnp.max(jnp.where(written & (generated >= begin), generated, -1), axis=1)
    # The last timestamp may be repeated only as the start of the segment after the one it ends.
    floor = jnp.where(latest < 0, begin, latest + jnp.where(last_time & ~before_time, 0, 1))
    banned = is_time & (ids < floor[:, None])
    banned |= (last_time & before_time)[:, None] & is_time  # a pair: text (or the end) comes next
    banned |= (last_time & ~before_time)[:, None] & (ids < end)  # an end: no text next
    opening = (ids < begin) | (ids > begin + timestamps.max_initial)
    banned |= (length == 0) & opening
    logits = jnp.where(banned, -jnp.inf, logits)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    times = jax.nn.logsumexp(jnp.where(is_time, log_probs, -jnp.inf), axis=-1)
    text = jnp.max(jnp.where(is_time, -jnp.inf, log_probs), axis=-1)
    return jnp.where((times > text)[:, None] & ~is_time, -jnp.inf, logits)
