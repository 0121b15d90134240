"""The weight tables: how a model's parameters are made of a checkpoint's tensors, and back.

A family lists `Rule`s (one per parameter: copy, transpose, concatenate, split, reshape) that
`core.checkpoints.pretrained.load` applies and `export` inverts; `Report` says what a load
filled, what the model has that the checkpoint lacks and which tensors nothing took.
`flat_params` and `set_params` read and write a model's parameters by dotted path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from flax import nnx


@dataclass(frozen=True)
class Rule:
    """How one model parameter (`target`, a dotted path) is made of checkpoint tensors.

    copy: the tensor itself; transpose: a linear weight [out, in] as a kernel [in, out];
    fuse: several linear weights' transposes (or biases) side by side along the output axis;
    rows: the rows `offset` .. offset + (the parameter's rows) of a table;
    one_plus: 1 + the tensor (a norm weight w that its family applies as x * (1 + w): Gemma's);
    conv: a PyTorch convolution weight [out, in, width...] as a Flax kernel [width..., in, out].
    """

    target: str
    sources: tuple[str, ...]
    kind: Literal["copy", "transpose", "fuse", "rows", "one_plus", "conv"] = "copy"
    offset: int = 0

    def expected(self, shape: tuple[int, ...], available: Mapping[str, tuple[int, ...]]) -> list[tuple[str, str]]:
        """(source, the shape it must have) for each source whose shape does not fit `shape`."""
        if self.kind in ("copy", "one_plus"):
            wanted = [shape]
        elif self.kind == "transpose":
            wanted = [shape[::-1]]
        elif self.kind == "conv":
            wanted = [(shape[-1], shape[-2], *shape[:-2])]
        elif self.kind == "rows":
            rows = available[self.sources[0]][0] if len(available[self.sources[0]]) == 2 else 0
            wanted = [(max(rows, self.offset + shape[0]), *shape[1:])]
        else:
            widths = [available[name][0] for name in self.sources]
            if sum(widths) != shape[-1]:
                return [(name, f"{len(self.sources)} parts of total width {shape[-1]}") for name in self.sources]
            wanted = [(width, *shape[:-1]) for width in widths]
        return [(name, str(list(w))) for name, w in zip(self.sources, wanted) if tuple(available[name]) != tuple(w)]

    def join(self, tensors: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        parts = [tensors[name] for name in self.sources]
        if self.kind == "copy":
            return parts[0]
        if self.kind == "one_plus":
            return 1 + parts[0].astype(np.float32)  # bf16 weights: 1 + w rounded in bf16 loses w's digits
        if self.kind == "transpose":
            return parts[0].T
        if self.kind == "conv":
            return np.moveaxis(parts[0], (0, 1), (-1, -2))
        if self.kind == "rows":
            return parts[0][self.offset : self.offset + shape[0]]
        return np.concatenate([part.T for part in parts], axis=-1)

    def split(self, value: np.ndarray, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """The inverse of `join`: the checkpoint tensors (of `shapes`) this parameter holds."""
        if self.kind in ("copy", "rows"):
            return {self.sources[0]: value}
        if self.kind == "one_plus":
            return {self.sources[0]: value.astype(np.float32) - 1}
        if self.kind == "transpose":
            return {self.sources[0]: value.T}
        if self.kind == "conv":
            return {self.sources[0]: np.moveaxis(value, (-1, -2), (0, 1))}
        edges = np.cumsum([shapes[name][0] for name in self.sources])[:-1]
        return {name: part.T for name, part in zip(self.sources, np.split(value, edges, axis=-1))}


def split_params(
    params: Mapping[str, np.ndarray],
    rules: list[Rule],
    shapes: Mapping[str, tuple[int, ...]],
    base: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The checkpoint tensors that `rules` make the parameters (by dotted path) of: `load`'s
    inverse. `shapes` needs the rows of each fused source alone. A table that a parameter holds
    some rows of (a position table read from `offset`, or cut to a run's length) is written
    whole: `base`'s tensor with those rows replaced, where `base` is given."""
    tensors = {}
    for rule in rules:
        parts = rule.split(np.asarray(params[rule.target]), shapes)
        if rule.kind == "rows" and base is not None:
            table = np.array(base[rule.sources[0]], parts[rule.sources[0]].dtype)
            table[rule.offset : rule.offset + len(parts[rule.sources[0]])] = parts[rule.sources[0]]
            parts = {rule.sources[0]: table}
        tensors.update(parts)
    return tensors


def fused_rows(rules: list[Rule], model) -> dict[str, tuple[int]]:
    """The rows of each source that a decoder's fused parameters join (a `ModelConfig`'s query,
    key and value projections; its gate and up projections), for `split_params` where no file
    gives them."""
    heads = (
        model.num_heads * model.head_dim,
        model.key_value_heads * model.head_dim,
        model.key_value_heads * model.head_dim,
    )
    parts = {"qkv": heads, "up": (model.mlp_dim, model.mlp_dim)}
    return {
        name: (rows,)
        for rule in rules
        if rule.kind == "fuse"
        for name, rows in zip(rule.sources, parts[rule.target.split(".")[-2]])
    }


@dataclass(frozen=True)
class Report:
    """What `load` did: parameters filled, parameters left as initialized (the checkpoint has
    nothing for them: a task's new head), checkpoint tensors that nothing took."""

    source: Path
    filled: tuple[str, ...]
    new: tuple[str, ...]
    unused: tuple[str, ...]

    def summary(self) -> str:
        adapters = [path for path in self.new if path.endswith((".lora_a", ".lora_b"))]
        new = [path for path in self.new if path not in adapters]
        lora = f" and {len(adapters)} LoRA adapter matrices" if adapters else ""
        return (
            f"Loaded {len(self.filled)} parameters from {self.source}; new: {', '.join(new) or 'none'}{lora}; "
            f"unused checkpoint tensors: {', '.join(self.unused) or 'none'}."
        )


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """A nested mapping of arrays by dotted path ("body.blocks.0.attention.qkv.kernel")."""
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        flat.update(flatten(value, path + ".") if isinstance(value, Mapping) else {path: value})
    return flat


def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's parameters by dotted path."""
    return flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def set_params(model: nnx.Module, values: dict[str, Any]) -> None:
    """Sets the parameters named by dotted path (as `flat_params` names them) to `values`."""
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    for path, value in values.items():
        node = pure
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[int(key) if key.isdigit() else key]
        node[leaf] = value
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
