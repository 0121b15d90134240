"""A run's parameters as a format's tensors: a weight table of `core.checkpoints` inverted
(`split_params`), refusing a model with parameters the format has no place for (a head of its
own), the LoRA adapters aside (folded into their kernels, or written apart)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from core.checkpoints.rules import Rule, split_params
from core.errors import UserError
from core.model import lora


def placed(
    params: Mapping[str, np.ndarray],
    rules: list[Rule],
    shapes: Mapping[str, tuple[int, ...]],
    where: str,
    *,
    base: Mapping[str, np.ndarray] | None = None,
    beside: tuple[str, ...] = (),
) -> dict[str, np.ndarray]:
    """`split_params` of `params` through `rules`; `beside`: parameters the caller writes itself."""
    written = {rule.target for rule in rules} | set(beside)
    left = sorted(p for p in params if p not in written and p.rsplit(".", 1)[-1] not in lora.ADAPTERS)
    if left:
        raise UserError(f"{where} has no place for the run's parameters {', '.join(left)}.")
    return split_params(params, rules, shapes, base)
