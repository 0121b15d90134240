"""The host allocator settings: repeated executions reuse the pages of the first one."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs a jitted function whose 64 MiB intermediate lives in XLA's temporary arena (blocks over
# 32 MiB are the ones glibc maps afresh), lets the heap settle, then counts the page faults of
# the next ten executions.
PROBE = textwrap.dedent(
    """
    import resource, sys
    if sys.argv[1] == "core":
        import core  # noqa: F401  (tunes the allocator before JAX starts its threads)
    import jax, jax.numpy as jnp
    x, w = jnp.ones((8192, 64)), jnp.ones((64, 2048))
    f = jax.jit(lambda x: jnp.tanh(x @ w) @ w.T)
    for _ in range(40):
        f(x).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        f(x).block_until_ready()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def page_faults(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_repeated_executions_stop_faulting_in_fresh_pages():
    buffer_pages = 8192 * 2048 * 4 // 4096
    plain, tuned = page_faults("plain"), page_faults("core")
    # Without the settings every execution maps its temporaries afresh: a 64 MiB buffer's worth
    # of faults per call. With them the settled heap is reused (it may still grow once or twice).
    assert plain >= 10 * buffer_pages
    assert tuned <= 3 * buffer_pages
