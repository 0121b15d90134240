"""Batching of featurized arrays: shuffled training batches addressed by step, padded
evaluation batches, each process's share of a global batch, and prefetch to device.

The training order is a pure function of (seed, step): epoch e uses permutation seed+e, and
step s reads rows [s * B, (s + 1) * B) of the concatenated epochs, with the ragged tail of
each epoch dropped. The data-iterator position saved in a checkpoint is therefore the step,
and a resumed run sees exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np

from core.errors import UserError
from core.model.shapes import bucket_width

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
    trim: dict[str, tuple[str, ...]] | None = None,
    cut: bool = True,
) -> Iterator[Arrays]:
    """Global training batches from `start_step` on, forever, as this process's rows.

    `augment` (a task's random masking or negative sampling) sees each whole global batch with
    a generator seeded by (seed, step), so it too is reproduced exactly on resume.

    `trim` ({mask key: the keys whose second axis that mask measures}, a task's `trim`) groups
    rows of similar lengths into batches and cuts each batch to its longest row, rounded up to
    a `bucket_width` so that few shapes compile: short pairs then cost what they hold, not the
    featurizer's full width; with `cut` False the batches keep that width (steps run several to
    a call stack batches of one shape).
    """
    total = size(arrays)
    per_epoch = total // batch_size
    if per_epoch == 0:
        examples = f"{total} example{'s' if total != 1 else ''}"
        raise UserError(f"The training split has {examples}, fewer than one batch of {batch_size}.")
    lengths = sum(arrays[key].sum(1) for key in trim) if trim else None
    step, epoch, order = start_step, None, None
    while True:
        if step // per_epoch != epoch:
            epoch = step // per_epoch
            order = epoch_order(total, batch_size, np.random.default_rng(seed + epoch), lengths)
        rows = np.sort(order[step % per_epoch])
        batch = take(arrays, rows)
        if trim and cut:
            batch = trimmed(batch, trim)
        if augment is not None:
            batch = augment(batch, np.random.default_rng((seed, step)))
        yield process_rows(batch)
        step += 1


# Rows are sorted by length within windows of this many batches, then the batches are
# shuffled: batches of similar lengths, in a random order ("sortish" sampling).
SORT_WINDOW = 64


def decoding_batches(lengths: Sequence[int], batch_size: int, cap: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Batches for decoding rows of many lengths in few compiled shapes: the rows sorted by length
    (stably), `batch_size` at a time, as (the rows, the rows padded to `batch_size` with copies of
    the first, so that every batch has one shape, and the `bucket_width` of the longest)."""
    lengths = np.asarray(lengths)
    order = np.argsort(lengths, kind="stable")
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        padded = np.concatenate([rows, np.repeat(rows[:1], batch_size - len(rows))])
        yield rows, padded, bucket_width(int(lengths[rows].max()), cap)


def epoch_order(total: int, batch_size: int, rng: np.random.Generator, lengths: np.ndarray | None) -> np.ndarray:
    """The rows of each batch of one epoch [batches, B]: a permutation with the ragged tail
    dropped, or with `lengths`, rows of similar lengths together and the batches shuffled."""
    per_epoch = total // batch_size
    order = rng.permutation(total)[: per_epoch * batch_size]
    if lengths is None:
        return order.reshape(per_epoch, batch_size)
    window = SORT_WINDOW * batch_size
    order = np.concatenate(
        [part[np.argsort(lengths[part], kind="stable")] for part in np.split(order, range(window, len(order), window))]
    )
    return order.reshape(per_epoch, batch_size)[rng.permutation(per_epoch)]


def trimmed(batch: Arrays, trim: dict[str, tuple[str, ...]]) -> Arrays:
    """`batch` with each mask of `trim` and the arrays it measures cut to the longest row (rows
    are real on the left), rounded up to its `bucket_width`."""
    batch = dict(batch)
    for mask_key, keys in trim.items():
        mask = batch[mask_key]
        keep = bucket_width(int(mask.sum(1).max()), mask.shape[1])
        for key in (mask_key, *keys):
            batch[key] = batch[key][:, :keep]
    return batch


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
