"""The training step's large bfloat16 products on AMX's tiles, a kernel of ours
(`core.model.kernels.native.tile_product`), either operand read as stored, transposed or not.
`tiled` says whether a product of a shape goes there (else XLA's), `multiply` calls it,
`stacked` reads an einsum as a stack of matrix products. The seam (`core.model.kernels`) routes
products here where it chose our kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import core.model.kernels.native as native


def tiled(dtype, rows: int, depth: int, columns: int) -> bool:
    """Whether a product of rows x depth times depth x columns in `dtype` goes to AMX's tiles:
    in bfloat16, on a CPU with AMX, in a process of one device (XLA does not split a kernel of
    ours across devices: each would gather the whole operands), and at the shapes where it beats
    XLA's. Against XLA's YNNPACK, alone on 2 Sapphire Rapids cores: SmolLM2's layers at 2,048
    tokens and their two gradients 1,200-1,700 against 480-1,100 GFLOP/s; the output layer's
    products over 49,152 pieces, which write 100 MB of float32 a chunk or read 57 MB of weights,
    at XLA's speed or slower, bound by memory: hence at least 32 of each (a tile's block), depth
    and columns within 8,192, and results within 2^23 values."""
    if min(rows, depth, columns) < 32 or max(depth, columns) > 8192 or rows * columns > 2**23:
        return False
    return takes(dtype)


def takes(dtype) -> bool:
    """Whether products in `dtype` go to the tiles here, whatever their shape (`panels`)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and here()


def here() -> bool:
    """Whether the tiles run here, for a process of one device (`tiled`)."""
    return jax.device_count() == 1 and native.tiles_ready()  # tiles_ready: False off the CPU backend


def multiply(a, b, columns: int, a_transposed: bool, b_transposed: bool) -> jax.Array:
    """a [..., M, K] (stored [..., K, M] when `a_transposed`) times b [..., K, N] (stored
    [..., N, K] when `b_transposed`) on AMX's tiles -> [..., M, N] float32."""
    return multiply_panels(a, panels(b, b_transposed), columns, a_transposed)


def panels(b, transposed: bool = False) -> jax.Array:
    """b [..., K, N] (stored [..., N, K] when `transposed`) laid out for `multiply_panels`: once
    for several products where b is the same (a step's output layer over its chunks)."""
    return native.tile_columns(_operand(b), transposed)


def multiply_panels(a, b_panels, columns: int, a_transposed: bool = False) -> jax.Array:
    """a [..., M, K] (stored [..., K, M] when `a_transposed`) times the b [..., K, N = `columns`]
    of `panels` on the tiles -> [..., M, N] float32."""
    return native.tile_product(_operand(a), b_panels, columns, a_transposed)


def _operand(x):
    """x as the kernel reads it: float32 or bfloat16 as it is, any other dtype in bfloat16."""
    return x if x.dtype in (jnp.float32, jnp.bfloat16) else x.astype(jnp.bfloat16)


def stacked(spec: str) -> tuple[bool, bool] | None:
    """For an einsum of two stacks of matrices ("BKTS,BKSH->BKTH": the same leading letters in
    both operands and the result, one letter contracted, the result's rows from the first and
    columns from the second), whether each operand holds its matrices transposed; else None."""
    operands, result = spec.replace(" ", "").split("->")
    a, b = operands.split(",")
    stack = result[:-2]
    if len(a) != len(result) or len(b) != len(result) or not (a.startswith(stack) and b.startswith(stack)):
        return None
    a, b, result = a[len(stack) :], b[len(stack) :], result[len(stack) :]
    shared = set(a) & set(b)
    if len(shared) != 1 or len(set(a)) != 2 or len(set(b)) != 2:
        return None
    (contracted,) = shared
    if result != a.replace(contracted, "") + b.replace(contracted, ""):
        return None
    return a.index(contracted) == 0, b.index(contracted) == 1
