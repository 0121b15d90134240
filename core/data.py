"""Batching of featurized arrays: shuffled training batches addressed by step, padded
evaluation batches, each process's share of a global batch, and prefetch to device.

The training order is a pure function of (seed, step): epoch e uses permutation seed+e, and
step s reads rows [s * B, (s + 1) * B) of the concatenated epochs, with the ragged tail of
each epoch dropped. The data-iterator position saved in a checkpoint is therefore the step,
and a resumed run sees exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

import jax
import numpy as np

from core.errors import UserError

Arrays = dict[str, np.ndarray]


def size(arrays: Arrays) -> int:
    return len(next(iter(arrays.values())))


def take(arrays: Arrays, rows) -> Arrays:
    return {key: value[rows] for key, value in arrays.items()}


def process_rows(batch: Arrays) -> Arrays:
    """This process's contiguous share of a global batch (all of it in a one-process run)."""
    per_process = size(batch) // jax.process_count()
    start = jax.process_index() * per_process
    return take(batch, slice(start, start + per_process))


def check_batch_size(batch_size: int, what: str, multiple: int = 1) -> None:
    devices = jax.device_count() * multiple
    if batch_size < devices or batch_size % devices:
        raise UserError(
            f"{what}={batch_size} must be a positive multiple of {devices} "
            f"(the {jax.device_count()} devices{' x grad_accum' if multiple > 1 else ''})."
        )


def train_batches(
    arrays: Arrays,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    augment: Callable[[Arrays, np.random.Generator], Arrays] | None = None,
) -> Iterator[Arrays]:
    """Global training batches from `start_step` on, forever, as this process's rows.

    `augment` (a task's random masking or negative sampling) sees each whole global batch with
    a generator seeded by (seed, step), so it too is reproduced exactly on resume.
    """
    total = size(arrays)
    per_epoch = total // batch_size
    if per_epoch == 0:
        raise UserError(f"The training split has {total} examples, fewer than one batch of {batch_size}.")
    step = start_step
    while True:
        epoch, index = divmod(step, per_epoch)
        order = np.random.default_rng(seed + epoch).permutation(total)
        rows = np.sort(order[index * batch_size : (index + 1) * batch_size])
        batch = take(arrays, rows)
        if augment is not None:
            batch = augment(batch, np.random.default_rng((seed, step)))
        yield process_rows(batch)
        step += 1


def eval_batches(arrays: Arrays, batch_size: int) -> Iterator[Arrays]:
    """The split in order; the last batch is padded with zero-weight copies of row 0."""
    total = size(arrays)
    for start in range(0, total, batch_size):
        rows = np.arange(start, start + batch_size)
        batch = take(arrays, np.where(rows < total, rows, 0))
        batch["weights"] = batch["weights"] * (rows < total)
        yield process_rows(batch)


def prefetch(batches: Iterator[Arrays], place: Callable[[Arrays], dict], depth: int = 2) -> Iterator[dict]:
    """Keeps `depth` batches in flight to the devices while the current one computes."""
    queue = collections.deque()
    for batch in batches:
        queue.append(place(batch))
        if len(queue) > depth:
            yield queue.popleft()
    while queue:
        yield queue.popleft()
