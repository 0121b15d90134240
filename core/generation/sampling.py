"""How decoding picks tokens: the settings (`Sampling`, `BeamSettings`), the filters
(temperature, top-k, top-p) and the loop that samples up to `max_new_tokens` per row.

Every decoder runs against one small decode-step interface:

    step(state, tokens [B]) -> (logits [B, V] for the next token, state)

where `state` is any pytree whose every leaf has the batch as its leading axis (a key/value
`Cache`, encoder outputs, ...). `sample` and `beam_search` (`core.generation.beam`) take such a
step, the state after the prompt and the logits for the first new token, and decode in ONE
`jax.lax.while_loop`: no Python dispatch per token, the cache updated in place. Where the host
streams the tokens or may abandon the generation, the loop runs in chunks of steps, the host
looking between them (`core.generation.chunks`). Decoder-only
models (`core.generation.generate`) and encoder-decoders (`core.generation.seq2seq`) supply
their steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from core.errors import UserError
from core.generation import penalties
from core.generation.timestamps import Timestamps
from core.generation.timestamps import rules as timestamp_rules

State = Any
Step = Callable[[State, jax.Array], tuple[jax.Array, State]]
# Streaming: called on the host with each step's tokens [B] and which rows are still producing.
OnTokens = Callable[[np.ndarray, np.ndarray], None]


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How `sample` picks tokens: temperature 0 is greedy (argmax); else softmax(logits / T),
    restricted to the `top_k` most likely tokens and then to the smallest set of them whose
    probability reaches `top_p` (None: no restriction; greedy ignores both). The logits are
    first adjusted by `core.generation.penalties` (`no_repeat_ngram`, `word_reward`) and, with
    `timestamps`, kept to Whisper's timestamp rules (`core.generation.timestamps`)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop_tokens: tuple[int, ...] = ()
    no_repeat_ngram: int = 0
    word_reward: float = 0.0
    timestamps: Timestamps | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens={self.max_new_tokens} must be at least 1.")
        if self.temperature < 0:
            raise UserError(f"temperature={self.temperature} must be >= 0 (0 is greedy).")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"top_k={self.top_k} must be at least 1.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"top_p={self.top_p} must be in (0, 1].")
        penalties.check(self.no_repeat_ngram, self.word_reward)


class Generation(NamedTuple):
    """New tokens [B, max_new_tokens] (0 past each row's length) and lengths [B], which count a
    row's stop token when it produced one; each row's sum of its tokens' log-probabilities [B]
    (under the logits as adjusted, before the temperature: how sure the model was, whatever the
    sampling); an encoder-decoder's probed token's probability [B]
    (`core.model.encoder_decoder.Start.probe`), or None."""

    tokens: np.ndarray
    lengths: np.ndarray
    log_probs: np.ndarray
    probe: np.ndarray | None = None


def filter_logits(logits: jax.Array, top_k: int | None, top_p: float | None) -> jax.Array:
    """logits [B, V] with -inf outside the top-k tokens and then outside the nucleus: the most
    likely tokens whose probabilities, in decreasing order, first sum to at least `top_p`. Tokens
    tied with the least likely kept one are kept too. `top_p` may be traced (a value per request,
    `core.generation.slots`); 1 keeps every token."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and (isinstance(top_p, jax.Array) or top_p < 1):
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probabilities = jax.nn.softmax(ordered, axis=-1)
        # A token is kept while the mass of the more likely ones is still short of top_p.
        before = jnp.cumsum(probabilities, axis=-1) - probabilities
        threshold = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where((logits < threshold) & (top_p < 1), -jnp.inf, logits)
    return logits


def choose(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token of each row [B] from logits [B, V]."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# The decode loop's carry: (the next step's index, its input tokens [B], the new tokens
# [B, max_new_tokens], lengths [B], log-probability sums [B], which rows are done [B], the state).
Carry = tuple


def sample(step: Step, state: State, logits: jax.Array, key: jax.Array, sampling: Sampling) -> tuple[jax.Array, ...]:
    """Decodes up to `max_new_tokens` per row from `logits` [B, V] for the first new token, in one
    while loop that ends when every row has produced a stop token. -> tokens [B, M], lengths
    [B], log-probability sums [B] (see `Generation`). A loop the host watches between chunks of
    steps (streaming, abandonment) runs `begin` and `advance` (`core.generation.chunks`)."""
    carry = advance(step, begin(state, logits, key, sampling), key, sampling, sampling.max_new_tokens)
    return results(carry)


def results(carry: Carry) -> tuple[jax.Array, ...]:
    """A loop's tokens, lengths and log-probability sums."""
    return carry[2], carry[3], carry[4]


def begin(state: State, logits: jax.Array, key: jax.Array, sampling: Sampling) -> Carry:
    """The carry after the first new token, picked from `logits` [B, V]."""
    B, M = logits.shape[0], sampling.max_new_tokens
    zeros = jnp.zeros((B, M), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.float32)
    return jnp.int32(1), *_pick(sampling, key, 0, logits, *zeros, jnp.zeros((B,), bool)), state


def advance(step: Step, carry: Carry, key: jax.Array, sampling: Sampling, until: jax.Array | int) -> Carry:
    """The carry after the steps from its index up to `until` (exclusive, at most
    `max_new_tokens`), or until every row is done."""
    stop_at = jnp.minimum(until, sampling.max_new_tokens)

    def body(carry):
        index, token, tokens, lengths, log_probs, done, state = carry
        logits, state = step(state, token)
        return index + 1, *_pick(sampling, key, index, logits, tokens, lengths, log_probs, done), state

    return jax.lax.while_loop(lambda carry: (carry[0] < stop_at) & ~jnp.all(carry[5]), body, carry)


def _pick(sampling: Sampling, key, index, logits, tokens, lengths, log_probs, done):
    """Step `index`'s token of each row from its logits (0 where the row is done), written into
    `tokens`, counted in `lengths` and scored in `log_probs`; a stop token ends its row."""
    stops = jnp.asarray(sampling.stop_tokens, jnp.int32)
    if sampling.timestamps is not None:
        logits = timestamp_rules(logits, tokens, index, sampling.timestamps)
    logits = penalties.adjust(logits, tokens, index, stops, sampling.no_repeat_ngram, sampling.word_reward)
    token = jnp.where(done, 0, choose(logits, jax.random.fold_in(key, index), sampling))
    chosen = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None], axis=-1)[:, 0]
    log_probs = log_probs + jnp.where(done, 0.0, chosen)
    tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, index))
    lengths = lengths + (~done).astype(jnp.int32)
    return token, tokens, lengths, log_probs, done | jnp.isin(token, stops)


def sampling_and_key(seed: int | jax.Array = 0, **fields) -> tuple[Sampling, jax.Array]:
    """`sample`'s settings from the fields of `Sampling` that a generator was given (checked, and
    as the hashable values a compiled program takes), and the random key of `seed` (an int or a
    `jax.random` key)."""
    if "stop_tokens" in fields:
        fields["stop_tokens"] = tuple(int(t) for t in fields["stop_tokens"])
    sampling = Sampling(**fields)
    sampling = dataclasses.replace(
        sampling, no_repeat_ngram=int(sampling.no_repeat_ngram), word_reward=float(sampling.word_reward)
    )
    return sampling, jax.random.key(seed) if isinstance(seed, (int, np.integer)) else seed


class BeamSettings(NamedTuple):
    """`beam_search`'s keyword arguments, hashable: they are static arguments of a jit."""

    beam_size: int
    max_new_tokens: int
    stop_tokens: tuple[int, ...] = ()
    length_penalty: float = 0.6
    no_repeat_ngram: int = 0
    word_reward: float = 0.0
    early_stopping: bool = False
    timestamps: Timestamps | None = None


def beam_settings(**fields) -> BeamSettings:
    """`beam_search`'s settings from the fields of `BeamSettings` that a generator was given,
    checked, as hashable values."""
    settings = BeamSettings(**fields)
    if settings.beam_size < 1:
        raise UserError(f"beam_size={settings.beam_size} must be at least 1.")
    penalties.check(settings.no_repeat_ngram, settings.word_reward)
    return settings._replace(
        stop_tokens=tuple(int(t) for t in settings.stop_tokens),
        length_penalty=float(settings.length_penalty),
        no_repeat_ngram=int(settings.no_repeat_ngram),
        word_reward=float(settings.word_reward),
        early_stopping=bool(settings.early_stopping),
    )
