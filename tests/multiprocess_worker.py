"""One process of the two-process test: joins the run, trains a few steps, saves its parameters.

Usage: python tests/multiprocess_worker.py PROCESS_ID PORT FEATURIZER_DIR OUT.npz
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from test_multiprocess import STEPS, train  # noqa: E402

from core.training import sharding  # noqa: E402


def main(process_id: int, port: str, featurizer_dir: str, out: str) -> None:
    sharding.initialize_distributed(f"127.0.0.1:{port}", 2, process_id)
    assert jax.process_count() == 2 and jax.device_count() == 4
    params = train(Path(featurizer_dir), STEPS)
    leaves = [np.asarray(leaf.addressable_data(0)) for leaf in jax.tree.leaves(params)]
    np.savez(out, *leaves)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
