"""LoRA runs served beside their base: the base weights once, an adapter chosen per request.

    apps serve --model smollm2-135m-instruct --workdir runs/poems-lora --workdir runs/legal-lora

A LoRA run (`model.lora_rank` > 0) trained on a checkpoint (`model.pretrained`) that the server
also serves by `--model` joins that checkpoint's generation engine as an adapter; several LoRA
runs of one checkpoint served without it share one engine too. Each keeps its own name: a
request's `"model"` picks the adapter (the checkpoint's name, none), and requests to different
adapters decode side by side in one step (`core.model.lora.stacked`). Each run's own model (for
`/v1/lm/predict` and embeddings) is given the base's arrays, so the base weights are held once.

A run joins only if its frozen weights equal the base's, array for array (it may have been
trained on another file of the same name): else it is served as it is, with an engine of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from core.checkpoints.rules import flat_params
from core.model import lora

log = logging.getLogger("apps")

Loaded = tuple[str, Any, str | None]  # a served name, its `core.predict.Predictor`, the checkpoint it was given as


def grouped(loaded: Sequence[Loaded]) -> list[list[tuple[str, Any, int]]]:
    """The served models in engine groups, each a list of (name, predictor, adapter): the first
    one's weights are the group's base; adapter 0 is the base alone (a `--model` checkpoint), a
    group of LoRA runs alone numbers them from 1. A model that generates nothing, or shares its
    base with no other, is a group of its own, adapter 0 (a LoRA run then decodes as it is)."""
    groups: list[list[tuple[str, Any, int]]] = []
    taken: set[str] = set()
    for name, predictor, checkpoint in sorted(loaded, key=lambda entry: entry[2] is None):  # checkpoints first
        if name in taken:
            continue
        taken.add(name)
        group = [(name, predictor, 0)]
        base = checkpoint if checkpoint is not None else _base_of(predictor) if _adapts(predictor) else None
        for other, run, given in loaded:
            if base is None or not predictor.task.completes or other in taken or given is not None:
                continue
            if _adapts(run) and _base_of(run) == base and _shares_weights(predictor, run, (name, other)):
                group.append((other, run, len(group)))
                taken.add(other)
        if len(group) > 1 and checkpoint is None:  # no checkpoint to be adapter 0: the runs are 1 to N
            group = [(n, p, index) for index, (n, p, _) in enumerate(group, 1)]
        groups.append(group)
    return groups


def _adapts(predictor) -> bool:
    return predictor.task.completes and predictor.task.config.model.lora_rank > 0


def _base_of(predictor) -> str | None:
    return predictor.task.config.model.pretrained


def _shares_weights(base, run, names: tuple[str, str]) -> bool:
    """Whether every frozen weight of the LoRA `run` equals `base`'s (`names`: theirs); if so
    the run's model and its frozen parameters are given the base's arrays, its own let go."""
    mine, theirs = flat_params(run.model), flat_params(base.model)
    frozen = [path for path in mine if path.rsplit(".", 1)[-1] not in lora.ADAPTERS]
    for path in frozen:
        other, value = theirs.get(path), mine[path]
        if other is None or other.shape != value.shape or other.dtype != value.dtype:
            break
        if not np.array_equal(np.asarray(other), np.asarray(value)):
            break
    else:
        run.share_weights({path: theirs[path] for path in frozen})
        return True
    log.warning("%s: its base weights are not %s's; it is served with an engine of its own.", names[1], names[0])
    return False
