"""Attention of training and prefill on a TPU: splash attention, Pallas's block-sparse flash
kernel (`jax.experimental.pallas.ops.tpu.splash_attention`), made once per layer shape.

It takes what `core.model.attention.attention` takes: q [B, T, N, H], k, v [B, S, K, H] (K key
heads shared by N / K query heads each), the keys' mask [B, S], causal or not, a sliding
`window`, packed rows' `segments` [B, T]. The kernel attends one example at a time (vmapped over
the batch), heads first. Its static mask is causal, local (query i sees keys i - W + 1 .. i) or
full, and it skips the blocks that mask leaves empty; what varies by row becomes segment ids:
a real key carries its example's segment plus one, padding 0, so that a query sees the real keys
of its own example, and a padding query (whose output nobody reads) sees padding alone. In
cross-attention every query carries 1 and the keys their mask. Lengths are padded to whole
blocks of 128 (the padding is segment 0); queries are scaled by 1/sqrt(H) before the kernel,
which does not scale them. The operands run in the products' dtype (bfloat16 under bfloat16
products), the softmax in float32.

Over several devices it runs in `jax.shard_map` over the mesh's batch axes, each device on its
own rows. Off the TPU it runs in Pallas's interpreter (`interpret`): the tests compare it with
XLA's kernel on the CPU, on one device and on eight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCK = 128
# The largest block of queries or keys a kernel takes: 512 fills the v5e's MXU with few steps.
MAX_BLOCK = 512


def usable(q: jax.Array, k: jax.Array) -> bool:
    """Whether the kernel takes these shapes: a key head count that divides the query heads'
    (grouped-query attention), in a process of one device or within a mesh whose batch axes
    split the rows (`batch_axes`; XLA does not partition a Pallas kernel by itself)."""
    return q.shape[2] % k.shape[2] == 0 and (jax.device_count() == 1 or bool(batch_axes()))


def batch_axes() -> tuple[str, ...]:
    """The axes of the mesh being traced in (`jax.sharding.use_abstract_mesh`, which the
    training and evaluation steps enter) that split a batch's rows: "data" and "fsdp" where
    they hold more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(axis for axis in ("data", "fsdp") if axis in mesh.axis_names and mesh.shape[axis] > 1)


def whole(length: int) -> int:
    return -(-length // BLOCK) * BLOCK


def block(length: int) -> int:
    """The largest block of `BLOCK`'s multiples up to `MAX_BLOCK` that divides `length`."""
    return next(size for size in (MAX_BLOCK, 256, BLOCK) if length % size == 0)


@functools.cache
def _kernel(queries: int, keys: int, heads: int, causal: bool, window: int | None, interpret: bool):
    """The splash kernel for `heads` query heads of `queries` positions over `keys` positions."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (queries, keys)
    if causal and window is not None:
        mask = splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    elif causal:
        mask = splash.CausalMask(shape)
    else:
        mask = splash.FullMask(shape)
    block_q, block_kv = block(queries), block(keys)
    sizes = splash.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        use_fused_bwd_kernel=True,
    )
    # Made outside any trace: the kernel's mask tables are constants kept across programs.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(
            splash.MultiHeadMask([mask] * heads), head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret
        )


def segment_ids(mask: jax.Array, segments: jax.Array | None, length: int) -> jax.Array:
    """Each position's segment id [B, `length`]: its example's segment plus one where `mask`
    is real (1 without packed `segments`), 0 at padding and past the mask's end."""
    ids = mask.astype(jnp.int32) if segments is None else jnp.where(mask, segments.astype(jnp.int32) + 1, 0)
    return jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])))


def attention(q, k, v, mask, causal: bool, dtype, window=None, segments=None, cross=False, interpret=False):
    """The attention of the module's text -> [B, T, N, H] in v's dtype."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    B, T, N, H = q.shape
    S = k.shape[1]
    queries, keys = whole(T), whole(S)
    if cross:
        query_ids = jnp.pad(jnp.ones((B, T), jnp.int32), ((0, 0), (0, queries - T)))
        key_ids = segment_ids(mask, None, keys)
    else:
        query_ids = key_ids = segment_ids(mask, segments, queries)

    def heads_first(x, length, scale=1.0):
        x = (x * scale).astype(dtype) if scale != 1.0 else x.astype(dtype)
        return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    kernel = _kernel(queries, keys, N, causal, window, interpret)

    def one(q, k, v, query_ids, key_ids):
        return kernel(q, k, v, segment_ids=SegmentIds(query_ids, key_ids))

    batched = jax.vmap(one)
    axes = batch_axes()
    if axes:  # each device attends its own rows
        rows = jax.sharding.PartitionSpec(axes)
        batched = jax.shard_map(batched, in_specs=(rows,) * 5, out_specs=rows, check_vma=False)
    out = batched(heads_first(q, queries, H**-0.5), heads_first(k, keys), heads_first(v, keys), query_ids, key_ids)
    return out.transpose(0, 2, 1, 3)[:, :T].astype(v.dtype)
