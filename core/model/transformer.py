"""The shared Transformer body (Flax NNX) and the `Model` that joins a task's edges to it.

Positions are learned (a table of max_len rows), rotary (applied to queries and keys) or
sinusoidal (a fixed table added to the inputs, as Whisper's encoder has).

Pre-norm blocks: x + Attention(Norm(x)), then x + MLP(Norm(x)), and a final norm; or, with
`norm_position="post"` (BERT, for its checkpoints: core/checkpoints/pretrained.py), Norm(x + Attention(x)),
then Norm(x + MLP(x)), and no final norm. Attention is
`core.model.attention` (`jax.nn.dot_product_attention`, or a blockwise kernel on CPU), fed from one
fused QKV projection so that the hot matmul is a single large GEMM (the layers:
`core.model.layers`).

A causal body also decodes (see `core.generation.generate`). `prefill` runs the prompts as the training
forward does and keeps every layer's keys and values in a preallocated `Cache`; `extend` runs a
few new tokens per row after the cached ones, at each row's own positions, and writes theirs.
The cache (core/model/cache.py) is a plain pytree passed in and returned, so that decode steps are pure
functions.

A body built with `cross_attention=True` is the decoder of an encoder-decoder: each block is
self-attention, then cross-attention over the encoder's outputs (the memory [B, S, D] and its
mask [B, S]), then the MLP. For decoding, `project_memory` computes every layer's keys and
values of the memory once; they ride in the cache (`Cache.memory`) beside the decoder's own.
`EncoderDecoder` (core/model/encoder_decoder.py) joins an encoder body and such a decoder.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from core.config import ModelConfig
from core.model import kernels
from core.model.cache import Cache, KeyValues, Memory
from core.model.layers import MLP, Attention, CrossAttention, Norm, dropout, make_norm, sinusoids


class Block(nnx.Module):
    """One Transformer block, pre-norm, post-norm or sandwich by `config.norm_position`; with
    `cross_attention`, a cross-attention sublayer over the memory sits between the
    self-attention and the MLP. Each sublayer's norm keeps its name in every order, so that
    norm1 is the attention's and norm2 the MLP's; a sandwich adds out_norm1 and out_norm2 on
    their outputs."""

    def __init__(self, config: ModelConfig, layer: int = 0, *, cross_attention: bool = False, rngs: nnx.Rngs):
        self.rate = config.dropout
        self.post_norm = config.norm_position == "post"
        self.norm1 = make_norm(config)
        self.attention = Attention(config, layer, rngs=rngs)
        if cross_attention:
            self.norm_cross = make_norm(config)
            self.cross_attention = CrossAttention(config, rngs=rngs)
        else:
            self.cross_attention = None
        self.norm2 = make_norm(config)
        self.mlp = MLP(config, rngs=rngs)
        sandwich = config.norm_position == "sandwich"
        self.out_norm1 = make_norm(config) if sandwich else None
        self.out_norm2 = make_norm(config) if sandwich else None

    def __call__(
        self, x, mask, positions, key, memory=None, memory_mask=None, cache=None, prefill=False, segments=None
    ):
        sublayers = 2 if self.cross_attention is None else 3
        k1, k2, k3 = ([None] * 3 if key is None else [*jax.random.split(key, sublayers), None])[:3]
        y, cache = self.attention(self._input(x, self.norm1), mask, positions, cache, prefill, segments)
        x = self._add(x, y, self.norm1, k1, self.out_norm1)
        if self.cross_attention is not None:
            y = self.cross_attention(self._input(x, self.norm_cross), memory, memory_mask)
            x = self._add(x, y, self.norm_cross, k3)
        return self._add(x, self.mlp(self._input(x, self.norm2)), self.norm2, k2, self.out_norm2), cache

    def _input(self, x: jax.Array, norm: Norm) -> jax.Array:
        """What a sublayer reads: the normalized stream (pre-norm) or the stream itself (post-norm)."""
        return x if self.post_norm else norm(x)

    def _add(self, x: jax.Array, y: jax.Array, norm: Norm, key: jax.Array | None, out_norm: Norm | None = None):
        """The residual sum with a sublayer's output y (normalized first in a sandwich),
        normalized after it when post-norm."""
        if out_norm is not None:
            y = out_norm(y)
        x = x + dropout(y, self.rate, key)
        return norm(x) if self.post_norm else x


class Transformer(nnx.Module):
    """A stack of blocks: bidirectional (encoder) or causal (decoder) by `config.causal`, with
    cross-attention over a memory (an encoder-decoder's decoder) by `cross_attention`."""

    def __init__(self, config: ModelConfig, *, remat: bool = False, cross_attention: bool = False, rngs: nnx.Rngs):
        self.config = config
        self.cross_attention = cross_attention
        self.position_embedding = (
            nnx.Embed(config.max_len, config.d_model, rngs=rngs) if config.positions == "learned" else None
        )
        self.token_type_embedding = (
            nnx.Embed(config.token_types, config.d_model, rngs=rngs) if config.token_types else None
        )
        self.embedding_norm = make_norm(config) if config.embedding_norm else None
        self.blocks = nnx.List(
            [Block(config, i, cross_attention=cross_attention, rngs=rngs) for i in range(config.num_layers)]
        )
        # Post-norm blocks end normalized already.
        self.final_norm = make_norm(config) if config.norm_position != "post" else None
        # Recompute each block's activations in the backward pass instead of storing them.
        self.apply_block = nnx.remat(Block.__call__) if remat else Block.__call__

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array,
        *,
        memory: jax.Array | None = None,
        memory_mask: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
        token_types: jax.Array | None = None,
        segments: jax.Array | None = None,
    ) -> jax.Array:
        """x [B, T, D] embedded inputs, mask [B, T] true at real positions -> [B, T, D]; with
        cross-attention, over `memory` [B, S, D] whose `memory_mask` [B, S] marks real positions.
        `token_types` [B, T] are the segments of a body with a token-type table (None: all 0, one
        sentence, as BERT reads it). `segments` [B, T] number the examples packed in each row
        (1, 2, ...): each attends within itself, at positions counted from its own start."""
        self._check_memory(memory)
        B, T, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        if segments is not None:
            starts = jnp.where(segments != jnp.pad(segments, ((0, 0), (1, 0)))[:, :-1], positions, 0)
            positions = positions - jax.lax.cummax(starts, axis=1)
        return self._run(x, mask, positions, dropout_key, None, False, memory, memory_mask, token_types, segments)[0]

    def project_memory(self, memory: jax.Array, memory_mask: jax.Array) -> Memory:
        """Every layer's cross-attention keys and values of `memory` [B, S, D], for a decoding
        cache (`init_cache`): computed once per source, not at every new token."""
        self._check_memory(memory)
        return Memory(tuple(block.cross_attention.keys_values(memory) for block in self.blocks), memory_mask)

    def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32, memory: Memory | None = None) -> Cache:
        """An empty cache of `max_len` positions per row, holding `memory` (`project_memory`)
        for a body with cross-attention. A sliding-window layer keeps only its window's slots
        (a ring: `core.model.cache.KeyValues`): Gemma 3's five local layers of six hold 512 positions
        whatever the context, which shrinks the cache and what each decode step reads."""
        self._check_memory(memory)
        c = self.config
        layers = []
        for i in range(len(self.blocks)):
            window = c.window(i)
            slots = max_len if window is None else min(max_len, window)
            keys = (batch_size, c.key_value_heads, slots, c.head_dim)
            values = (batch_size, c.key_value_heads, c.head_dim, slots)
            layers.append(KeyValues(jnp.zeros(keys, dtype), jnp.zeros(values, dtype)))
        return Cache(tuple(layers), jnp.zeros((batch_size,), jnp.int32), memory)

    def prefill(self, x: jax.Array, mask: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """Right-padded prompts x [B, T, D], mask [B, T] -> hidden [B, T, D] and `cache` (empty,
        at least T positions) holding their keys, with lengths = the real tokens of each row."""
        self._check_memory(cache.memory)
        B, T, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        hidden, layers = self._run(x, mask, positions, None, cache.layers, True, cache.memory)
        return hidden, Cache(layers, mask.sum(-1, dtype=jnp.int32), cache.memory)

    def extend(self, x: jax.Array, cache: Cache, mask: jax.Array | None = None) -> tuple[jax.Array, Cache]:
        """New tokens x [B, T, D] that follow each row's cached ones -> hidden [B, T, D] and the
        cache holding them too. Row b's tokens take positions lengths[b] .. lengths[b] + T - 1;
        with a right-padded `mask` [B, T], only its real ones are kept (a padded chunk of a
        prompt after a cached prefix)."""
        self._check_memory(cache.memory)
        B, T, _ = x.shape
        positions = cache.lengths[:, None] + jnp.arange(T)[None, :]
        hidden, layers = self._run(x, mask, positions, None, cache.layers, False, cache.memory)
        added = T if mask is None else mask.sum(-1, dtype=jnp.int32)
        return hidden, Cache(layers, cache.lengths + added, cache.memory)

    def _check_memory(self, memory) -> None:
        if (memory is None) == self.cross_attention:
            raise ValueError(
                "A body with cross-attention needs a memory; one without takes none"
                f" (cross_attention={self.cross_attention}, memory given: {memory is not None})."
            )

    def _run(
        self,
        x,
        mask,
        positions,
        dropout_key,
        caches,
        prefill,
        memory=None,
        memory_mask=None,
        token_types=None,
        segments=None,
    ):
        """`memory` is the encoder's outputs [B, S, D] with `memory_mask` (training), or a
        `Memory` with each layer's keys and values (decoding); None without cross-attention."""
        if self.config.embedding_scale:
            x = x * jnp.asarray(self.config.d_model**0.5, x.dtype)
        if self.position_embedding is not None:
            x = x + self.position_embedding(positions).astype(x.dtype)
        elif self.config.positions == "sinusoidal":
            x = x + sinusoids(positions, x.shape[-1]).astype(x.dtype)
        if self.token_type_embedding is not None:
            if token_types is None:
                token_types = jnp.zeros(positions.shape, jnp.int32)
            x = x + self.token_type_embedding(token_types).astype(x.dtype)
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        x = dropout(x, self.config.dropout, dropout_key)
        layers = None
        if caches is not None:
            x, layers = self._decoding(x, mask, positions, caches, prefill, memory)
        elif kernels.chosen().scan_layers and len(self.blocks) > 1:
            x = self._scanned(x, mask, positions, dropout_key, memory, memory_mask, segments)
        else:
            for i, block in enumerate(self.blocks):
                key = None if dropout_key is None else jax.random.fold_in(dropout_key, i + 1)
                x, _ = self.apply_block(block, x, mask, positions, key, memory, memory_mask, None, False, segments)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, layers

    def _decoding(self, x, mask, positions, caches, prefill, memory):
        """The blocks one after another over their caches -> (x, the caches after). No backward
        pass when decoding, so nothing to rematerialize."""
        layers = []
        for i, block in enumerate(self.blocks):
            layer_memory = None if memory is None else memory.layers[i]
            mask_memory = None if memory is None else memory.mask
            x, layer = block(x, mask, positions, None, layer_memory, mask_memory, caches[i], prefill)
            layers.append(layer)
        return x, tuple(layers)

    def _scanned(self, x, mask, positions, dropout_key, memory, memory_mask, segments):
        """The blocks as `jax.lax.scan` over groups of `period` blocks: one group is compiled
        whatever the depth. Each position of the group has its blocks' parameters stacked (a copy
        a step, in the parameters' dtype) and the same structure (Gemma 3's five sliding layers
        and one global make a group of six); block i draws the dropout key of the unrolled
        loop, so both give the same results."""
        period = self.period()
        graphdefs, states = zip(*(nnx.split(block) for block in self.blocks))
        stacked = [jax.tree.map(lambda *layers: jnp.stack(layers), *states[j::period]) for j in range(period)]

        def group(x, inputs):
            parameters, first = inputs
            for j in range(period):
                block = nnx.merge(graphdefs[j], parameters[j])
                key = None if dropout_key is None else jax.random.fold_in(dropout_key, first + j + 1)
                x, _ = self.apply_block(block, x, mask, positions, key, memory, memory_mask, None, False, segments)
            return x, None

        return jax.lax.scan(group, x, (stacked, jnp.arange(0, len(self.blocks), period)))[0]

    def period(self) -> int:
        """The fewest blocks after which the stack's structure repeats (1 where every block is
        alike; the whole depth where nothing repeats)."""
        graphdefs = [nnx.split(block)[0] for block in self.blocks]
        depth = len(graphdefs)
        return next(
            p
            for p in range(1, depth + 1)
            if depth % p == 0 and all(g == graphdefs[i % p] for i, g in enumerate(graphdefs))
        )


class Model(nnx.Module):
    """A task's embedder (its front end), the shared body and the task's head: batch -> outputs.

    The front end maps (inputs, mask) to (x [B, T', D], mask [B, T']): token embeddings keep
    the length, a strided convolution over speech frames shortens it and returns the mask of
    the frames it kept. The body and the head see the front end's mask.
    """

    # The parts that another run's weights fill (`--init-from`, as Hugging Face's
    # `base_model_prefix` names them): the front end and the body; the head is the task's own.
    transferred: ClassVar[tuple[str, ...]] = ("embedder", "body")

    def __init__(self, embedder: nnx.Module, body: Transformer, head: nnx.Module):
        self.embedder = embedder
        self.body = body
        self.head = head

    def __call__(self, batch: dict, *, dropout_key: jax.Array | None = None):
        """`batch["segments"]`, where a task packs several examples into a row (see
        `Transformer.__call__`), keeps them apart."""
        x, mask = self.embedder(batch["inputs"], batch["mask"])
        hidden = self.body(x, mask, dropout_key=dropout_key, segments=batch.get("segments"))
        return self.head(hidden, mask)
