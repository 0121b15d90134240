"""Decoding an encoder-decoder (`core.model.encoder_decoder.EncoderDecoder`).

Decoding (`generate_from_source`, `generate_beams_from_source`) runs core/generation/generate.py's `sample`
and `beam_search` with this model's own decode step: `encode_prefill` encodes the sources once,
projects every decoder layer's keys and values of the memory once into the cache (and, for a
copying head, its view of the source into the state beside it) and runs the decoder's prompt
(`Start`: a beginning-of-sequence token, or Whisper's four); `encoder_decoder_step` then runs
one target token at a time.
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
from core.generation import abandon
from core.generation.beam import Beams, beam_search
from core.generation.generate import COMPILER_OPTIONS, step_logits
from core.generation.sampling import Generation, OnTokens, beam_settings, sample, sampling_and_key
from core.model.cache import Cache
from core.model.encoder_decoder import EncoderDecoder, Start
from core.model.heads import Source


class DecodeState(NamedTuple):
    """What an encoder-decoder's decode step carries: the decoder's `Cache` (which holds the
    memory's keys and values) and, for a `CopyOutput` head, its `Source` (else None)."""

    cache: Cache
    source: Source | None


def encode_prefill(
    model: EncoderDecoder, source_inputs: jax.Array, source_mask: jax.Array, start: Start, max_new_tokens: int
) -> tuple[jax.Array, DecodeState, jax.Array]:
    """Sources (front-end inputs [B, S, ...] and mask [B, S]) through the encoder once, every
    decoder layer's keys and values of the memory into a new cache that holds the prompt and
    `max_new_tokens`, then the prompt in one pass: -> (logits [B, V] for the first new token,
    with `start`'s suppressions, the state, and the probed token's probability [B] (zeros
    without a probe))."""
    memory, memory_mask = model.encode(source_inputs, source_mask)
    encoder = model.encoder.config
    if encoder.positions == "learned" and memory.shape[1] > encoder.max_len:
        raise UserError(f"Sources of {memory.shape[1]} positions exceed the encoder's max_len={encoder.max_len}.")
    B, P = memory.shape[0], len(start.prompt)
    cache = model.decoder.init_cache(
        B, P + max_new_tokens, memory.dtype, model.decoder.project_memory(memory, memory_mask)
    )
    source = model.source(memory, memory_mask, source_inputs)
    prompt = jnp.broadcast_to(jnp.asarray(start.prompt, jnp.int32), (B, P))
    x, mask = model.target_embedder(prompt, jnp.ones((B, P), bool))
    hidden, cache = model.decoder.prefill(x, mask, cache)
    ends = hidden[:, jnp.asarray([0, P - 1])]  # the prompt's first and last positions
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
    **sampling,
) -> Generation:
    """Target tokens for each source (token ids, or an array [S, F] of features for the source
    front end; lengths may differ), after `start`'s prompt; the other settings as in
    `core.generation.generate.generate`. Compiled once per shape and settings: `width` pads the
    sources to that many positions, so that batches of different lengths can share one program."""
    settings, key = sampling_and_key(seed, **sampling)
    inputs, mask = prepare_sources(model, sources, settings.max_new_tokens, width, len(start.prompt))
    graphdef, params = nnx.split(model)
    outputs = _source_sample_program(graphdef, settings, start, on_tokens, params, inputs, mask, key, abandon.current())
    return Generation(*(np.asarray(x) for x in outputs))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), compiler_options=COMPILER_OPTIONS)
def _source_sample_program(graphdef, sampling, start, on_tokens, params, inputs, mask, key, ticket):
    model = nnx.merge(graphdef, params)
    logits, state, probe = encode_prefill(model, inputs, mask, start, sampling.max_new_tokens)
    step = functools.partial(encoder_decoder_step, model, suppress=start.suppress)
    return *sample(step, state, logits, key, sampling, on_tokens, ticket), probe


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
    model: EncoderDecoder, sources: Sequence[Any], *, start: Start, width: int | None = None, **beam
) -> Beams:
    """Beam search targets for each source (see `generate_from_source` and
    `core.generation.beam.beam_search`; `beam` as `core.generation.generate.generate_beams`'s):
    -> `Beams` of [B, W, max_new_tokens] tokens, best first, as numpy."""
    settings = beam_settings(**beam)
    inputs, mask = prepare_sources(model, sources, settings.max_new_tokens, width, len(start.prompt))
    graphdef, params = nnx.split(model)
    outputs = _source_beam_program(graphdef, settings, start, params, inputs, mask, abandon.current())
    return Beams(*(np.asarray(x) for x in outputs))


@functools.partial(jax.jit, static_argnums=(0, 1, 2), compiler_options=COMPILER_OPTIONS)
def _source_beam_program(graphdef, settings, start, params, inputs, mask, ticket):
    model = nnx.merge(graphdef, params)
    logits, state, probe = encode_prefill(model, inputs, mask, start, settings.max_new_tokens)
    step = functools.partial(encoder_decoder_step, model, suppress=start.suppress)
    return *beam_search(step, state, logits, **settings._asdict(), ticket=ticket)[:3], probe


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
