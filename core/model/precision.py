"""Mixed precision: the dtype each product runs in, and products that keep float32 sums.

`products_in(dtype)` sets, while a function is traced, the dtype that the core's products run
in where it is narrower than their operands (`train.matmul_dtype`; "auto" is `fastest_products`);
`narrower` reads it;
`product`, `einsum_product` and `matmul` multiply in it with float32 sums (a layer's bfloat16
products on AMX's tiles where the seam chose them, `core.model.kernels`); `transposed` lays an
operand out so that XLA:CPU multiplies it in that dtype; `narrowed` gives decoding weights in a
narrower dtype. The model's layers (`core.model.transformer`, `core.model.attention`) and the
training losses import it; it imports `core.model.quantized` and the seam alone of the core.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from core.model import kernels, quantized


def product(a: jax.Array, b: jax.Array, dtype, a_transposed: bool = False, b_transposed: bool = False) -> jax.Array:
    """a [..., I] @ b [I, O] multiplied in `dtype`: in float32 (or wider) as it stands; in a
    narrower float (bfloat16) with both operands in it, the sums in float32 and a float32 result.
    `a_transposed`: a is a matrix stored [I, M], multiplied as its transpose (a weight's gradient,
    x^T g); `b_transposed`: b is stored [O, I] (an input's gradient, g W^T).

    A bfloat16 product of a layer's size goes to AMX's tiles where the seam says so
    (`core.model.kernels.tiled`), which read either operand as stored. On XLA:CPU, bfloat16
    products with a float32 result run through YNNPACK, while a bfloat16 result, or weights
    converted up to float32 before a float32 product, run several times slower; with a single
    row XLA:CPU takes a slow path, so one row is multiplied as two.
    """
    narrow = jnp.dtype(dtype).itemsize < 4
    rows, depth = a.shape[::-1] if a_transposed else (math.prod(a.shape[:-1]), a.shape[-1])
    columns = b.shape[0] if b_transposed else b.shape[1]
    if kernels.tiled(dtype, rows, depth, columns):
        flat = a if a_transposed else a.reshape(rows, depth)
        result = kernels.tile_multiply(flat, b, columns, a_transposed, b_transposed)
        return result if a_transposed else result.reshape(*a.shape[:-1], columns)
    a = transposed(a, dtype) if a_transposed else a
    b = b.T if b_transposed else b
    if not narrow:
        return a @ b
    a, b = a.astype(dtype), b.astype(dtype)
    if rows > 1 or not kernels.cpu_layouts():
        return jnp.matmul(a, b, preferred_element_type=jnp.float32)
    padded = jnp.zeros((2, a.shape[-1]), dtype).at[0].set(a.reshape(-1))
    return jnp.matmul(padded, b, preferred_element_type=jnp.float32)[0].reshape(*a.shape[:-1], b.shape[-1])


def transposed(a: jax.Array, dtype, axes: tuple[int, ...] | None = None) -> jax.Array:
    """a [M, N] -> a.T [N, M] (or `a.transpose(axes)`), as an operand of a `product` in `dtype`.

    In a narrower float on XLA:CPU, the transpose is copied (in `dtype`) so that its rows lie in
    order in memory. XLA runs a bfloat16 product through YNNPACK only when its operands are laid
    out so; else it converts both to float32 and multiplies there, about 3 times slower. A plain
    transpose XLA folds into the product's dimensions or into a layout, so the copy goes through
    a barrier, flattened: a flat array has one layout. Other backends read a transposed operand
    as it stands.
    """
    if jnp.dtype(dtype).itemsize >= 4 or not kernels.cpu_layouts():
        return a.transpose(axes)
    swapped = a.astype(dtype).transpose(axes)
    return jax.lax.optimization_barrier(swapped.reshape(-1)).reshape(swapped.shape)


def chosen_products(dtype: str | None) -> str:
    """`train.matmul_dtype` as products run in: "auto" and None resolved by the seam
    (`core.model.kernels.fastest_products`, `default_products`), the others as they are."""
    if dtype is None:
        return kernels.default_products()
    return kernels.fastest_products() if dtype == "auto" else dtype


# The dtype that products run in where it is narrower than their operands (`products_in`).
_PRODUCTS: contextvars.ContextVar = contextvars.ContextVar("products", default="float32")


@contextlib.contextmanager
def products_in(dtype):
    """Within it, the core's products (`matmul`, the blockwise attention's in `core.model.attention`,
    and the output layer's in `core.training.losses`; not a classifier head's small ones) run in
    `dtype` where that is narrower than their operands: "bfloat16" gives float32 training bfloat16
    products with float32 sums and results (mixed precision; `train.matmul_dtype`); "auto" the
    faster of the two here (`core.model.kernels.fastest_products`). Read when a function is traced, as
    `jax.default_matmul_precision` is: enter it inside the jitted step."""
    token = _PRODUCTS.set(chosen_products(dtype))
    try:
        yield
    finally:
        _PRODUCTS.reset(token)


def narrower(*dtypes) -> jnp.dtype:
    """The float of fewest bytes among `dtypes` and that of `products_in`: the dtype a product of
    such operands runs in."""
    return min((jnp.dtype(d) for d in (*dtypes, _PRODUCTS.get())), key=lambda d: d.itemsize)


def matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., I] @ kernel [I, O] -> x's dtype, multiplied in the dtype of fewer bytes of the
    two and of `products_in` (`product`: bfloat16 weights with float32 activations multiply in
    bfloat16), with a weight gradient that transposes the narrower operand (in shape). An int8 or
    int4 kernel (decoding weights, `narrowed`) multiplies through `core.model.quantized`."""
    if isinstance(kernel, quantized.WEIGHTS):
        return quantized.product(x, kernel)
    return _matmul(x, kernel, narrower(x.dtype, kernel.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, kernel: jax.Array, dtype) -> jax.Array:
    """`matmul` in `dtype`. The weight gradient x^T @ g contracts over tokens; XLA on CPU hands
    its matmul one operand transposed in memory, and by default picks g, fusing that strided
    write into whatever produced g (the GELU backward, for one). Written as (g^T @ x)^T when
    O > I, the copy falls on x, the narrower of the two, and the producer of g writes in order.
    Both gradients come out of float32 sums in their operand's dtype: float32 weights trained
    with bfloat16 products get their gradient unrounded."""
    return product(x, kernel, dtype).astype(x.dtype)


def _matmul_forward(x, kernel, dtype):
    return _matmul(x, kernel, dtype), (x, kernel)


def _matmul_backward(dtype, residuals, g):
    x, kernel = residuals
    inputs, outputs = kernel.shape
    flat_x, flat_g = x.reshape(-1, inputs), g.reshape(-1, outputs)
    if outputs > inputs and jnp.dtype(dtype).itemsize >= 4:
        grad_kernel = product(flat_g.T, flat_x, dtype).T
    else:
        grad_kernel = product(flat_x, flat_g, dtype, a_transposed=True)
    return product(g, kernel, dtype, b_transposed=True).astype(x.dtype), grad_kernel.astype(kernel.dtype)


_matmul.defvjp(_matmul_forward, _matmul_backward)


def einsum_product(spec: str, a, b):
    """jnp.einsum(spec, a, b) with float32 results, multiplied in the narrower dtype of the
    operands and of `core.model.precision.products_in`. A stack of matrix products (the
    blockwise attention's) goes to AMX's tiles where the seam says so."""
    dtype = narrower(a.dtype, b.dtype)
    layout = kernels.stacked(spec)
    if layout is not None and a.shape[:-2] == b.shape[:-2]:
        a_transposed, b_transposed = layout
        rows, depth = a.shape[-2:][::-1] if a_transposed else a.shape[-2:]
        columns = b.shape[-2] if b_transposed else b.shape[-1]
        if kernels.tiled(dtype, rows, depth, columns):
            return kernels.tile_multiply(a, b, columns, a_transposed, b_transposed)
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def narrowed(params: Any, dtype: str) -> Any:
    """Decoding weights: every linear layer's kernel of `params` (an nnx state) in `dtype`, the
    rest (embeddings, norms, biases) as they are, so that the activations stay in float32. With
    "bfloat16" each product multiplies in bfloat16 with float32 sums (`core.model.precision.product`),
    about 1.5x faster than float32 at 2-16 rows on XLA:CPU. The cache stays in float32: XLA:CPU
    scatters a bfloat16 one by converting all of it to float32 and back, at every step. With
    "int8" the core's linear layers' kernels and the token table that a tied output shares
    become int8 with a scale per output (`core.model.quantized`); Flax's own layers keep float32.
    With "int4" those kernels take four bits a weight instead (`core.model.int4`), the table
    int8."""
    if dtype == "float32":
        return params
    if dtype in ("int8", "int4"):
        kernels.check_weights(dtype)
        is_variable = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
        if not any(isinstance(v, quantized.LinearKernel) for v in jax.tree.leaves(params, is_leaf=is_variable)):
            raise ValueError(
                f"{dtype} weights come from an nnx state (nnx.split), whose variables mark the linear kernels."
            )
        return jax.tree.map(lambda v: quantized.quantized(v, dtype), params, is_leaf=is_variable)

    def cast(path, leaf):
        return leaf.astype(dtype) if any(getattr(key, "key", None) == "kernel" for key in path) else leaf

    return jax.tree_util.tree_map_with_path(cast, params)
