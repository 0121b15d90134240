"""Where each target token looked in the source: an encoder-decoder's cross-attention, read back.

Word timestamps (Whisper's `find_alignment`, faster-whisper's too) read the cross-attention of a
few decoder heads while the decoder reads a transcript it already wrote: `cross_attention` runs
that teacher-forced pass once over the sources and the given tokens and returns the attention
probabilities of the chosen (layer, head) pairs, with each token's probability under the model.
The model's own `CrossAttention` layers keep their probabilities on a copy made inside the
compiled program (`record`), so serving and decoding run exactly as before.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.generation.generate import COMPILER_OPTIONS
from core.generation.seq2seq import prepare_sources
from core.model.encoder_decoder import EncoderDecoder


def cross_attention(
    model: EncoderDecoder,
    sources: list[Any],
    tokens: np.ndarray,
    heads: tuple[tuple[int, int], ...],
    vocabulary: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The probabilities [B, len(heads), T, S] with which the decoder's `heads` ((layer, query
    head) pairs) attend over each source's S positions as it reads `tokens` [B, T] (a row's
    tokens may be padded at the end: their rows mean nothing), and the probability [B, T - 1] of
    each token after the first given those before it, among the first `vocabulary` ids (Whisper's
    text tokens)."""
    inputs, mask = prepare_sources(model, sources, 1)
    graphdef, params = nnx.split(model)
    found = _program(graphdef, heads, vocabulary, params, inputs, mask, jnp.asarray(tokens, jnp.int32))
    return np.asarray(found[0]), np.asarray(found[1])


@functools.partial(jax.jit, static_argnums=(0, 1, 2), compiler_options=COMPILER_OPTIONS)
def _program(graphdef, heads, vocabulary, params, inputs, mask, tokens):
    model = nnx.merge(graphdef, params)
    layers = sorted({layer for layer, _ in heads})
    for layer in layers:
        model.decoder.blocks[layer].cross_attention.record = True

    def forward(model):
        memory, memory_mask = model.encode(inputs, mask)
        B, T = tokens.shape
        cache = model.decoder.init_cache(B, T, memory.dtype, model.decoder.project_memory(memory, memory_mask))
        x, token_mask = model.target_embedder(tokens, jnp.ones((B, T), bool))
        hidden, _ = model.decoder.prefill(x, token_mask, cache)
        source = model.source(memory, memory_mask, inputs)
        logits = model.outputs(hidden, token_mask, source).logits()[..., :vocabulary].astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        chosen = jnp.minimum(tokens[:, 1:, None], vocabulary - 1)
        return jnp.take_along_axis(log_probs[:, :-1], chosen, axis=-1)[..., 0]

    following, recorded = nnx.capture(forward, nnx.Intermediate)(model)
    picked = []
    for layer, head in heads:
        probabilities = recorded["decoder"]["blocks"][layer]["cross_attention"]["probabilities"].get_value()[0]
        groups = probabilities.shape[2]  # [B, K, G, T, S]: query head n is (n // G, n % G)
        picked.append(probabilities[:, head // groups, head % groups])
    return jnp.stack(picked, axis=1), jnp.exp(following)
