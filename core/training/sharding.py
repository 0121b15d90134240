"""Device mesh, batch and parameter placement, and multi-host start-up.

The mesh has axes ("data", "fsdp", "tensor"). Batches are split over ("data", "fsdp"), i.e.
over every device; parameters are replicated, or with `train.fsdp > 1` each one is split along
its largest axis that the fsdp size divides. `jax.jit` then inserts the collectives: this is
what `pmap` became (since JAX 0.8 `jax.pmap` is in maintenance mode, since 0.10 a wrapper around
`jax.jit(jax.shard_map)`).

In a multi-process run on CPUs, a collective whose peer process died fails at once on the local
device that talks to the peer (gloo sees the connection closed); `lost_peers` turns that error
into a `LostPeer` message. Another local device of the same process can be waiting for the
failed one in the same collective, for XLA's fixed 30-minute collective timeout, so `wait`
watches every local device. Where no error reaches Python (all local devices wait on live
processes that gave up, or orbax waits at a coordination service barrier), the coordination
service ends the process after `HEARTBEAT_TIMEOUT_S` with a fatal log saying that another task
died; Python cannot catch it (a callback in its place crashes jaxlib 0.10). When process 0, which
hosts the service, dies, the others may get that fatal log at once instead of the message.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from core.errors import LostPeer, UserError

BATCH_AXES = ("data", "fsdp")
# Words of the errors that a lost process causes: a failed gloo collective, or a coordination
# service barrier (orbax waits at some) that failed on the lost process's heartbeat timeout.
PEER_FAILURE_WORDS = ("gloo", "heartbeat timeout")
# Seconds without heartbeats after which the coordination service declares a process dead and
# aborts the others (JAX's default is 100 s).
HEARTBEAT_TIMEOUT_S = 30


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
    jax.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        initialization_timeout=120,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )


def wait(tree) -> None:
    """`jax.block_until_ready(tree)` that raises the first failure of any local device at once,
    rather than waiting on a device that waits in turn for a failed one (see above)."""
    if jax.process_count() == 1:
        jax.block_until_ready(tree)
        return
    arrays = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]  # not host values
    pending = [shard.data for leaf in arrays for shard in leaf.addressable_shards]
    while True:
        for array in pending:
            if array.is_ready():
                array.block_until_ready()  # raises the error of a failed computation
        pending = [array for array in pending if not array.is_ready()]
        if not pending:
            return
        time.sleep(0.002)


@contextlib.contextmanager
def lost_peers(advice: Callable[[], str]) -> Iterator[None]:
    """Turns the error of a collective that lost a peer process into a `LostPeer` ending in `advice()`.

    Only in a multi-process run: elsewhere, and for other runtime errors, the error is raised as is.
    """
    try:
        yield
    # A failed execution raises a JaxRuntimeError; one that fails while it is dispatched (seen
    # in orbax's barrier before a save) raises a ValueError.
    except (jax.errors.JaxRuntimeError, ValueError) as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if jax.process_count() == 1 or not any(word in detail.lower() for word in PEER_FAILURE_WORDS):
            raise
        raise LostPeer(
            f"Process {jax.process_index()} of {jax.process_count()} lost contact with another process of the run, "
            f"which stopped or became unreachable ({detail[:300]}). {advice()}"
        ) from None
