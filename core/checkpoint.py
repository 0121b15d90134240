"""Orbax checkpoints of the training state, and the workdir's small JSON files.

A workdir holds `config.json`, `featurizer/`, `checkpoints/` (the latest two, for resuming),
`best/` (the state with the best validation metric, for eval and predict) and `metrics.jsonl`.
Saves are synchronous and orbax writes each one to a temporary folder that it renames when
complete, so an interrupted run always leaves its last completed checkpoint intact.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from core.errors import UserError


class _ReadOnlyNotice(logging.Filter):
    """Drops orbax's warning that a manager opened read-only (for eval and predict) is read-only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only")


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


class Checkpoints:
    """The latest and the best training state of one workdir."""

    def __init__(self, workdir: Path, read_only: bool = False):
        self.latest = _manager(workdir / "checkpoints", keep=2, read_only=read_only)
        self.best = _manager(workdir / "best", keep=1, read_only=read_only)

    def latest_step(self) -> int | None:
        return self.latest.latest_step()

    def save(self, step: int, state: Any, *, best: bool = False) -> None:
        manager = self.best if best else self.latest
        manager.save(step, args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()

    def restore(self, target: Any, *, best: bool = False) -> Any:
        """The newest saved state shaped and sharded like `target` (arrays or ShapeDtypeStructs)."""
        manager = self.best if best and self.best.latest_step() is not None else self.latest
        step = manager.latest_step()
        if step is None:
            raise UserError(f"No checkpoint in {manager.directory.parent}: train there first with `apps train`.")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), target
        )
        return manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        self.latest.close()
        self.best.close()


def write_json(path: Path, value: Any) -> None:
    """Writes JSON through a temporary file and a rename, so a reader never sees half a file."""
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    temporary.replace(path)
