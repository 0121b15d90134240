"""Test set-up: eight simulated CPU devices, set before JAX starts, and strict rank promotion;
the fixtures several test files use. The helpers they share are in tests/helpers.py.

(tests/multiprocess_worker.py sets its own device count: test_multiprocess.py, which it imports,
must not import this module.)
"""

import atexit
import gc
import logging
import os
import shutil
import tempfile

# The suite's programs are small and most run a few times: LLVM's optimizations (level 0 here)
# cost a fifth of a compile-bound file's time (tests/test_generate.py and test_attention.py:
# 141 s, 114 s without) and give nothing back at these sizes.
flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in flags:  # unless the caller chose one
    flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, which the subprocesses the tests start share
# through the environment: a program compiled once (in this process, before a module's caches
# were cleared, or in another process) is loaded the next time, however quickly it compiled.
# Set JAX_COMPILATION_CACHE_DIR to keep the cache from one session to the next.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="apps-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


# `make test` hands whole files to two workers (pytest-xdist, --no-loadscope-reorder) in the
# order collected: the longest first (their minutes in a run of the whole suite), so that no
# worker is still on a long file begun late while the other waits.
LONGEST_FIRST = (
    "test_server.py",
    "test_whisper.py",
    "test_whisper_timestamps.py",
    "test_generate.py",
    "test_multiprocess.py",
    "test_checkpoint.py",
    "test_contract.py",
    "test_encoder_decoder.py",
    "test_seq2seq.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each test module starts without the programs the modules before it compiled: the whole
    suite runs in one process, whose memory would otherwise only grow (CI has 24 GiB)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _kernels_chosen_per_test():
    """Each test starts from the kernels "auto" gives (a run's `model.kernels` is chosen for the
    whole process where its model is built: core.model.kernels.select)."""
    from core.model import kernels

    kernels._chosen = None
    yield
    kernels._chosen = None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama GGUF with SmolLM2's layout and ChatML template (tests/tiny_gguf.py), written once a module."""
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def apps_log(caplog, monkeypatch):
    """`caplog`, listening on the "apps" logger itself from INFO up.

    The CLI stops that logger propagating to the root, where caplog listens; here it never
    propagates, so each record is captured once whether or not a CLI command ran before."""
    logger = logging.getLogger("apps")
    monkeypatch.setattr(logger, "propagate", False)
    caplog.set_level(logging.INFO, logger="apps")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)
