"""The layers a Transformer block is made of: norms, linear layers (with LoRA), self- and
cross-attention over one fused projection, the MLP, positions (rotary and sinusoidal), dropout.

Norms run in float32 whatever the compute dtype; dropout takes an explicit key so that train
steps stay pure functions of (parameters, batch, key). Linear layers multiply through
`core.model.precision.matmul`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from core.config import ModelConfig
from core.model.attention import (
    attention,
    cached_attention,
    memory_attention,
    memory_probabilities,
    memory_weighted,
)
from core.model.cache import KeyValues, write
from core.model.precision import matmul, narrower
from core.model.quantized import LinearKernel


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when `key` is None (evaluation) or `rate` is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class Norm(nnx.Module):
    """LayerNorm or RMSNorm over the last axis, computed in float32."""

    def __init__(self, d_model: int, kind: str, epsilon: float = 1e-6):
        self.kind = kind
        self.epsilon = epsilon
        self.scale = nnx.Param(jnp.ones((d_model,)))
        self.bias = nnx.Param(jnp.zeros((d_model,))) if kind == "layernorm" else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32)
        if self.kind == "layernorm":
            y = y - y.mean(-1, keepdims=True)
        y = y * jax.lax.rsqrt((y * y).mean(-1, keepdims=True) + self.epsilon)
        shape = (1,) * (y.ndim - 1) + (-1,)
        y = y * self.scale[...].reshape(shape)
        if self.bias is not None:
            y = y + self.bias[...].reshape(shape)
        return y.astype(x.dtype)


def sinusoids(positions: jax.Array, width: int) -> jax.Array:
    """The fixed position table of Whisper's encoder (tensor2tensor's layout) at integer
    `positions` [B, T] -> [B, T, width]: the sines of width / 2 frequencies, geometric from 1 down
    to 1 / 10,000, then their cosines."""
    half = width // 2
    frequencies = jnp.exp(-math.log(10_000.0) / (half - 1) * jnp.arange(half, dtype=jnp.float32))
    angle = positions[..., None].astype(jnp.float32) * frequencies[None, None, :]
    return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


def rotary(x: jax.Array, positions: jax.Array, base: float = 10_000.0) -> jax.Array:
    """Rotary position embedding of x [B, T, N, H] at integer positions [B, T]."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * inv_freq[None, None, :]  # [B, T, H/2]
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Dense(nnx.Module):
    """A linear layer whose backward pass is `matmul`'s; bias-free unless `bias` (BERT has them).

    With `lora_rank` r > 0 it adds a LoRA update (Hu et al., 2021): y = W x + B (A x) * alpha / r,
    A [inputs, r] random and B [r, outputs] zero, so that training starts from W's outputs
    exactly (core/model/lora.py trains A and B alone, and folds them into W for export). A server
    holding several adapters of one base multiplies by all of them and keeps each row's own
    (`core.model.lora.stacked`)."""

    def __init__(
        self, inputs: int, outputs: int, *, bias: bool = False, lora_rank: int = 0, lora_alpha: float = 16.0, rngs
    ):
        self.kernel = LinearKernel(nnx.initializers.lecun_normal()(rngs.params(), (inputs, outputs)))
        self.bias = nnx.Param(jnp.zeros((outputs,))) if bias else None
        if lora_rank:
            self.lora_a = nnx.Param(nnx.initializers.he_uniform()(rngs.params(), (inputs, lora_rank)))
            self.lora_b = nnx.Param(jnp.zeros((lora_rank, outputs)))
            self.lora_scale = lora_alpha / lora_rank
        else:
            self.lora_a = self.lora_b = None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = matmul(x, self.kernel[...])
        if self.lora_a is not None:
            low = matmul(x, self.lora_a[...])
            if getattr(self, "lora_ids", None) is not None:  # several adapters: each row keeps its own's columns
                low = low * self.lora_ids[...][:, None, :].astype(low.dtype)  # [B, C] (`core.model.lora.per_row`)
            y = y + matmul(low, self.lora_b[...] * self.lora_scale)
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
        return y


def adapters(config: ModelConfig, name: str) -> dict:
    """The LoRA arguments of the linear layer `name` (one of config.LORA_TARGETS)."""
    if config.lora_rank and name in config.lora_targets:
        return {"lora_rank": config.lora_rank, "lora_alpha": config.lora_alpha}
    return {}


class Attention(nnx.Module):
    """Multi-head (or grouped-query) self-attention with a fused QKV projection; block `layer`'s
    window and rotary base (`ModelConfig.window`, `rope_base_of`); with `qk_norm`, each head's
    queries and keys RMS-normalized before their positions are applied."""

    def __init__(self, config: ModelConfig, layer: int = 0, *, rngs: nnx.Rngs):
        self.config = config
        self.window, self.rope_base = config.window(layer), config.rope_base_of(layer)
        width = (config.num_heads + 2 * config.key_value_heads) * config.head_dim
        inner = config.num_heads * config.head_dim
        self.qkv = Dense(
            config.d_model, width, bias=config.bias or config.qkv_bias, **adapters(config, "qkv"), rngs=rngs
        )
        self.out = Dense(inner, config.d_model, bias=config.bias, **adapters(config, "out"), rngs=rngs)
        if config.qk_norm:
            self.q_norm = Norm(config.head_dim, "rmsnorm", config.norm_epsilon)
            self.k_norm = Norm(config.head_dim, "rmsnorm", config.norm_epsilon)
        else:
            self.q_norm = self.k_norm = None

    def __call__(
        self, x: jax.Array, mask: jax.Array, positions: jax.Array, cache: KeyValues | None, prefill: bool, segments=None
    ) -> tuple[jax.Array, KeyValues | None]:
        """x [B, T, D] at `positions` [B, T] -> [B, T, D] and the cache with this chunk's keys.

        Without a cache, or in a prefill (positions 0..T-1, right-padded `mask`), the chunk
        attends within itself; a prefill also stores its keys in the cache (`core.model.cache.write`). Else
        the chunk follows the cached keys: its queries attend to them and to its own keys, which
        then go into the slots of their positions, so that a step reads the cache before it
        updates it in place.
        """
        c = self.config
        B, T, _ = x.shape
        N, K = c.num_heads, c.key_value_heads
        q, k, v = jnp.split(self.qkv(x).reshape(B, T, N + 2 * K, -1), (N, N + K), axis=2)  # [B, T, N|K, H]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if c.positions == "rotary":
            q, k = rotary(q, positions, self.rope_base), rotary(k, positions, self.rope_base)
        if cache is None or prefill:
            y = attention(
                q, k, v, mask, causal=c.causal, implementation=c.attention, window=self.window, segments=segments
            )
        else:
            y = cached_attention(q, k, v, cache, positions[:, 0], self.window)
        if cache is not None:
            if prefill:
                lengths = mask.sum(-1, dtype=jnp.int32)
            else:  # a right-padded chunk (`mask`) writes its real positions alone
                lengths = positions[:, -1] + 1 if mask is None else positions[:, 0] + mask.sum(-1, dtype=jnp.int32)
            cache = write(cache, k, v, None if prefill else positions, lengths)
        return self.out(y.reshape(B, T, -1)), cache


class CrossAttention(nnx.Module):
    """Attention of a decoder's queries over an encoder's outputs (the memory): a query
    projection of the decoder's states and a fused key/value projection of the memory, grouped
    query heads as in `Attention`. No positions here: each stack has added its own."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        # Set on a copy of the model (`core.generation.alignment`): decoding over the memory's
        # keys and values then keeps its attention probabilities as an `nnx.Intermediate`.
        self.record = False
        self.query = Dense(config.d_model, config.num_heads * config.head_dim, bias=config.bias, rngs=rngs)
        self.key_value = Dense(
            config.d_model, 2 * config.key_value_heads * config.head_dim, bias=config.bias, rngs=rngs
        )
        self.out = Dense(config.num_heads * config.head_dim, config.d_model, bias=config.bias, rngs=rngs)

    def project(self, memory: jax.Array) -> tuple[jax.Array, jax.Array]:
        """memory [B, S, D] -> its keys and values [B, S, K, H]."""
        B, S, _ = memory.shape
        k, v = jnp.split(self.key_value(memory).reshape(B, S, 2 * self.config.key_value_heads, -1), 2, axis=2)
        return k, v

    def keys_values(self, memory: jax.Array) -> KeyValues:
        """memory [B, S, D] -> its keys and values in the cache's layout, computed once for decoding."""
        k, v = self.project(memory)
        return KeyValues(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 3, 1))

    def __call__(self, x: jax.Array, memory: jax.Array | KeyValues, memory_mask: jax.Array) -> jax.Array:
        """x [B, T, D] over `memory`: the encoder's outputs [B, S, D] (training: projected here,
        through the configured kernel) or their `keys_values` (decoding) -> [B, T, D]."""
        c = self.config
        B, T, _ = x.shape
        q = self.query(x).reshape(B, T, c.num_heads, -1)
        if isinstance(memory, KeyValues) and self.record:
            probabilities = memory_probabilities(q, memory.keys, memory_mask)
            self.sow(nnx.Intermediate, "probabilities", probabilities)
            y = memory_weighted(probabilities, memory.values)
        elif isinstance(memory, KeyValues):
            y = memory_attention(q, memory.keys, memory.values, memory_mask)
        else:
            k, v = self.project(memory)
            y = attention(q, k, v, memory_mask, causal=False, implementation=c.attention, cross=True)
        return self.out(y.reshape(B, T, -1))


class MLP(nnx.Module):
    """GELU MLP (tanh approximation, or "gelu_exact" with erf as BERT's checkpoints were trained),
    or a gated one, SwiGLU (SiLU gate) or GeGLU (tanh GELU gate), with the gate and up
    projections fused into one matmul."""

    GATES = {"swiglu": jax.nn.silu, "geglu": functools.partial(jax.nn.gelu, approximate=True)}

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.kind = config.mlp
        width = 2 * config.mlp_dim if self.kind in self.GATES else config.mlp_dim
        self.up = Dense(config.d_model, width, bias=config.bias, **adapters(config, "up"), rngs=rngs)
        self.down = Dense(config.mlp_dim, config.d_model, bias=config.bias, **adapters(config, "down"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.up(x)
        if self.kind in self.GATES:
            h = _gated(self.kind, h)
        else:
            h = jax.nn.gelu(h, approximate=self.kind == "gelu")
        return self.down(h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gated(kind: str, gate_up: jax.Array) -> jax.Array:
    """MLP.GATES[kind](gate) * up, the halves of `gate_up` [..., 2F] -> [..., F]. Its backward
    reads `gate_up` as saved in the products' dtype (`narrower`): under bfloat16 products the
    step keeps half the bytes of the layer's widest activation (SmolLM2: 30 x 25 MB in float32
    at 4 x 512 tokens), rounded as the products round their operands."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return MLP.GATES[kind](gate) * up


def _gated_forward(kind, gate_up):
    return _gated(kind, gate_up), gate_up.astype(narrower(gate_up.dtype))


def _gated_backward(kind, saved, grad):
    gate, up = jnp.split(saved.astype(grad.dtype), 2, axis=-1)
    activated, pullback = jax.vjp(MLP.GATES[kind], gate)
    (grad_gate,) = pullback(grad * up)
    return (jnp.concatenate([grad_gate, grad * activated], axis=-1),)


_gated.defvjp(_gated_forward, _gated_backward)


def make_norm(config: ModelConfig) -> Norm:
    return Norm(config.d_model, config.norm, config.norm_epsilon)
