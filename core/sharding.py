"""Device mesh, batch and parameter placement, and multi-host start-up.

The mesh has axes ("data", "fsdp", "tensor"). Batches are split over ("data", "fsdp"), i.e.
over every device; parameters are replicated, or with `train.fsdp > 1` each one is split along
its largest axis that the fsdp size divides. `jax.jit` then inserts the collectives: this is
what `pmap` became (since JAX 0.8 `jax.pmap` is in maintenance mode, since 0.10 a wrapper around
`jax.jit(jax.shard_map)`).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from core.errors import UserError

BATCH_AXES = ("data", "fsdp")


def make_mesh(fsdp: int = 1, devices: list | None = None) -> Mesh:
    """A mesh over `devices` (default: every device of every process)."""
    devices = devices or jax.devices()
    count = len(devices)
    if fsdp < 1 or count % fsdp:
        raise UserError(f"train.fsdp={fsdp} must be a positive divisor of the {count} devices.")
    return jax.make_mesh(
        (count // fsdp, fsdp, 1), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3, devices=devices
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Replicated, or split on "fsdp" along the largest axis that the fsdp size divides."""
    size = mesh.shape["fsdp"]
    if size > 1:
        for axis in np.argsort(shape)[::-1]:
            if shape[axis] % size == 0 and shape[axis] >= size:
                spec = [None] * len(shape)
                spec[axis] = "fsdp"
                return NamedSharding(mesh, P(*spec))
    return replicated(mesh)


def place_params(mesh: Mesh, tree):
    return jax.tree.map(lambda x: jax.device_put(x, param_sharding(mesh, x.shape)), tree)


def global_batch(mesh: Mesh, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Assembles each process's rows of a global batch into one sharded array per key."""
    sharding = batch_sharding(mesh)
    return {key: jax.make_array_from_process_local_data(sharding, value) for key, value in local.items()}


def initialize_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Joins a multi-process run when asked on the command line or by the environment.

    `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` are read when the options
    are absent; with none of them set this is a single-process run and nothing happens. On CPUs
    the processes exchange gradients through gloo collectives.
    """
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator is None and num_processes is None:
        return
    if coordinator is None or num_processes is None or process_id is None:
        raise UserError("A multi-process run needs --coordinator HOST:PORT, --num-processes N and --process-id I.")
    if not 0 <= process_id < num_processes:
        raise UserError(f"--process-id {process_id} must be in [0, {num_processes}).")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=120)
