"""An encoder-decoder built from the shared blocks: the model of translation and summarization.

The source front end maps (`inputs`, `mask`) to vectors and a mask, which a bidirectional
`Transformer` encodes into the memory [B, S, D]. The target front end embeds `decoder_inputs`
(the targets shifted right behind a beginning-of-sequence token), and a causal `Transformer`
built with `cross_attention=True` runs over them and over the memory; the head maps its states
to the task's outputs, which the loss compares with `targets` (see core/task.py for the keys).
A `core.heads.CopyOutput` head also reads the source (the memory and the source tokens), so that
the model may copy source tokens into the target.

Decoding (`generate_from_source`, `generate_beams_from_source`) runs core/generate.py's `sample`
and `beam_search` with this model's own decode step: `encode_prefill` encodes the sources once,
projects every decoder layer's keys and values of the memory once into the cache (and, for a
copying head, its view of the source into the state beside it) and runs the decoder's prompt
(`Start`: a beginning-of-sequence token, or Whisper's four); `encoder_decoder_step` then runs
one target token at a time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.beam import Beams, beam_search
from core.cache import Cache
from core.config import ModelConfig
from core.errors import UserError
from core.generate import COMPILER_OPTIONS, Generation, OnTokens, beam_settings, sample, sampling_and_key, step_logits
from core.heads import Source
from core.transformer import Transformer


class DecodeState(NamedTuple):
    """What an encoder-decoder's decode step carries: the decoder's `Cache` (which holds the
    memory's keys and values) and, for a `CopyOutput` head, its `Source` (else None)."""

    cache: Cache
    source: Source | None


class EncoderDecoder(nnx.Module):
    """source front end -> encoder -> memory; target front end -> decoder over the memory -> head.

    The two front ends may be one module (a vocabulary shared by source and target), and the
    head may tie its output to the target front end (`core.heads.TiedOutput`).
    """

    # The parts that another run's weights fill (`--init-from`): everything but the head.
    transferred: ClassVar[tuple[str, ...]] = ("source_embedder", "encoder", "target_embedder", "decoder")

    def __init__(
        self,
        source_embedder: nnx.Module,
        encoder: Transformer,
        target_embedder: nnx.Module,
        decoder: Transformer,
        head: nnx.Module,
    ):
        if encoder.cross_attention or not decoder.cross_attention:
            raise ValueError("An EncoderDecoder needs an encoder without cross-attention and a decoder with it.")
        if not decoder.config.causal:
            raise ValueError("An EncoderDecoder's decoder must be causal: it predicts each target from those before.")
        if encoder.config.d_model != decoder.config.d_model:
            raise ValueError(
                f"The encoder's d_model={encoder.config.d_model} differs from the decoder's {decoder.config.d_model}."
            )
        self.source_embedder = source_embedder
        self.encoder = encoder
        self.target_embedder = target_embedder
        self.decoder = decoder
        self.head = head

    @property
    def copies(self) -> bool:
        """Whether the head reads the source (its declared `reads_source`, as `CopyOutput`
        does): the source front end must then be token ids of the target's vocabulary."""
        return self.head.reads_source

    def source(self, memory: jax.Array, memory_mask: jax.Array, inputs: jax.Array) -> Source | None:
        """The head's view of the source, or None for a head that does not read it."""
        return self.head.source(memory, memory_mask, inputs) if self.copies else None

    def outputs(self, hidden: jax.Array, mask: jax.Array, source: Source | None):
        """The head's outputs at the decoder states `hidden` [B, T, D]."""
        return self.head(hidden, mask) if source is None else self.head(hidden, mask, source)

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        source_embedder: nnx.Module,
        target_embedder: nnx.Module,
        head: nnx.Module,
        *,
        remat: bool = False,
        rngs: nnx.Rngs,
    ) -> EncoderDecoder:
        """Both stacks from one config: a bidirectional encoder of `num_layers` blocks and a
        causal decoder of `decoder_layers` (default `num_layers`); `config.causal` is set per
        stack, whatever its value, and the encoder's positions are `encoder_positions` where set."""
        positions = config.encoder_positions or config.positions
        encoder = Transformer(dataclasses.replace(config, causal=False, positions=positions), remat=remat, rngs=rngs)
        depth = config.num_layers if config.decoder_layers is None else config.decoder_layers
        decoder_config = dataclasses.replace(config, causal=True, num_layers=depth)
        decoder = Transformer(decoder_config, remat=remat, cross_attention=True, rngs=rngs)
        return cls(source_embedder, encoder, target_embedder, decoder, head)

    def encode(
        self, inputs: jax.Array, mask: jax.Array, *, dropout_key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Source `inputs` and `mask` -> the memory [B, S, D] and its mask [B, S] (the front
        end's, which may be shorter than the inputs)."""
        x, memory_mask = self.source_embedder(inputs, mask)
        return self.encoder(x, memory_mask, dropout_key=dropout_key), memory_mask

    def __call__(self, batch: dict, *, dropout_key: jax.Array | None = None):
        """Teacher forcing: the head's outputs at every target position of the batch."""
        keys = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        memory, memory_mask = self.encode(batch["inputs"], batch["mask"], dropout_key=keys[0])
        x, mask = self.target_embedder(batch["decoder_inputs"], batch["decoder_mask"])
        hidden = self.decoder(x, mask, memory=memory, memory_mask=memory_mask, dropout_key=keys[1])
        return self.outputs(hidden, mask, self.source(memory, memory_mask, batch["inputs"]))


class Start(NamedTuple):
    """How decoding begins and what it never writes (hashable: a static argument of the jitted
    programs). `prompt`: the decoder's first tokens, the same for every row (a
    beginning-of-sequence token; Whisper's start, language, task and no-timestamps tokens).
    `suppress`: ids banned at every step; `suppress_first`: also banned at the first new token
    (Whisper's blank and end). `probe`: a token whose probability right after the prompt's first
    token the programs report (Whisper's no-speech probability), or None."""

    prompt: tuple[int, ...]
    suppress: tuple[int, ...] = ()
    suppress_first: tuple[int, ...] = ()
    probe: int | None = None


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
    max_new_tokens: int,
    start: Start,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    seed: int | jax.Array = 0,
    on_tokens: OnTokens | None = None,
    width: int | None = None,
    no_repeat_ngram: int = 0,
    word_reward: float = 0.0,
) -> Generation:
    """Target tokens for each source (token ids, or an array [S, F] of features for the source
    front end; lengths may differ), after `start`'s prompt; the other settings as in `generate`.
    Compiled once per shape and settings: `width` pads the sources to that many positions, so
    that batches of different lengths can share one program."""
    sampling, key = sampling_and_key(
        max_new_tokens, temperature, top_k, top_p, stop_tokens, seed, no_repeat_ngram, word_reward
    )
    inputs, mask = prepare_sources(model, sources, max_new_tokens, width, len(start.prompt))
    graphdef, params = nnx.split(model)
    outputs = _source_sample_program(graphdef, sampling, start, on_tokens, params, inputs, mask, key)
    return Generation(*(np.asarray(x) for x in outputs))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), compiler_options=COMPILER_OPTIONS)
def _source_sample_program(graphdef, sampling, start, on_tokens, params, inputs, mask, key):
    model = nnx.merge(graphdef, params)
    logits, state, probe = encode_prefill(model, inputs, mask, start, sampling.max_new_tokens)
    step = functools.partial(encoder_decoder_step, model, suppress=start.suppress)
    return *sample(step, state, logits, key, sampling, on_tokens), probe


def generate_beams_from_source(
    model: EncoderDecoder,
    sources: Sequence[Any],
    *,
    beam_size: int,
    max_new_tokens: int,
    start: Start,
    stop_tokens: Sequence[int] = (),
    length_penalty: float = 0.6,
    width: int | None = None,
    no_repeat_ngram: int = 0,
    word_reward: float = 0.0,
    early_stopping: bool = False,
) -> Beams:
    """Beam search targets for each source (see `generate_from_source` and
    `core.beam.beam_search`): -> `Beams` of [B, W, max_new_tokens] tokens, best first, as numpy."""
    settings = beam_settings(
        beam_size, max_new_tokens, stop_tokens, length_penalty, no_repeat_ngram, word_reward, early_stopping
    )
    inputs, mask = prepare_sources(model, sources, max_new_tokens, width, len(start.prompt))
    graphdef, params = nnx.split(model)
    return Beams(*(np.asarray(x) for x in _source_beam_program(graphdef, settings, start, params, inputs, mask)))


@functools.partial(jax.jit, static_argnums=(0, 1, 2), compiler_options=COMPILER_OPTIONS)
def _source_beam_program(graphdef, settings, start, params, inputs, mask):
    model = nnx.merge(graphdef, params)
    logits, state, probe = encode_prefill(model, inputs, mask, start, settings.max_new_tokens)
    step = functools.partial(encoder_decoder_step, model, suppress=start.suppress)
    return *beam_search(step, state, logits, **settings._asdict())[:3], probe


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
