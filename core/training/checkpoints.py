"""Orbax checkpoints of a run, the workdir's small JSON files, and its writer lock.

A workdir holds `config.json`, `data.json` (what it was trained on: `core.run`), `train.lock`
(`writer_lock`), `featurizer/`, `checkpoints/` (the latest two training states, for resuming),
`best/` (the parameters alone of the best validation step, for eval and predict) and
`metrics.jsonl`. Each checkpoint has the items
`params` and, in `checkpoints/`, `training` (optimizer state and step), so that eval and
predict read parameters only. A training attempt that fails before its first step leaves the
workdir as it found it (`undone_on_failure`).

Saves are synchronous and orbax writes each one to a temporary folder that it renames when
complete, so a killed run leaves its last completed checkpoint intact. A checkpoint that
cannot be read all the same (files truncated or lost afterwards) is skipped with a warning and
the one before it is used; in a run that trains, it is moved aside to `corrupt/` so that the
step can be saved again.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from core.errors import UserError

log = logging.getLogger("apps")
LOCK = "train.lock"


class _Notices(logging.Filter):
    """Drops orbax's notices that a manager opened read-only (for eval and predict) is read-only,
    that an item read on its own (`read_params`) has no step metadata beside it, and that the
    array handler below replaces its default."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(
            ("Given directory is read only", "Metadata file does not exist", "Type handler registry type")
        )


logging.getLogger("absl").addFilter(_Notices())

# Replicated arrays are written whole from their first replica. Orbax's default on CPU splits
# each one across its replicas, slicing it eagerly on every device: a compiled program per
# array, device and shape (576 for a tiny speech run on 8 devices, 3.3 s of its 4 s of saving),
# to spread writes that here all come from one host's memory anyway.
ocp.type_handlers.register_type_handler(
    jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
)


def _manager(directory: Path, keep: int, read_only: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep,
        save_interval_steps=0 if read_only else 1,
        create=not read_only,
        enable_async_checkpointing=False,
        read_only=read_only,
    )
    return ocp.CheckpointManager(directory.absolute(), options=options)


def _abstract(tree: Any) -> Any:
    """Shapes, dtypes and shardings of `tree` (arrays or ShapeDtypeStructs), for restoring into."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


@dataclass(frozen=True)
class Restored:
    """What was read, and from where (for the user: `best/ step 40`)."""

    value: Any
    step: int
    source: str

    @property
    def where(self) -> str:
        return f"{self.source}/ step {self.step}"


class Checkpoints:
    """The latest training states and the best parameters of one workdir."""

    def __init__(self, workdir: Path, read_only: bool = False):
        self.workdir = workdir
        self.read_only = read_only
        self.latest = _manager(workdir / "checkpoints", keep=2, read_only=read_only)
        self.best = _manager(workdir / "best", keep=1, read_only=read_only)

    def save(self, step: int, state: dict) -> None:
        """The whole training state: {"params", "opt_state", "step"}."""
        items = {
            "params": ocp.args.StandardSave(state["params"]),
            "training": ocp.args.StandardSave({"opt_state": state["opt_state"], "step": state["step"]}),
        }
        self._save(self.latest, step, items)

    def save_best(self, step: int, params: Any) -> None:
        self._save(self.best, step, {"params": ocp.args.StandardSave(params)})

    @staticmethod
    def _save(manager: ocp.CheckpointManager, step: int, items: dict) -> None:
        manager.save(step, args=ocp.args.Composite(**items), force=True)
        manager.wait_until_finished()

    def restore_training(self, target: dict) -> Restored | None:
        """The newest readable training state shaped like `target`; None when there is none."""
        training = {"opt_state": target["opt_state"], "step": target["step"]}
        items = {"params": _abstract(target["params"]), "training": _abstract(training)}
        restored = self._newest(self.latest, "checkpoints", items)
        if restored is None:
            return None
        value = restored.value
        state = {"params": value["params"], **value["training"]}
        return Restored(state, restored.step, restored.source)

    def restore_params(self, target: Any, *, best: bool = True) -> Restored:
        """The best parameters, or the latest if `best/` has none readable (or `best` is False);
        shaped like `target`."""
        items = {"params": _abstract(target)}
        sources = ((self.best, "best"), (self.latest, "checkpoints")) if best else ((self.latest, "checkpoints"),)
        for manager, source in sources:
            restored = self._newest(manager, source, items)
            if restored is not None:
                return Restored(restored.value["params"], restored.step, source)
        raise UserError(f"No readable checkpoint in {self.workdir}: train there first with `apps train`.")

    def read_params(self) -> Restored:
        """The best (else the latest) parameters as saved, on one device: for another run to
        start from (`model.init_from`), whatever its model and mesh."""
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        checkpointer = ocp.StandardCheckpointer()
        for manager, source in ((self.best, "best"), (self.latest, "checkpoints")):
            for step in sorted(manager.all_steps(), reverse=True):
                path = Path(manager.directory) / str(step) / "params"
                try:
                    saved = checkpointer.metadata(path).item_metadata
                    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), saved)
                    return Restored(checkpointer.restore(path, target), step, source)
                except Exception as error:  # as in _newest: a damaged checkpoint raises many types
                    log.warning(
                        "Skipped the checkpoint %s/%d in %s: it cannot be read (%s).",
                        source,
                        step,
                        self.workdir,
                        type(error).__name__,
                    )
        raise UserError(f"No readable checkpoint in {self.workdir}: train there first with `apps train`.")

    def _newest(self, manager: ocp.CheckpointManager, source: str, items: dict) -> Restored | None:
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                args = ocp.args.Composite(**{name: ocp.args.StandardRestore(tree) for name, tree in items.items()})
                value = manager.restore(step, args=args)
            except Exception as error:  # truncated, missing or foreign files: orbax raises many types
                log.warning(
                    "Skipped the checkpoint %s/%d in %s: it cannot be read (%s: %s).",
                    source,
                    step,
                    self.workdir,
                    type(error).__name__,
                    str(error).splitlines()[0][:200] if str(error) else "",
                )
                self._set_aside(manager, source, step)
                continue
            return Restored({name: value[name] for name in items}, step, source)
        return None

    def _set_aside(self, manager: ocp.CheckpointManager, source: str, step: int) -> None:
        """Moves an unreadable checkpoint to corrupt/ (kept for inspection) so the step can be saved anew."""
        if self.read_only or jax.process_index() != 0:
            return
        target = self.workdir / "corrupt" / f"{source}-{step}-{int(time.time())}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(Path(manager.directory) / str(step)), target)
        manager.reload()
        log.warning("Moved it to %s.", target)

    def close(self) -> None:
        self.latest.close()
        self.best.close()


@contextmanager
def writer_lock(workdir: Path) -> Iterator[None]:
    """Holds `workdir`'s writer lock (`train.lock`) for a training run: a second `apps train`
    into it stops at once, naming the process that trains there. An advisory `flock`, which the
    kernel releases when its process ends however it ends; the file keeps the holder's name
    until the with-block ends (by an exception too), so a run that finds a name in a free lock
    knows that the process before it was killed, and says so. Eval and predict take no lock:
    they read a run that is training. In a multi-process run, process 0 holds it for all."""
    if jax.process_index() != 0:
        yield
        return
    workdir.mkdir(parents=True, exist_ok=True)
    handle = open(workdir / LOCK, "a+", encoding="utf-8")
    try:
        handle.seek(0)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = handle.read().strip() or "another process"
            raise UserError(
                f"{workdir} is being trained by {holder}: wait for it to end, stop it, or train into another --workdir."
            ) from None
        previous = handle.read().strip()
        if previous:
            log.warning(
                "%s was last trained by %s, which ended without releasing it; taking it over.", workdir, previous
            )
        handle.seek(0)
        handle.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(f"process {os.getpid()} on {socket.gethostname()} (since {started})")
        handle.flush()
        try:
            yield
        finally:
            # An exception is a clean exit too: only a killed process leaves its name behind.
            handle.seek(0)
            handle.truncate()
    finally:
        handle.close()


@contextmanager
def undone_on_failure(workdir: Path) -> Iterator[None]:
    """Holds `workdir`'s writer lock for one training attempt and, should the attempt fail (any
    exception, Ctrl-C included) before it records a step, puts the workdir back as it was: what
    the attempt created goes (the workdir itself, and the parents made for it, if they were new),
    what was there before stays. Otherwise a mistake such as a batch larger than the data left a
    config.json behind, and the corrected command was refused as another configuration. Once a
    step is recorded (a checkpoint or metrics.jsonl), everything stays, for resuming. Only the
    top level is compared: an attempt that records no step adds nothing inside older folders.
    In a multi-process run, process 0 alone removes (and holds the lock)."""
    if jax.process_index() != 0:
        yield
        return
    new = next((p for p in reversed([workdir, *workdir.parents]) if not p.exists()), None)
    before = set(os.listdir(workdir)) if new is None else set()
    undone = False
    try:
        with writer_lock(workdir):
            try:
                yield
            except BaseException:
                undone = not _records_a_step(workdir)
                if undone:
                    for name in set(os.listdir(workdir)) - before - {LOCK}:
                        _remove(workdir / name)
                    if LOCK not in before:
                        # Removed while still held, so that no other run takes a lock that is then removed.
                        (workdir / LOCK).unlink(missing_ok=True)
                raise
    finally:
        folder = workdir
        while undone and new is not None:
            try:
                folder.rmdir()  # only when empty: another run may have begun here meanwhile
            except OSError:
                break
            if folder == new:
                break
            folder = folder.parent


def _records_a_step(workdir: Path) -> bool:
    """Whether `workdir` holds a trained step: metrics, or a checkpoint (kept, or set aside as corrupt)."""

    def names(folder: str) -> list[str]:
        return [p.name for p in (workdir / folder).iterdir()] if (workdir / folder).is_dir() else []

    metrics = workdir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return True
    return any(name.isdigit() for name in names("checkpoints") + names("best")) or bool(names("corrupt"))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def read_json(path: Path, remedy: str) -> Any:
    """A workdir's JSON file, or a `UserError` that names it, says what is wrong and `remedy`
    (what to do): a crash while an older version wrote it, or a hand edit."""
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not valid JSON ({error}): {remedy}") from None
    except OSError as error:
        raise UserError(f"{path} cannot be read ({error.strerror or error}): {remedy}") from None


def write_json(path: Path, value: Any) -> None:
    """Writes JSON through a temporary file and a rename, so a reader never sees half a file."""
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    temporary.replace(path)
