"""The shared Transformer body (Flax NNX) and the `Model` that joins a task's edges to it.

Pre-norm blocks: x + Attention(Norm(x)), then x + MLP(Norm(x)), and a final norm. Attention is
`core.attention` (`jax.nn.dot_product_attention`, or a blockwise kernel on CPU), fed from one
fused QKV projection so that the hot matmul is a single large GEMM. Norms run in
float32 whatever the compute dtype; dropout takes an explicit key so that train steps stay pure
functions of (parameters, batch, key).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from core.attention import attention
from core.config import ModelConfig


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when `key` is None (evaluation) or `rate` is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class Norm(nnx.Module):
    """LayerNorm or RMSNorm over the last axis, computed in float32."""

    def __init__(self, d_model: int, kind: str):
        self.kind = kind
        self.scale = nnx.Param(jnp.ones((d_model,)))
        self.bias = nnx.Param(jnp.zeros((d_model,))) if kind == "layernorm" else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32)
        if self.kind == "layernorm":
            y = y - y.mean(-1, keepdims=True)
        y = y * jax.lax.rsqrt((y * y).mean(-1, keepdims=True) + 1e-6)
        shape = (1,) * (y.ndim - 1) + (-1,)
        y = y * self.scale[...].reshape(shape)
        if self.bias is not None:
            y = y + self.bias[...].reshape(shape)
        return y.astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, base: float = 10_000.0) -> jax.Array:
    """Rotary position embedding of x [B, T, N, H] at integer positions [B, T]."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * inv_freq[None, None, :]  # [B, T, H/2]
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@jax.custom_vjp
def matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., I] @ kernel [I, O], with a weight gradient that transposes the narrower operand.

    The weight gradient x^T @ g contracts over tokens; XLA on CPU hands its matmul one operand
    transposed in memory, and by default picks g, fusing that strided write into whatever
    produced g (the GELU backward, for one). Written as (g^T @ x)^T when O > I, the copy falls on
    x, the narrower of the two, and the producer of g writes in order.
    """
    return x @ kernel


def _matmul_forward(x, kernel):
    return x @ kernel, (x, kernel)


def _matmul_backward(residuals, g):
    x, kernel = residuals
    inputs, outputs = kernel.shape
    flat_x, flat_g = x.reshape(-1, inputs), g.reshape(-1, outputs)
    if outputs > inputs:
        grad_kernel = jnp.dot(flat_g.T, flat_x).T
    else:
        grad_kernel = jnp.dot(flat_x.T, flat_g)
    return g @ kernel.T, grad_kernel.astype(kernel.dtype)


matmul.defvjp(_matmul_forward, _matmul_backward)


class Dense(nnx.Module):
    """A bias-free linear layer whose backward pass is `matmul`'s."""

    def __init__(self, inputs: int, outputs: int, *, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (inputs, outputs)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return matmul(x, self.kernel[...].astype(x.dtype))


class Attention(nnx.Module):
    """Multi-head self-attention with a fused QKV projection."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        d = config.d_model
        self.qkv = Dense(d, 3 * d, rngs=rngs)
        self.out = Dense(d, d, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, positions: jax.Array) -> jax.Array:
        c = self.config
        B, T, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3 * c.num_heads, -1), 3, axis=2)  # [B, T, N, H]
        if c.positions == "rotary":
            q, k = rotary(q, positions), rotary(k, positions)
        y = attention(q, k, v, mask, causal=c.causal, implementation=c.attention)
        return self.out(y.reshape(B, T, -1))


class MLP(nnx.Module):
    """GELU MLP, or SwiGLU with the gate and up projections fused into one matmul."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.kind = config.mlp
        width = 2 * config.mlp_dim if self.kind == "swiglu" else config.mlp_dim
        self.up = Dense(config.d_model, width, rngs=rngs)
        self.down = Dense(config.mlp_dim, config.d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.up(x)
        if self.kind == "swiglu":
            gate, h = jnp.split(h, 2, axis=-1)
            h = jax.nn.silu(gate) * h
        else:
            h = jax.nn.gelu(h)
        return self.down(h)


class Block(nnx.Module):
    """One pre-norm Transformer block."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.rate = config.dropout
        self.norm1 = Norm(config.d_model, config.norm)
        self.attention = Attention(config, rngs=rngs)
        self.norm2 = Norm(config.d_model, config.norm)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, mask, positions, key):
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        x = x + dropout(self.attention(self.norm1(x), mask, positions), self.rate, k1)
        return x + dropout(self.mlp(self.norm2(x)), self.rate, k2)


class Transformer(nnx.Module):
    """A stack of blocks: bidirectional (encoder) or causal (decoder) by `config.causal`."""

    def __init__(self, config: ModelConfig, *, remat: bool = False, rngs: nnx.Rngs):
        self.config = config
        self.position_embedding = (
            nnx.Embed(config.max_len, config.d_model, rngs=rngs) if config.positions == "learned" else None
        )
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = Norm(config.d_model, config.norm)
        # Recompute each block's activations in the backward pass instead of storing them.
        self.apply_block = nnx.remat(Block.__call__) if remat else Block.__call__

    def __call__(self, x: jax.Array, mask: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """x [B, T, D] embedded inputs, mask [B, T] true at real positions -> [B, T, D]."""
        B, T, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        if self.position_embedding is not None:
            x = x + self.position_embedding(positions).astype(x.dtype)
        x = dropout(x, self.config.dropout, dropout_key)
        for i, block in enumerate(self.blocks):
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, i + 1)
            x = self.apply_block(block, x, mask, positions, key)
        return self.final_norm(x)


class Model(nnx.Module):
    """A task's embedder, the shared body and the task's head: batch -> head outputs."""

    def __init__(self, embedder: nnx.Module, body: Transformer, head: nnx.Module):
        self.embedder = embedder
        self.body = body
        self.head = head

    def __call__(self, batch: dict, *, dropout_key: jax.Array | None = None):
        x = self.embedder(batch["inputs"])
        hidden = self.body(x, batch["mask"], dropout_key=dropout_key)
        return self.head(hidden, batch["mask"])
