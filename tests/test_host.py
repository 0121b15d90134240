"""The host allocator settings: repeated executions reuse the pages of the first one, and only
where the suite owns the process (importing `core` or `cli` changes nothing)."""

import os
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
    import cli, core.run  # noqa: F401  (importing the suite leaves malloc alone)
    if sys.argv[1] in ("tuned", "given back"):
        from core.training import host
        host.keep_freed_memory()  # before JAX starts its threads, as the CLI does
        if sys.argv[1] == "given back":  # as core.run.train does for a run too large to keep it
            assert host.give_back_freed_memory() and not host.give_back_freed_memory()
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


def page_faults(mode: str, **environment: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, **environment},
    )
    return int(result.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_repeated_executions_stop_faulting_in_fresh_pages():
    buffer_pages = 8192 * 2048 * 4 // 4096
    # Without the settings every execution maps its temporaries afresh: a 64 MiB buffer's worth
    # of faults per call. With them the settled heap is reused (it may still grow once or twice).
    assert page_faults("imported") >= 10 * buffer_pages
    assert page_faults("tuned") <= 3 * buffer_pages
    assert page_faults("tuned", APPS_KEEP_FREED_MEMORY="0") >= 10 * buffer_pages
    # Given back, large blocks are mapped afresh again.
    assert page_faults("given back") >= 10 * buffer_pages


def test_huge_pages_are_asked_for_once_and_only_where_the_kernel_grants_them_on_request():
    from core.training.host import huge_pages_environment

    assert huge_pages_environment({"A": "1"}, "madvise") == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    other = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert (
        huge_pages_environment(other, "madvise")["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    )
    # Restarted, off, or where asking changes nothing: no (further) restart.
    assert huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "madvise") is None
    assert huge_pages_environment({"APPS_HUGE_PAGES": "0"}, "madvise") is None
    assert huge_pages_environment({}, "always") is None
    assert huge_pages_environment({}, "never") is None
    assert huge_pages_environment({}, None) is None


# A program named `apps` that says which tunables it started with, then tunes its process as the CLI does.
APPS = """
import os
print(os.environ.get("GLIBC_TUNABLES"), flush=True)
from core.training import host
host.tune_process()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables")
def test_the_apps_program_restarts_itself_with_huge_pages(tmp_path):
    from core.training import host

    if host._transparent_huge_pages() != "madvise":
        pytest.skip("the kernel's transparent huge pages are not granted on request here")
    (tmp_path / "apps").write_text(APPS)

    def started_with(**environment: str) -> list[str]:
        environment = {**os.environ, "PYTHONPATH": str(ROOT), **environment}
        environment.pop("GLIBC_TUNABLES", None)
        command = [sys.executable, str(tmp_path / "apps")]
        return subprocess.run(command, capture_output=True, text=True, check=True, env=environment).stdout.split()

    assert started_with() == ["None", "glibc.malloc.hugetlb=1"]
    assert started_with(APPS_HUGE_PAGES="0") == ["None"]


def test_the_host_settings_are_for_the_cpu_alone(tmp_path):
    """An accelerator's process keeps glibc's allocator: JAX_PLATFORMS names the backend where it
    is set, else a TPU's (/dev/accel*, /dev/vfio/N) or an NVIDIA GPU's device files do."""
    from core.training.host import accelerator_present

    assert not accelerator_present({}, tmp_path)
    assert not accelerator_present({"JAX_PLATFORMS": "cpu"}, tmp_path)
    assert accelerator_present({"JAX_PLATFORMS": "tpu,cpu"}, tmp_path)
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "vfio").touch()  # the control file alone: no device
    assert not accelerator_present({}, tmp_path)
    (tmp_path / "vfio" / "0").touch()
    assert accelerator_present({}, tmp_path)
    assert not accelerator_present({"JAX_PLATFORMS": "cpu"}, tmp_path)  # forced to the CPU: tuned
