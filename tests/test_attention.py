"""The blockwise attention kernel equals `jax.nn.dot_product_attention`, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.attention import attention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [40, 96, 300])
def test_blockwise_matches_xla(causal, length):
    rng = np.random.default_rng(length)
    q, k, v, cotangent = (jnp.asarray(rng.standard_normal((2, length, 3, 8), np.float32)) for _ in range(4))
    # The second sequence is padded after 70% of its length.
    mask = jnp.asarray(np.arange(length)[None, :] < np.array([[length], [int(length * 0.7)]]))

    def loss(implementation):
        def f(q, k, v):
            out = attention(q, k, v, mask, causal=causal, implementation=implementation)
            # Only real query rows count: padded rows are free to differ.
            return (out * cotangent * mask[:, :, None, None]).sum()

        return f

    for a, b in zip(
        jax.value_and_grad(loss("blockwise"), (0, 1, 2))(q, k, v),
        jax.value_and_grad(loss("xla"), (0, 1, 2))(q, k, v),
    ):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(x, y, atol=2e-5, rtol=1e-4)
