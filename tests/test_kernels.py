"""The kernel seam (`core.model.kernels`): what each choice gives on each backend, refusals with
their reasons, splash attention (Pallas interpreted on the CPU, compiled on a TPU) against XLA's,
and the scanned stack of layers against the unrolled one.

Tests marked `tpu` need the chip and skip elsewhere; run them there in one process:
`JAX_PLATFORMS=tpu python -m pytest -m tpu -p no:xdist tests/test_kernels.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.config import ModelConfig
from core.errors import UserError
from core.model import kernels, precision
from core.model.kernels import splash
from core.model.transformer import Transformer

on_tpu = pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU")


def test_auto_is_native_on_the_cpu_pallas_on_a_tpu_and_xla_elsewhere():
    assert kernels.resolve("auto", "cpu") == kernels.Kernels("native", "cpu")
    assert kernels.resolve("auto", "cpu", native_ready=False) == kernels.Kernels("xla", "cpu")
    assert kernels.resolve("auto", "tpu") == kernels.Kernels("pallas", "tpu")
    assert kernels.resolve("auto", "gpu") == kernels.Kernels("xla", "gpu")
    assert kernels.resolve("xla", "tpu").scan_layers and not kernels.resolve("native", "cpu").scan_layers
    assert kernels.resolve("pallas", "cpu").interpret and not kernels.resolve("pallas", "tpu").interpret


@pytest.mark.parametrize(
    "requested,platform,reason",
    [
        ("native", "tpu", "our C\\+\\+ kernels run on the CPU backend only, and this process runs on tpu"),
        ("pallas", "gpu", "the Pallas kernels here are TPU kernels; on gpu use xla"),
        ("cuda", "cpu", "choose one of auto, xla, native, pallas"),
    ],
)
def test_a_choice_that_cannot_run_here_is_refused_with_the_reason(requested, platform, reason):
    with pytest.raises(UserError, match=reason):
        kernels.resolve(requested, platform)


def test_the_choice_is_said_once_and_int4_is_refused_without_its_kernel(apps_log):
    apps_log.set_level("DEBUG", logger="apps")
    with kernels.using("xla"):
        kernels.select("xla")
        lines = [r.message for r in apps_log.records if r.message.startswith("kernels:")]
        assert lines == ["kernels: xla on cpu; attention XLA's, layers scanned"]
        with pytest.raises(UserError, match="int4 weights multiply through our CPU kernel alone"):
            kernels.check_weights("int4")
        kernels.check_weights("int8")  # XLA's int8 products: taken
        assert kernels.compiler_options() == kernels.CPU_COMPILER_OPTIONS  # XLA:CPU's, on the CPU


def test_products_default_to_bfloat16_on_an_accelerator_and_float32_on_a_cpu():
    assert precision.chosen_products(None) == "float32"
    with kernels.using("pallas"):  # still the CPU: the platform decides, not the kernels
        assert precision.chosen_products(None) == "float32"
    kernels_tpu = kernels.Kernels("pallas", "tpu")
    previous, kernels._chosen = kernels._chosen, kernels_tpu
    try:
        assert precision.chosen_products(None) == "bfloat16" and kernels.fastest_products() == "bfloat16"
        assert kernels.compiler_options() == kernels.CPU_COMPILER_OPTIONS  # read off the process's backend
    finally:
        kernels._chosen = previous


def _operands(B=2, T=200, S=None, N=4, K=2, H=32, seed=0):
    rng = np.random.default_rng(seed)
    S = S or T
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32) for _ in range(2))
    mask = jnp.arange(S)[None] < jnp.asarray([[S], [S * 3 // 4]])
    return q, k, v, mask


def _xla(q, k, v, mask, causal, window, segments, cross):
    from core.model.attention import attention

    with kernels.using("xla"):
        return attention(
            q, k, v, mask, causal=causal, implementation="xla", window=window, segments=segments, cross=cross
        )


CASES = {
    "causal": (True, None, False, False),
    "sliding window": (True, 16, False, False),
    "bidirectional": (False, None, False, False),
    "packed rows": (True, None, True, False),
    "cross": (False, None, False, True),
}


@pytest.mark.parametrize("case", CASES)
def test_splash_interpreted_gives_xlas_attention_and_gradients(case):
    """At the real positions: outputs and the gradients of q, k and v to float32 rounding, with
    lengths (200) that are no whole block, a key head shared by two query heads, padding, a
    sliding window, two examples packed in each row, and cross-attention over other keys."""
    causal, window, packed, cross = CASES[case]
    q, k, v, mask = _operands(S=136 if cross else None)
    segments = jnp.where(jnp.arange(200)[None] < 90, 1, 2) * jnp.ones((2, 1), jnp.int32) if packed else None
    real = (jnp.ones((2, 200), bool) if cross else mask)[:, :, None, None]

    def splash_attention(q, k, v):
        return splash.attention(q, k, v, mask, causal, jnp.float32, window, segments, cross, interpret=True)

    def xla_attention(q, k, v):
        return _xla(q, k, v, mask, causal, window, segments, cross)

    results = []
    for function in (splash_attention, xla_attention):
        out, pullback = jax.vjp(function, q, k, v)
        results.append((jnp.where(real, out, 0), *pullback(jnp.where(real, out, 0))))
    for got, expected in zip(*results):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-5)


def test_splash_pads_to_whole_blocks_and_takes_the_largest_that_divides():
    assert [splash.whole(n) for n in (1, 128, 129, 2048)] == [128, 128, 256, 2048]
    assert [splash.block(n) for n in (128, 256, 384, 1024, 1536)] == [128, 256, 128, 512, 512]


def _stack(remat=False):
    config = ModelConfig(
        d_model=32, num_layers=6, num_heads=4, num_kv_heads=2, mlp_dim=64, causal=True, positions="rotary",
        sliding_window=8, global_every=3, dropout=0.1,
    )  # fmt: skip
    return Transformer(config, remat=remat, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("remat", [False, True])
def test_the_scanned_stack_gives_the_unrolled_ones_outputs_and_gradients(remat):
    """Gemma 3's pattern (two sliding layers, one global) scans as groups of three; dropout
    draws each block's own key as the unrolled loop does."""
    body = _stack(remat)
    assert body.period() == 3
    graphdef, state = nnx.split(body)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 24, 32)), jnp.float32)
    mask = jnp.arange(24)[None] < jnp.asarray([[24], [17]])

    def loss(state):
        hidden = nnx.merge(graphdef, state)(x, mask, dropout_key=jax.random.key(1))
        return (jnp.where(mask[..., None], hidden, 0) ** 2).sum()

    results, products = {}, {}
    for name in ("native", "xla"):  # unrolled, scanned
        with kernels.using(name):
            results[name] = jax.jit(jax.value_and_grad(loss))(state)
            products[name] = jax.jit(lambda state: loss(state)).lower(state).as_text().count("dot_general")
    assert products["xla"] * 2 == products["native"]  # one group of three layers traced, not six
    for got, expected in zip(jax.tree.leaves(results["xla"]), jax.tree.leaves(results["native"])):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


@on_tpu
@pytest.mark.tpu
@pytest.mark.parametrize("case", CASES)
def test_splash_on_the_chip_gives_xlas_attention(case):
    """Compiled by Mosaic, in bfloat16 as the training step runs it: within bfloat16's rounding."""
    causal, window, packed, cross = CASES[case]
    q, k, v, mask = _operands(T=1024, S=512 if cross else None, H=64)
    segments = jnp.where(jnp.arange(1024)[None] < 400, 1, 2) * jnp.ones((2, 1), jnp.int32) if packed else None
    real = (jnp.ones((2, 1024), bool) if cross else mask)[:, :, None, None]
    got = jax.jit(lambda q, k, v: splash.attention(q, k, v, mask, causal, jnp.bfloat16, window, segments, cross))
    expected = _xla(q, k, v, mask, causal, window, segments, cross)
    np.testing.assert_allclose(jnp.where(real, got(q, k, v), 0), jnp.where(real, expected, 0), atol=3e-2)


def test_a_longer_run_compiles_no_more_programs_than_a_short_one(tmp_path):
    """After warm-up nothing compiles again: a run of 8 steps with 4 evaluations and checkpoints
    compiles as many programs as one of 2 steps with one of each (both from empty caches, the
    persistent one off), with the accelerator's path (XLA's kernels, layers scanned)."""
    import tasks
    from core import run

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compiled = []

    def listen(name, seconds, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiled.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    counts = []
    try:
        for steps in (2, 8):
            compiled.clear()
            jax.clear_caches()
            options = [f"train.steps={steps}", "train.eval_every=2", "train.checkpoint_every=2", "model.kernels=xla"]
            run.train(
                tasks.get("lm"), workdir=tmp_path / str(steps), preset="tiny", overrides=options, data="synthetic"
            )
            counts.append(len(compiled))
    finally:
        jax._src.monitoring.unregister_event_duration_listener(listen)
        jax.config.update("jax_enable_compilation_cache", enabled)
    assert counts[0] == counts[1] > 0


def test_splash_over_eight_devices_trains_as_xlas_attention(monkeypatch):
    """Within the training step's mesh of the suite's eight devices, splash (interpreted) maps
    itself over the batch axes, each device on its own rows: the losses of XLA's attention."""
    from itertools import islice

    from core.config import apply_overrides
    from core.training import sharding
    from core.training.data import train_batches
    from core.training.steps import build_model, make_steps
    from tasks.nlp.sentiment import SentimentTask, tiny

    calls = []
    traced = kernels.splash_attention
    monkeypatch.setattr(kernels, "splash_attention", lambda *a, **k: calls.append(1) or traced(*a, **k))
    losses = {}
    for name in ("pallas", "xla"):
        config = apply_overrides(tiny(), ["model.dropout=0.0", f"model.kernels={name}"])
        task = SentimentTask(config=config, data="synthetic")
        examples = task.examples("train")
        featurizer = task.fit_featurizer(examples)
        compiled = make_steps(task, build_model(task, featurizer, config), config, 3)
        state, losses[name] = compiled.state, []
        for local in islice(train_batches(featurizer(examples), config.train.batch_size, 0), 3):
            state, logs = compiled.train_step(state, sharding.global_batch(compiled.mesh, local))
            losses[name].append(float(logs["loss"]))
    assert jax.device_count() == 8 and calls  # splash ran, over the eight devices
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=1e-5)
