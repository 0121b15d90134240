"""Bfloat16 products on AMX tiles (`core.model.kernels.native.tile_product`, kernels/cpu/bf16_tiles.cc): the
panels' layout, exact sums where every value is an integer, float32 sums elsewhere, and the
training products (`core.model.precision.matmul`) through them against XLA's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.model import kernels, precision
from core.model.kernels import native
from core.model.kernels import tiles as native_products
from core.training import losses

RNG = np.random.default_rng(0)
needs_tiles = pytest.mark.skipif(not native.tiles_ready(), reason="this CPU has no AMX tiles (or no C++ compiler)")
SHAPES = [
    (1, 1, 1),
    (2, 3, 40),
    (37, 45, 70),
    (64, 64, 64),
    (100, 576, 33),
    (33, 130, 95),
    (64, 4200, 64),
    (40, 2100, 50),
]


def test_the_tiles_run_where_the_cpu_has_them():
    """On a CPU whose flags list AMX's bfloat16 tiles, with a C++ compiler and a Linux that hands
    the tiles out (5.16 and later), the kernel builds and runs: the tests here run, not skip."""
    release = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    if not {"amx_bf16", "amx_tile", "avx512_bf16"} <= kernels._cpu_flags() or not shutil.which("g++"):
        pytest.skip("this CPU has no AMX tiles, or there is no C++ compiler")
    if release < (5, 16):
        pytest.skip(f"Linux {os.uname().release} does not hand out AMX tiles")
    assert native.tiles_ready()


def test_the_kernels_build_for_a_cpu_without_amx():
    """The library holds every kernel: where the CPU lacks AMX (an AVX2 one), the tiles' handlers
    compile to errors that say so, and the int4 and decoding kernels must still build. (The
    first form of the flash kernel named the tiles' types outside their guard, and did not.)"""
    compiler = shutil.which("g++")
    if not compiler:
        pytest.skip("no C++ compiler")
    sources = sorted(str(path) for path in native.KERNELS.glob("*.cc"))
    flags = [*native.compiler_flags("haswell"), "-fsyntax-only"]  # checked, not built: 7 s against 16
    done = subprocess.run([compiler, *flags, *sources], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@needs_tiles
def test_panels_hold_pairs_of_rows_side_by_side_in_columns_of_32():
    """Panel p, row j, lane 2c + t is b[2j + t, 32p + c], zeros beyond b's edges, in bfloat16;
    the same from b stored transposed."""
    b = RNG.standard_normal((45, 70)).astype(np.float32)
    panels = np.asarray(jax.jit(native.tile_columns)(jnp.asarray(b)).astype(jnp.float32))
    assert panels.shape == (3, 32, 64)
    swapped = jax.jit(native.tile_columns, static_argnums=1)(jnp.asarray(b.T), True)
    np.testing.assert_array_equal(np.asarray(swapped.astype(jnp.float32)), panels)
    padded = np.zeros((64, 96), np.float32)
    padded[:45, :70] = np.asarray(jnp.asarray(b).astype(jnp.bfloat16).astype(jnp.float32))
    expected = padded.reshape(32, 2, 3, 32).transpose(2, 0, 3, 1).reshape(3, 32, 64)
    np.testing.assert_array_equal(panels, expected)


def tiled(a, b, a_transposed=False, b_transposed=False):
    """a @ b through the tiles, each operand handed over as stored (a.T, b.T when transposed)."""
    columns = b.shape[1]
    a, b = (a.T if a_transposed else a), (b.T if b_transposed else b)
    call = jax.jit(
        lambda a, b: native.tile_product(a, native.tile_columns(b, b_transposed), columns, a_transposed),
    )
    return np.asarray(call(a, b))


LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]


@needs_tiles
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows,depth,columns", SHAPES)
def test_integers_multiply_exactly_after_rounding_to_nearest(rows, depth, columns, dtype, layout):
    """Integers in [-8, 8] moved by 2^-10, which bfloat16 (a step of 2^-5 at 4 to 8) rounds back
    to the integer: the sums of their products are integers below 2^24, exact in float32, so the
    kernel gives them exactly, from float32 operands (rounded in the kernel) and bfloat16 ones
    (rounded on the way in), each stored as it is or transposed. Truncating instead of rounding
    would give 3.96875 for 3.999."""
    a = RNG.integers(-8, 9, (rows, depth)).astype(np.float32)
    b = RNG.integers(-8, 9, (depth, columns)).astype(np.float32)
    moved = a + np.where(np.abs(a) >= 4, RNG.choice([-1.0, 1.0], a.shape) * 2.0**-10, 0).astype(np.float32)
    got = tiled(jnp.asarray(moved, dtype), jnp.asarray(b, dtype), *layout)
    np.testing.assert_array_equal(got, a.astype(np.float64) @ b.astype(np.float64))


@needs_tiles
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows,depth,columns", SHAPES)
def test_sums_are_float32_sums_of_exact_bfloat16_products(rows, depth, columns, layout):
    """Random floats: within float32's rounding of a sum of `depth` terms of the float64 product
    of the bfloat16-rounded operands."""
    a = RNG.standard_normal((rows, depth)).astype(np.float32)
    b = RNG.standard_normal((depth, columns)).astype(np.float32)
    got = tiled(jnp.asarray(a), jnp.asarray(b), *layout)
    ra, rb = (np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64) for x in (a, b))
    bound = depth * 2.0**-24 * (np.abs(ra) @ np.abs(rb)) + 1e-30
    assert np.all(np.abs(got - ra @ rb) <= bound)


def _step(x, w):
    def loss(x, w):
        with precision.products_in("bfloat16"):
            y = precision.matmul(x, w)
            return (jnp.tanh(y) @ jnp.arange(y.shape[-1], dtype=y.dtype)).sum()

    return jax.value_and_grad(loss, argnums=(0, 1))(x, w)


@needs_tiles
def test_training_products_through_tiles_match_xla(monkeypatch):
    """A linear layer's loss and both gradients under bfloat16 products: the tiles' route equals
    XLA's to float32's rounding of the sums (each product of two bfloat16 is exact in both)."""
    x = jnp.asarray(RNG.standard_normal((3, 50, 96)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((96, 80)) * 0.1, jnp.float32)
    plain = jax.jit(_step)(x, w)
    monkeypatch.setattr(native_products, "here", lambda: True)
    tiles = jax.jit(lambda x, w: _step(x, w))  # a new function: jit's cache holds XLA's trace of _step
    assert tiles.lower(x, w).as_text().count("apps_tile_product") == 3  # forward, both gradients
    tiled = tiles(x, w)
    for got, want in zip(jax.tree.leaves(tiled), jax.tree.leaves(plain)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * np.abs(want).max())


def _output_layer(hidden, weight, targets, weights):
    def loss(hidden, weight):
        with precision.products_in("bfloat16"):
            return losses.linear_cross_entropy(hidden, weight, targets, weights, chunk=48)[0]

    return jax.value_and_grad(loss, argnums=(0, 1))(hidden, weight)


@needs_tiles
def test_the_output_layer_through_tiles_matches_xla(monkeypatch):
    """The fused cross-entropy's three products (logits, the hidden's and the weight's gradients)
    on the tiles, from the weight's panels laid out once for all chunks: XLA's loss and gradients
    to float32's rounding of the sums, over chunks of 48 rows of which the last is part padding
    and one counts nothing."""
    hidden = jnp.asarray(RNG.standard_normal((2, 60, 64)), jnp.float32)
    weight = jnp.asarray(RNG.standard_normal((300, 64)) * 0.1, jnp.float32)
    targets = jnp.asarray(RNG.integers(0, 300, (2, 60)))
    weights = jnp.ones((2, 60)).at[1, 20:].set(0)  # 80 counted positions: chunks of 48, 32 and none
    plain = jax.jit(_output_layer)(hidden, weight, targets, weights)
    monkeypatch.setattr(native_products, "here", lambda: True)
    tiles = jax.jit(lambda *args: _output_layer(*args))
    text = tiles.lower(hidden, weight, targets, weights).as_text()
    # The weight read both ways (once, before the loop over chunks), a chunk's g; three products a chunk.
    assert text.count("apps_tile_columns") == 3 and text.count("apps_tile_product") == 3
    for got, want in zip(jax.tree.leaves(tiles(hidden, weight, targets, weights)), jax.tree.leaves(plain)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_several_devices_keep_xla_products():
    """With several devices (the suite's eight) the products stay XLA's, which it splits across
    them: an FFI call would gather its operands whole to every device."""
    assert jax.device_count() > 1 and not native_products.here()
    x, w = jnp.ones((64, 96)), jnp.ones((96, 80))
    assert "apps_tile" not in jax.jit(_step).lower(x, w).as_text()


@pytest.mark.parametrize(
    "spec,layout",
    [
        ("BKTS,BKSH->BKTH", (False, False)),
        ("BKTH,BKSH->BKTS", (False, True)),
        ("BKTS,BKTH->BKSH", (True, False)),
        ("ST,HS->TH", (True, True)),
        ("BTD,VD->BTV", None),  # the stacks differ
        ("BKTS,BKSH->BKHT", None),  # the result's columns first
        ("BKTH,BKTH->BKT", None),  # no matrices
    ],
)
def test_einsums_read_as_stacks_of_matrix_products(spec, layout):
    """Which einsums are stacks of matrix products, and how each operand holds its matrices."""
    assert native_products.stacked(spec) == layout


@needs_tiles
def test_attention_products_through_tiles_match_xla(monkeypatch):
    """The blockwise attention's four kinds of product, as `einsum_product` runs them under
    bfloat16 products: the tiles' route gives XLA's to float32's rounding."""
    q, k, g = (jnp.asarray(RNG.standard_normal((2, 3, n, 64)), jnp.float32) for n in (96, 128, 96))
    p = jnp.asarray(RNG.random((2, 3, 96, 128)), jnp.float32)

    def products(q, k, g, p):
        with precision.products_in("bfloat16"):
            return [
                precision.einsum_product("BKTH,BKSH->BKTS", q, k),
                precision.einsum_product("BKTS,BKSH->BKTH", p, k),
                precision.einsum_product("BKTS,BKTH->BKSH", p, g),
            ]

    plain = jax.jit(products)(q, k, g, p)
    monkeypatch.setattr(native_products, "here", lambda: True)
    tiles = jax.jit(lambda *x: products(*x))
    assert tiles.lower(q, k, g, p).as_text().count("apps_tile_product") == 3
    for got, want in zip(tiles(q, k, g, p), plain):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.abs(want).max())
