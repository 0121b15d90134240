"""Generation from a decoder-only language model: a decoding engine kept apart from the model.

For a decoder-only `Model` (an embedder of token ids, a causal body, a head giving logits or a
`Projection`), `generate` and `generate_beams` do all of it in one compiled call: right-pad
prompts of different lengths, prefill the preallocated cache with the training kernel, then
decode (`core.generation.sampling.sample`, `core.generation.beam.beam_search`) with the model's
step, `extend`, each row at its own positions. `use_cache=False` recomputes the full forward
over the sequence so far at every token instead (a baseline for `apps bench decode`).

An `EncoderDecoder` decodes through the same `sample` and `beam_search` with its own step
(`core.generation.seq2seq`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.errors import UserError
from core.generation import abandon, chunks
from core.generation.beam import Beams, searcher
from core.generation.sampling import (
    Generation,
    OnTokens,
    State,
    advance,
    beam_settings,
    begin,
    results,
    sampling_and_key,
)
from core.model import kernels
from core.model.cache import Cache
from core.model.heads import CopyProjection, Projection
from core.model.transformer import Model

logger = logging.getLogger("apps")

# XLA:CPU's default copy insertion copies a loop-carried buffer that the loop body both reads
# and updates in place: every layer's cache, twice per token. Its region analysis sees that the
# reads come first and copies nothing. The seam gives the option on the CPU alone.
COMPILER_OPTIONS = kernels.compiler_options()


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
    seed: int | jax.Array = 0,
    on_tokens: OnTokens | None = None,
    use_cache: bool = True,
    width: int | None = None,
    **sampling,
) -> Generation:
    """Continues each prompt (a sequence of token ids; lengths may differ) by up to
    `max_new_tokens`; `sampling` are the fields of `Sampling` (max_new_tokens, temperature,
    top_k, top_p, stop_tokens, no_repeat_ngram, word_reward), the choice of tokens. A row stops
    after its first stop token. `seed` is an int or a `jax.random` key. `on_tokens(tokens [B],
    active [B])` streams each step's tokens to the host, a chunk of steps at a time
    (`core.generation.chunks`). Compiled once per shape and
    settings: `width` pads the prompts to that many positions (a bucket shared by many batches,
    `core.model.shapes.bucket_width`)."""
    settings, key = sampling_and_key(seed, **sampling)
    tokens, lengths = prepare_prompts(model, prompts, settings.max_new_tokens, width)
    graphdef, params = nnx.split(model)
    ticket, static = abandon.current(), (graphdef, settings, use_cache)

    def first(until):
        return _first_program(*static, params, tokens, lengths, key, until)

    if on_tokens is None and ticket is None:  # one call, nobody watching
        return Generation(*(np.asarray(x) for x in results(first(np.int32(settings.max_new_tokens)))))

    def then(carry, until):
        return _next_program(*static, params, carry, key, until)

    return Generation(*chunks.drive(first, then, settings.max_new_tokens, on_tokens, ticket)[:3])


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


def _begun(graphdef, sampling, use_cache, params, tokens, lengths, key):
    """The model, its decode step and the loop's carry after the prompts' prefill."""
    model = nnx.merge(graphdef, params)
    start, step = (prefill, extend) if use_cache else (prefill_buffer, recompute)
    logits, state = start(model, tokens, lengths, tokens.shape[1] + sampling.max_new_tokens)
    return functools.partial(step, model), begin(state, logits, key, sampling)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), compiler_options=COMPILER_OPTIONS)
def _first_program(graphdef, sampling, use_cache, params, tokens, lengths, key, until):
    step, carry = _begun(graphdef, sampling, use_cache, params, tokens, lengths, key)
    return advance(step, carry, key, sampling, until)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=4, compiler_options=COMPILER_OPTIONS)
def _next_program(graphdef, sampling, use_cache, params, carry, key, until):
    model = nnx.merge(graphdef, params)
    step = functools.partial(extend if use_cache else recompute, model)
    return advance(step, carry, key, sampling, until)


def generate_beams(model: Model, prompts: Sequence[Sequence[int]], *, width: int | None = None, **beam) -> Beams:
    """Beam search continuations of each prompt (see `core.generation.beam.beam_search`): -> `Beams` with
    tokens [B, W, max_new_tokens], lengths [B, W] and scores [B, W], best first, as numpy; `beam`
    are the fields of `BeamSettings` (beam_size, max_new_tokens, stop_tokens, length_penalty,
    no_repeat_ngram, word_reward, early_stopping); `width` as `generate`'s."""
    settings = beam_settings(**beam)
    tokens, lengths = prepare_prompts(model, prompts, settings.max_new_tokens, width)
    graphdef, params = nnx.split(model)
    ticket = abandon.current()
    if ticket is None:  # one call, nobody watching
        carry = _beam_first(graphdef, settings, params, tokens, lengths, np.int32(settings.max_new_tokens))[0]
    else:
        carry = chunks.drive_search(
            lambda until: _beam_first(graphdef, settings, params, tokens, lengths, until),
            lambda carry, until: _beam_next(graphdef, settings, params, carry, until),
            ticket,
        )
    return Beams(*(np.asarray(x) for x in finish_search(settings, carry)))


def _beam_begun(graphdef, settings, params, tokens, lengths):
    """The search and its carry after the prompts' prefill and the first token."""
    model = nnx.merge(graphdef, params)
    logits, cache = prefill(model, tokens, lengths, tokens.shape[1] + settings.max_new_tokens)
    search = searcher(functools.partial(extend, model), logits.shape, **settings._asdict())
    return search, search.start(cache, logits)


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=COMPILER_OPTIONS)
def _beam_first(graphdef, settings, params, tokens, lengths, until):
    search, carry = _beam_begun(graphdef, settings, params, tokens, lengths)
    return search.run(carry, until)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3, compiler_options=COMPILER_OPTIONS)
def _beam_next(graphdef, settings, params, carry, until):
    step = functools.partial(extend, nnx.merge(graphdef, params))
    return searcher(step, (carry[1][0].shape[0], None), **settings._asdict()).run(carry, until)


@functools.partial(jax.jit, static_argnums=0)
def finish_search(settings, carry):
    return searcher(None, (carry[1][0].shape[0], None), **settings._asdict()).finish(carry)


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
