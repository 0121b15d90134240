"""Generation from a causal language model: a decoding engine kept apart from the model.

The engine runs against a small decode-step interface, so that a later encoder-decoder reuses it:

    step(state, tokens [B]) -> (logits [B, V] for the next token, state)

where `state` is any pytree whose every leaf has the batch as its leading axis (a key/value
`Cache`, encoder outputs, ...). `sample` and `beam_search` (core/generation/beam.py) take such a step, the
state after the prompt and the logits for the first new token, and decode in ONE
`jax.lax.while_loop`: no Python dispatch per token, the cache updated in place.

For a decoder-only `Model` (an embedder of token ids, a causal body, a head giving logits or a
`Projection`), `generate` and `generate_beams` do the rest in one compiled call: right-pad
prompts of different lengths, prefill the preallocated cache with the training kernel, then
decode, each row at its own positions. `use_cache=False` recomputes the full forward over the
sequence so far at every token instead (a baseline for `apps bench decode`).

An `EncoderDecoder` decodes through the same `sample` and `beam_search` with its own step
(core/model/encoder_decoder.py: `generate_from_source`, `generate_beams_from_source`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from core.errors import UserError
from core.generation import penalties
from core.generation.beam import Beams, beam_search
from core.model.cache import Cache
from core.model.heads import CopyProjection, Projection
from core.model.transformer import Model

State = Any
Step = Callable[[State, jax.Array], tuple[jax.Array, State]]
# Streaming: called on the host with each step's tokens [B] and which rows are still producing.
OnTokens = Callable[[np.ndarray, np.ndarray], None]

logger = logging.getLogger("apps")

# XLA:CPU's default copy insertion copies a loop-carried buffer that the loop body both reads
# and updates in place: every layer's cache, twice per token. Its region analysis sees that the
# reads come first and copies nothing (GPT-2 small, batch 1: 26 -> 22 ms per token). Other
# backends ignore the option.
COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How `sample` picks tokens: temperature 0 is greedy (argmax); else softmax(logits / T),
    restricted to the `top_k` most likely tokens and then to the smallest set of them whose
    probability reaches `top_p` (None: no restriction; greedy ignores both). The logits are
    first adjusted by `core.generation.penalties` (`no_repeat_ngram`, `word_reward`)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop_tokens: tuple[int, ...] = ()
    no_repeat_ngram: int = 0
    word_reward: float = 0.0

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


def sample(
    step: Step, state: State, logits: jax.Array, key: jax.Array, sampling: Sampling, on_tokens: OnTokens | None = None
) -> tuple[jax.Array, jax.Array]:
    """Decodes up to `max_new_tokens` per row from `logits` [B, V] for the first new token, in one
    while loop that ends when every row has produced a stop token. -> tokens [B, M], lengths [B],
    log-probability sums [B] (see `Generation`)."""
    M = sampling.max_new_tokens
    stops = jnp.asarray(sampling.stop_tokens, jnp.int32)
    B = logits.shape[0]

    def pick(index, logits, tokens, lengths, log_probs, done):
        logits = penalties.adjust(logits, tokens, index, stops, sampling.no_repeat_ngram, sampling.word_reward)
        token = jnp.where(done, 0, choose(logits, jax.random.fold_in(key, index), sampling))
        if on_tokens is not None:
            io_callback(on_tokens, None, token, ~done, ordered=True)
        chosen = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None], axis=-1)[:, 0]
        log_probs = log_probs + jnp.where(done, 0.0, chosen)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, index))
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | jnp.isin(token, stops)
        return token, tokens, lengths, log_probs, done

    def body(carry):
        index, token, tokens, lengths, log_probs, done, state = carry
        logits, state = step(state, token)
        return index + 1, *pick(index, logits, tokens, lengths, log_probs, done), state

    def running(carry):
        index, done = carry[0], carry[5]
        return (index < M) & ~jnp.all(done)

    zeros = jnp.zeros((B, M), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.float32)
    start = pick(0, logits, *zeros, jnp.zeros((B,), bool))
    _, _, tokens, lengths, log_probs, _, _ = jax.lax.while_loop(running, body, (jnp.int32(1), *start, state))
    return tokens, lengths, log_probs


def prefill(model: Model, tokens: jax.Array, lengths: jax.Array, max_len: int) -> tuple[jax.Array, Cache]:
    """Right-padded prompts `tokens` [B, T] of `lengths` [B] through the model, into a new cache
    of `max_len` positions: -> (logits [B, V] for each row's next token, the cache)."""
    B, T = tokens.shape
    x, mask = model.embedder(tokens, jnp.arange(T)[None, :] < lengths[:, None])
    hidden, cache = model.body.prefill(x, mask, model.body.init_cache(B, max_len, x.dtype))
    return logits_of(model, _last(hidden, lengths)), cache


def extend(model: Model, cache: Cache, tokens: jax.Array) -> tuple[jax.Array, Cache]:
    """The decode step of a decoder-only model: one token per row [B] after its cached ones.

    Pure: jit it with the cache donated (`donate_argnums`) and XLA writes the new keys in place.
    """
    x, _ = model.embedder(tokens[:, None], jnp.ones((tokens.shape[0], 1), bool))
    hidden, cache = model.body.extend(x, cache)
    return logits_of(model, hidden), cache


def prefill_buffer(model: Model, tokens: jax.Array, lengths: jax.Array, max_len: int) -> tuple[jax.Array, State]:
    """`prefill` without a cache: the state is a token buffer [B, max_len] and the lengths."""
    buffer = jnp.zeros((tokens.shape[0], max_len), jnp.int32).at[:, : tokens.shape[1]].set(tokens)
    return _forward(model, buffer, lengths), (buffer, lengths)


def recompute(model: Model, state: State, tokens: jax.Array) -> tuple[jax.Array, State]:
    """`extend` without a cache: writes the tokens into the buffer and runs the full forward
    pass over all of it again."""
    buffer, lengths = state
    buffer = buffer.at[jnp.arange(buffer.shape[0]), lengths].set(tokens)
    return _forward(model, buffer, lengths + 1), (buffer, lengths + 1)


def _forward(model: Model, buffer: jax.Array, lengths: jax.Array) -> jax.Array:
    x, mask = model.embedder(buffer, jnp.arange(buffer.shape[1])[None, :] < lengths[:, None])
    return logits_of(model, _last(model.body(x, mask), lengths))


def _last(hidden: jax.Array, lengths: jax.Array) -> jax.Array:
    """Each row's hidden state at its last real position: [B, T, D] -> [B, 1, D]."""
    return jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)


def logits_of(model: Model, hidden: jax.Array) -> jax.Array:
    """The head at one position per row: hidden [B, 1, D] -> logits [B, V] in float32."""
    return step_logits(model.head(hidden, jnp.ones(hidden.shape[:2], bool)))


def step_logits(outputs: Projection | CopyProjection) -> jax.Array:
    """A generating head's outputs at one position per row -> logits [B, V] in float32. A head
    that generates returns its outputs unmultiplied (`core.model.heads.Projection` or
    `CopyProjection`), whose `logits()` a decoding step asks for."""
    return outputs.logits()[:, 0].astype(jnp.float32)


def generate(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    seed: int | jax.Array = 0,
    on_tokens: OnTokens | None = None,
    use_cache: bool = True,
    no_repeat_ngram: int = 0,
    word_reward: float = 0.0,
    width: int | None = None,
) -> Generation:
    """Continues each prompt (a sequence of token ids; lengths may differ) by up to
    `max_new_tokens`; see `Sampling` for the choice of tokens. A row stops after its first stop
    token. `seed` is an int or a `jax.random` key. `on_tokens(tokens [B], active [B])` streams
    each step's tokens to the host as they come. Compiled once per shape and settings: `width`
    pads the prompts to that many positions (a bucket shared by many batches, `core.training.data.bucket_width`)."""
    sampling, key = sampling_and_key(
        max_new_tokens, temperature, top_k, top_p, stop_tokens, seed, no_repeat_ngram, word_reward
    )
    tokens, lengths = prepare_prompts(model, prompts, max_new_tokens, width)
    graphdef, params = nnx.split(model)
    outputs = _sample_program(graphdef, sampling, on_tokens, use_cache, params, tokens, lengths, key)
    return Generation(*(np.asarray(x) for x in outputs))


def best_continuations(
    model: Model, prompts: Sequence[Sequence[int]], options: dict, on_tokens: OnTokens | None = None, **settings
) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt's continuation (tokens [B, N], lengths [B]) under a task's `apps predict`
    options: the best beam with options["beams"] > 1, else a sample at options["temperature"]
    (top_k / top_p where the options have them; 0 and 1 are off). `settings`: the keyword
    arguments both generators take (max_new_tokens, stop_tokens, penalties, width)."""
    if options["beams"] > 1:
        beams = generate_beams(
            model, prompts, beam_size=options["beams"], length_penalty=options["length_penalty"], **settings
        )
        return beams.tokens[:, 0], beams.lengths[:, 0]
    top_k, top_p = options.get("top_k", 0), options.get("top_p", 1.0)
    result = generate(
        model,
        prompts,
        temperature=options["temperature"],
        top_k=None if top_k == 0 else top_k,
        top_p=None if top_p == 1 else top_p,
        seed=options["seed"],
        on_tokens=on_tokens,
        **settings,
    )
    return result.tokens, result.lengths


def sampling_and_key(
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    stop_tokens: Sequence[int],
    seed: int | jax.Array,
    no_repeat_ngram: int = 0,
    word_reward: float = 0.0,
) -> tuple[Sampling, jax.Array]:
    """`sample`'s settings, checked, and the random key, from the arguments of the generators."""
    sampling = Sampling(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_tokens=tuple(int(t) for t in stop_tokens),
        no_repeat_ngram=int(no_repeat_ngram),
        word_reward=float(word_reward),
    )
    return sampling, jax.random.key(seed) if isinstance(seed, (int, np.integer)) else seed


class BeamSettings(NamedTuple):
    """`beam_search`'s keyword arguments, hashable: they are static arguments of a jit."""

    beam_size: int
    max_new_tokens: int
    stop_tokens: tuple[int, ...]
    length_penalty: float
    no_repeat_ngram: int
    word_reward: float
    early_stopping: bool


def beam_settings(
    beam_size: int,
    max_new_tokens: int,
    stop_tokens: Sequence[int],
    length_penalty: float,
    no_repeat_ngram: int = 0,
    word_reward: float = 0.0,
    early_stopping: bool = False,
) -> BeamSettings:
    """`beam_search`'s settings, checked."""
    if beam_size < 1:
        raise UserError(f"beam_size={beam_size} must be at least 1.")
    penalties.check(no_repeat_ngram, word_reward)
    stops = tuple(int(t) for t in stop_tokens)
    return BeamSettings(
        beam_size,
        max_new_tokens,
        stops,
        float(length_penalty),
        int(no_repeat_ngram),
        float(word_reward),
        bool(early_stopping),
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), compiler_options=COMPILER_OPTIONS)
def _sample_program(graphdef, sampling, on_tokens, use_cache, params, tokens, lengths, key):
    model = nnx.merge(graphdef, params)
    start, step = (prefill, extend) if use_cache else (prefill_buffer, recompute)
    logits, state = start(model, tokens, lengths, tokens.shape[1] + sampling.max_new_tokens)
    return sample(functools.partial(step, model), state, logits, key, sampling, on_tokens)


def generate_beams(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    beam_size: int,
    max_new_tokens: int,
    stop_tokens: Sequence[int] = (),
    length_penalty: float = 0.6,
    no_repeat_ngram: int = 0,
    word_reward: float = 0.0,
    width: int | None = None,
) -> Beams:
    """Beam search continuations of each prompt (see `core.generation.beam.beam_search`): -> `Beams` with
    tokens [B, W, max_new_tokens], lengths [B, W] and scores [B, W], best first, as numpy;
    `width` as `generate`'s."""
    settings = beam_settings(beam_size, max_new_tokens, stop_tokens, length_penalty, no_repeat_ngram, word_reward)
    tokens, lengths = prepare_prompts(model, prompts, max_new_tokens, width)
    graphdef, params = nnx.split(model)
    return Beams(*(np.asarray(x) for x in _beam_program(graphdef, settings, params, tokens, lengths)))


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=COMPILER_OPTIONS)
def _beam_program(graphdef, settings, params, tokens, lengths):
    model = nnx.merge(graphdef, params)
    logits, cache = prefill(model, tokens, lengths, tokens.shape[1] + settings.max_new_tokens)
    return beam_search(functools.partial(extend, model), cache, logits, **settings._asdict())


def prepare_prompts(
    model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded prompt tokens [B, T] and their lengths [B], checked against the model; T is
    the longest prompt's length, or `width` where that is given and longer (up to the room the
    new tokens leave).

    A row holds at most `max_len` tokens, the context the model was trained on (a table of
    learned positions ends there; rotary ones were never trained beyond it): prompts longer than
    max_len - max_new_tokens keep their last tokens (with a warning on the "apps" logger), and
    `max_new_tokens` must leave room for at least one prompt token.
    """
    config = model.body.config
    if not config.causal:
        raise UserError("Generation needs a causal body (model.causal=True).")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} must be at least 1.")
    rows = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    if not rows or any(len(r) == 0 for r in rows):
        raise UserError("Every prompt needs at least one token (a beginning-of-sequence token will do).")
    room = config.max_len - max_new_tokens
    if room < 1:
        raise UserError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in model.max_len={config.max_len} "
            "positions; ask for fewer new tokens."
        )
    for index, row in enumerate(rows):
        if len(row) > room:
            logger.warning(
                "Prompt %d has %d tokens; keeping its last %d so that %d new tokens fit in model.max_len=%d.",
                index,
                len(row),
                room,
                max_new_tokens,
                config.max_len,
            )
            rows[index] = row[-room:]
    lengths = np.array([len(r) for r in rows], np.int32)
    tokens = np.zeros((len(rows), max(int(lengths.max()), min(width or 0, room))), np.int32)
    for index, row in enumerate(rows):
        tokens[index, : len(row)] = row
    return tokens, lengths
