"""Model FLOPs of a decoder's training step, and the chips' peaks that MFU divides them by.

A training token costs 6 N FLOPs in the products of N parameters (forward, and two products
backward), and 12 L T H_total in attention's two products over T positions (L layers of
N_heads x H wide), half of that where attention is causal: MaxText's convention, which counts
what a causal model needs, not what a kernel happens to compute.

MFU is reported against the chip's published bfloat16 peak (`chip_peak`: a TPU v5e's 197
TFLOP/s) and against the best product the benchmark measures on the same device, in the step's
dtype (`core.bench.timing.MatmulPeak`): the first is the figure to compare across tools, the
second says how far the step is from what this device's products reach.
"""

from __future__ import annotations

import jax

# Dense bfloat16 FLOP/s per chip as the vendors publish them, by the start of `device_kind`.
PEAKS = {
    "TPU v2": 45e12,
    "TPU v3": 123e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
    "NVIDIA L4": 121e12,
}


def chip_peak(device=None) -> float | None:
    """The published bfloat16 peak of `device` (the first device), or None where unknown (CPUs)."""
    kind = (device or jax.devices()[0]).device_kind
    return next((peak for name, peak in PEAKS.items() if kind.startswith(name)), None)


def train_flops_per_token(matmul_params: int, layers: int, attention_width: int, length: int, causal: bool) -> float:
    """A training token's model FLOPs: 6 N + 12 L T H_total, the attention term halved where causal."""
    attention = 12 * layers * attention_width * length * (0.5 if causal else 1.0)
    return 6 * matmul_params + attention


def device_record() -> dict:
    """What a benchmark's JSON records of where it ran."""
    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "chip_peak_flops": chip_peak(device),
        "jax": jax.__version__,
    }
