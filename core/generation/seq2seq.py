"""Decoding an encoder-decoder (`core.model.encoder_decoder.EncoderDecoder`).

Decoding (`generate_from_source`, `generate_beams_from_source`) runs core/generation/sampling.py's loop
and beam search (`core.generation.beam`) with this model's own decode step: `encode_prefill` encodes the sources once,
projects every decoder layer's keys and values of the memory once into the cache (and, for a
copying head, its view of the source into the state beside it) and runs the decoder's prompt
(`Start`: a beginning-of-sequence token, or Whisper's four), after each row's own earlier
tokens where it has some (`Previous`: Whisper's prompt of earlier text, traced, so that rows with
different ones share a program); `encoder_decoder_step` then runs one target token at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.errors import UserError
from core.generation import abandon, chunks
from core.generation.beam import Beams, searcher
from core.generation.generate import COMPILER_OPTIONS, finish_search, step_logits
from core.generation.sampling import Generation, OnTokens, advance, beam_settings, begin, results, sampling_and_key
from core.model.cache import Cache
from core.model.encoder_decoder import EncoderDecoder, Start
from core.model.heads import Source
from core.model.shapes import bucket_width


class DecodeState(NamedTuple):
    """What an encoder-decoder's decode step carries: the decoder's `Cache` (which holds the
    memory's keys and values) and, for a `CopyOutput` head, its `Source` (else None)."""

    cache: Cache
    source: Source | None


class Previous(NamedTuple):
    """Tokens that come before each row's prompt: ids [B, K], left-aligned, the first
    `counts` [B] of each row real (0: none). Whisper's prompt of earlier text is its
    <|startofprev|> token and that text's tokens."""

    ids: jax.Array
    counts: jax.Array


def previous_rows(rows: Sequence[Sequence[int]] | None, cap: int) -> Previous | None:
    """Each row's earlier tokens (`Previous`), padded to a bucketed width (one program per
    width, `core.model.shapes.bucket_width`, at most `cap`); None where no row has any."""
    if rows is None or not any(rows):
        return None
    longest = max(len(row) for row in rows)
    if longest > cap:
        raise UserError(f"A prompt of {longest} earlier tokens exceeds the {cap} allowed.")
    ids = np.zeros((len(rows), bucket_width(longest, cap)), np.int32)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = row
    return Previous(ids, np.array([len(row) for row in rows], np.int32))


def _prompts(start: Start, previous: Previous | None, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decoder's first tokens [B, K + P] (each row's earlier ones, then `start`'s prompt,
    then padding), their mask, and where each row's prompt begins [B]."""
    prompt = jnp.asarray(start.prompt, jnp.int32)
    if previous is None:
        return (
            jnp.broadcast_to(prompt, (rows, len(start.prompt))),
            jnp.ones((rows, len(start.prompt)), bool),
            jnp.zeros(rows, jnp.int32),
        )
    ids, counts = previous
    at = jnp.arange(ids.shape[1] + len(start.prompt))[None, :]
    within = jnp.clip(at - counts[:, None], 0, len(start.prompt) - 1)
    padded = jnp.pad(ids, ((0, 0), (0, len(start.prompt))))
    tokens = jnp.where(at < counts[:, None], padded, prompt[within])
    return tokens, at < counts[:, None] + len(start.prompt), counts


def encode_prefill(
    model: EncoderDecoder,
    source_inputs: jax.Array,
    source_mask: jax.Array,
    start: Start,
    max_new_tokens: int,
    previous: Previous | None = None,
) -> tuple[jax.Array, DecodeState, jax.Array]:
    """Sources (front-end inputs [B, S, ...] and mask [B, S]) through the encoder once, every
    decoder layer's keys and values of the memory into a new cache that holds the prompt (after
    each row's `previous` tokens) and `max_new_tokens`, then the prompt in one pass: -> (logits
    [B, V] for the first new token, with `start`'s suppressions, the state, and the probed
    token's probability [B] (zeros without a probe))."""
    memory, memory_mask = model.encode(source_inputs, source_mask)
    encoder = model.encoder.config
    if encoder.positions == "learned" and memory.shape[1] > encoder.max_len:
        raise UserError(f"Sources of {memory.shape[1]} positions exceed the encoder's max_len={encoder.max_len}.")
    B, P = memory.shape[0], len(start.prompt)
    prompt, mask, begins = _prompts(start, previous, B)
    cache = model.decoder.init_cache(
        B, prompt.shape[1] + max_new_tokens, memory.dtype, model.decoder.project_memory(memory, memory_mask)
    )
    source = model.source(memory, memory_mask, source_inputs)
    x, mask = model.target_embedder(prompt, mask)
    hidden, cache = model.decoder.prefill(x, mask, cache)
    # Each row's prompt's first and last positions.
    ends = jnp.take_along_axis(hidden, jnp.stack([begins, begins + P - 1], axis=1)[:, :, None], axis=1)
    logits = model.outputs(ends, jnp.ones((B, 2), bool), source).logits().astype(jnp.float32)
    probe = jnp.zeros((B,)) if start.probe is None else jax.nn.softmax(logits[:, 0])[:, start.probe]
    first = suppressed(logits[:, 1], start.suppress + start.suppress_first)
    return first, DecodeState(cache, source), probe


def suppressed(logits: jax.Array, ids: tuple[int, ...]) -> jax.Array:
    """logits [B, V] with the given ids at -inf."""
    return logits if not ids else logits.at[:, jnp.asarray(ids)].set(-jnp.inf)


def encoder_decoder_step(
    model: EncoderDecoder, state: DecodeState, tokens: jax.Array, suppress: tuple[int, ...] = ()
) -> tuple[jax.Array, DecodeState]:
    """The decode step of an encoder-decoder: one target token per row [B] after its cached
    ones, attending to the memory in the cache -> (logits [B, V] in float32, `suppress`ed ids at
    -inf, the state); a copying head's log-probabilities serve as logits."""
    one = jnp.ones((tokens.shape[0], 1), bool)
    x, _ = model.target_embedder(tokens[:, None], one)
    hidden, cache = model.decoder.extend(x, state.cache)
    logits = suppressed(step_logits(model.outputs(hidden, one, state.source)), suppress)
    return logits, DecodeState(cache, state.source)


def generate_from_source(
    model: EncoderDecoder,
    sources: Sequence[Any],
    *,
    start: Start,
    seed: int | jax.Array = 0,
    on_tokens: OnTokens | None = None,
    width: int | None = None,
    previous: Sequence[Sequence[int]] | None = None,
    **sampling,
) -> Generation:
    """Target tokens for each source (token ids, or an array [S, F] of features for the source
    front end; lengths may differ), after `start`'s prompt; the other settings as in
    `core.generation.generate.generate`. Compiled once per shape and settings: `width` pads the
    sources to that many positions, so that batches of different lengths can share one program.
    `previous`: each source's tokens before the prompt (`Previous`; empty: none)."""
    settings, key = sampling_and_key(seed, **sampling)
    before = _previous(model, previous, start, settings.max_new_tokens)
    inputs, mask = prepare_sources(model, sources, settings.max_new_tokens, width, _prompt_width(start, before))
    graphdef, params = nnx.split(model)
    ticket, static = abandon.current(), (graphdef, settings, start)
    probed = []

    def first(until):
        carry, probe = _source_first_program(*static, params, inputs, mask, key, before, until)
        probed.append(probe)
        return carry

    if on_tokens is None and ticket is None:  # one call, nobody watching
        outputs = results(first(np.int32(settings.max_new_tokens)))
        return Generation(*(np.asarray(x) for x in outputs), np.asarray(probed[0]))

    def then(carry, until):
        return _source_next_program(*static, params, carry, key, until)

    tokens, lengths, log_probs, _ = chunks.drive(first, then, settings.max_new_tokens, on_tokens, ticket)
    return Generation(tokens, lengths, log_probs, np.asarray(probed[0]))


def _source_begun(graphdef, sampling, start, params, inputs, mask, key, previous):
    """The model's decode step, the loop's carry after the sources' encoding and the prompt's
    prefill, and the probed token's probability."""
    model = nnx.merge(graphdef, params)
    logits, state, probe = encode_prefill(model, inputs, mask, start, sampling.max_new_tokens, previous)
    step = functools.partial(encoder_decoder_step, model, suppress=start.suppress)
    return step, begin(state, logits, key, sampling), probe


@functools.partial(jax.jit, static_argnums=(0, 1, 2), compiler_options=COMPILER_OPTIONS)
def _source_first_program(graphdef, sampling, start, params, inputs, mask, key, previous, until):
    step, carry, probe = _source_begun(graphdef, sampling, start, params, inputs, mask, key, previous)
    return advance(step, carry, key, sampling, until), probe


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=4, compiler_options=COMPILER_OPTIONS)
def _source_next_program(graphdef, sampling, start, params, carry, key, until):
    step = functools.partial(encoder_decoder_step, nnx.merge(graphdef, params), suppress=start.suppress)
    return advance(step, carry, key, sampling, until)


def first_logits(model: EncoderDecoder, sources: Sequence[Any], *, start: Start) -> np.ndarray:
    """The logits [B, V] of the first token after `start`'s prompt for each source (with its
    suppressions): what the model expects next, as Whisper's language detection reads it."""
    inputs, mask = prepare_sources(model, sources, 1, None, len(start.prompt))
    graphdef, params = nnx.split(model)
    return np.asarray(_first_logits_program(graphdef, start, params, inputs, mask))


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=COMPILER_OPTIONS)
def _first_logits_program(graphdef, start, params, inputs, mask):
    return encode_prefill(nnx.merge(graphdef, params), inputs, mask, start, 1)[0]


def generate_beams_from_source(
    model: EncoderDecoder,
    sources: Sequence[Any],
    *,
    start: Start,
    width: int | None = None,
    previous: Sequence[Sequence[int]] | None = None,
    **beam,
) -> Beams:
    """Beam search targets for each source (see `generate_from_source` and
    `core.generation.beam.beam_search`; `beam` as `core.generation.generate.generate_beams`'s):
    -> `Beams` of [B, W, max_new_tokens] tokens, best first, as numpy."""
    settings = beam_settings(**beam)
    before = _previous(model, previous, start, settings.max_new_tokens)
    inputs, mask = prepare_sources(model, sources, settings.max_new_tokens, width, _prompt_width(start, before))
    graphdef, params = nnx.split(model)
    ticket, static = abandon.current(), (graphdef, settings, start)
    probed = []

    def first(until):
        carry, going, probe = _source_beam_first(*static, params, inputs, mask, before, until)
        probed.append(probe)
        return carry, going

    if ticket is None:  # one call, nobody watching
        carry = first(np.int32(settings.max_new_tokens))[0]
    else:
        carry = chunks.drive_search(
            first, lambda carry, until: _source_beam_next(*static, params, carry, until), ticket
        )
    return Beams(*(np.asarray(x) for x in finish_search(settings, carry)[:3]), np.asarray(probed[0]))


def _source_beam_begun(graphdef, settings, start, params, inputs, mask, previous):
    """The search, its carry after the sources' encoding, the prompt and the first token, and
    the probed token's probability."""
    model = nnx.merge(graphdef, params)
    logits, state, probe = encode_prefill(model, inputs, mask, start, settings.max_new_tokens, previous)
    step = functools.partial(encoder_decoder_step, model, suppress=start.suppress)
    search = searcher(step, logits.shape, **settings._asdict())
    return search, search.start(state, logits), probe


@functools.partial(jax.jit, static_argnums=(0, 1, 2), compiler_options=COMPILER_OPTIONS)
def _source_beam_first(graphdef, settings, start, params, inputs, mask, previous, until):
    search, carry, probe = _source_beam_begun(graphdef, settings, start, params, inputs, mask, previous)
    return *search.run(carry, until), probe


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=4, compiler_options=COMPILER_OPTIONS)
def _source_beam_next(graphdef, settings, start, params, carry, until):
    step = functools.partial(encoder_decoder_step, nnx.merge(graphdef, params), suppress=start.suppress)
    return searcher(step, (carry[1][0].shape[0], None), **settings._asdict()).run(carry, until)


def previous_room(model: EncoderDecoder, start: Start, max_new_tokens: int) -> int:
    """How many earlier tokens a row may have: the decoder's positions that `start`'s prompt
    and the new tokens (all but the last, which is never fed back) leave."""
    return model.decoder.config.max_len - len(start.prompt) - max_new_tokens + 1


def _previous(model: EncoderDecoder, rows, start: Start, max_new_tokens: int) -> Previous | None:
    return previous_rows(rows, previous_room(model, start, max_new_tokens))


def _prompt_width(start: Start, previous: Previous | None) -> int:
    return len(start.prompt) + (0 if previous is None else previous.ids.shape[1])


def prepare_sources(
    model: EncoderDecoder, sources: Sequence[Any], max_new_tokens: int, width: int | None = None, prompt: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Sources right-padded to the longest (or to `width`, which no source may exceed) [B, S,
    ...] (token ids as int32) and their mask [B, S], checked: the decoder's positions (a
    `prompt` of that many tokens and the new tokens but the last) must fit its max_len."""
    if not isinstance(model, EncoderDecoder):
        raise UserError(f"Generation from sources needs an EncoderDecoder, not a {type(model).__name__}.")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} must be at least 1.")
    if prompt + max_new_tokens - 1 > model.decoder.config.max_len:
        room = "" if prompt == 1 else f" after a prompt of {prompt} tokens"
        raise UserError(
            f"max_new_tokens={max_new_tokens} exceeds the decoder's max_len={model.decoder.config.max_len} "
            f"positions{room}."
        )
    rows = [np.asarray(source) for source in sources]
    if not rows or any(len(row) == 0 for row in rows):
        raise UserError("Every source needs at least one position.")
    rows = [row.astype(np.int32) if np.issubdtype(row.dtype, np.integer) else row for row in rows]
    length = max(len(row) for row in rows)
    if width is not None:
        if width < length:
            raise UserError(f"A source of {length} positions exceeds the requested width={width}.")
        length = width
    inputs = np.zeros((len(rows), length, *rows[0].shape[1:]), rows[0].dtype)
    mask = np.zeros((len(rows), length), bool)
    for index, row in enumerate(rows):
        inputs[index, : len(row)], mask[index, : len(row)] = row, True
    return inputs, mask
