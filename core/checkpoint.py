"""Orbax checkpoints of a run, and the workdir's small JSON files.

A workdir holds `config.json`, `featurizer/`, `checkpoints/` (the latest two training states,
for resuming), `best/` (the parameters alone of the best validation step, for eval and
predict) and `metrics.jsonl`. Each checkpoint has the items `params` and, in `checkpoints/`,
`training` (optimizer state and step), so that eval and predict read parameters only.

Saves are synchronous and orbax writes each one to a temporary folder that it renames when
complete, so a killed run leaves its last completed checkpoint intact. A checkpoint that
cannot be read all the same (files truncated or lost afterwards) is skipped with a warning and
the one before it is used; in a run that trains, it is moved aside to `corrupt/` so that the
step can be saved again.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from core.errors import UserError

log = logging.getLogger("apps")


class _ReadOnlyNotice(logging.Filter):
    """Drops orbax's notices that a manager opened read-only (for eval and predict) is read-only
    and that an item read on its own (`read_params`) has no step metadata beside it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("Given directory is read only", "Metadata file does not exist"))


logging.getLogger("absl").addFilter(_ReadOnlyNotice())


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


def write_json(path: Path, value: Any) -> None:
    """Writes JSON through a temporary file and a rename, so a reader never sees half a file."""
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    temporary.replace(path)
