"""What every benchmark shares: its table, the compile-then-time loop over steps, a batch of
random tokens, and the matmul peak that MFU is measured against."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.table import Table

from core.bench.flops import device_record


def figures(title: str, caption: str, columns: tuple[str, ...]) -> Table:
    """A benchmark's table: its title, the caption that says how the figures were taken, and
    right-aligned columns."""
    table = Table(title=title, caption=caption)
    for column in columns:
        table.add_column(column, justify="right")
    return table


@dataclass
class Timed:
    """What `timed_steps` gives: the state after every step, the seconds of the untimed first
    pass (it compiles), and the seconds of each timed step."""

    state: Any
    warm_up_s: float
    times: list[float]


def timed_steps(
    step: Callable, state: Any, batches: Sequence[Any], passes: int = 1, after_each: Callable[[float], None] = None
) -> Timed:
    """`state, logs = step(state, batch)` over `batches` once untimed (compiling each batch
    shape), then `passes` times over them timed, each step waited for; `after_each` receives
    each timed step's seconds (the matmul peak samples then, for as long)."""
    started = time.perf_counter()
    for batch in batches:
        state, logs = step(state, batch)
        jax.block_until_ready(logs)
    warm_up_s, times = time.perf_counter() - started, []
    for _ in range(passes):
        for batch in batches:
            started = time.perf_counter()
            state, logs = step(state, batch)
            jax.block_until_ready(logs)
            times.append(time.perf_counter() - started)
            if after_each is not None:
                after_each(times[-1])
    return Timed(state, warm_up_s, times)


def token_batch(mesh, rows: int, length: int, vocab_size: int) -> dict[str, jax.Array]:
    """Next-token prediction over random tokens: `rows` rows of `length`, placed over the
    mesh's data axes as the train step takes them."""
    tokens = np.random.default_rng(0).integers(0, vocab_size, (rows, length + 1), dtype=np.int32)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "mask": np.ones((rows, length), bool),
        "weights": np.ones(rows, np.float32),
    }
    return jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))


class MatmulPeak:
    """The best FLOP/s that `jnp.dot` sustains on size^3 products in `dtype` (float32 sums),
    over all samples: 2048^3 in float32 on a CPU, 8192^3 in bfloat16 on an accelerator
    (`for_products`)."""

    def __init__(self, size: int = 2048, dtype=jnp.float32):
        rng = np.random.default_rng(0)
        self.a, self.b = (jnp.asarray(rng.standard_normal((size, size), np.float32), dtype) for _ in range(2))
        self.dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        self.dot(self.a, self.b).block_until_ready()
        self.flops = 2 * size**3
        self.dtype = jnp.dtype(dtype).name
        self.best = 0.0  # sustained: the best mean rate of a sample
        self.burst = 0.0  # the best single product

    @classmethod
    def for_products(cls, dtype: str) -> MatmulPeak:
        """The peak for a step whose products run in `dtype`, sized for this backend."""
        return cls(2048 if jax.default_backend() == "cpu" else 8192, jnp.dtype(dtype))

    def sample(self, seconds: float) -> None:
        """Products back to back for about `seconds`; their mean rate is one sample."""
        started = time.perf_counter()
        count, now = 0, started
        while count == 0 or now - started < seconds:
            self.dot(self.a, self.b).block_until_ready()
            count, last = count + 1, now
            now = time.perf_counter()
            self.burst = max(self.burst, self.flops / (now - last))
        self.best = max(self.best, count * self.flops / (now - started))


def save_figures(name: str, figures: list[dict], json_path: Path | None) -> None:
    """A benchmark's figures into `json_path` as {name: figures, "device": where they ran},
    when one is given."""
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({name: figures, "device": device_record()}, indent=2) + "\n")
        print(f"Wrote {json_path}.")
