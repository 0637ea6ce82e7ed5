"""Peak FLOP/s of known devices and FLOPs of one training step, for model FLOPs utilisation (MFU).

Peaks are dense (no sparsity) BF16/FP16 tensor-core numbers from the vendors' data sheets. A device name is
matched exactly after normalising case and spaces, against the names `torch.cuda.get_device_name` reports,
so an unknown part gives None (MFU "n/a") instead of a wrong guess. Torch is imported only inside
`measure_flops_per_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PEAK_FLOPS: dict[str, float] = {
    "a100 sxm": 312e12,
    "a100 pcie": 312e12,
    "h100 sxm": 989e12,
    "h100 pcie": 756e12,
    "h100 nvl": 835e12,
    "h200": 989e12,
    "b200": 2250e12,
    "l40s": 362e12,
    "mi300x": 1307e12,
}
"""Dense BF16/FP16 peak FLOP/s per device."""

DEVICE_NAMES: dict[str, str] = {
    "nvidia a100-sxm4-40gb": "a100 sxm",
    "nvidia a100-sxm4-80gb": "a100 sxm",
    "nvidia a100-pcie-40gb": "a100 pcie",
    "nvidia a100-pcie-80gb": "a100 pcie",
    "nvidia a100 80gb pcie": "a100 pcie",
    "nvidia h100 80gb hbm3": "h100 sxm",
    "nvidia h100": "h100 sxm",
    "nvidia h100 pcie": "h100 pcie",
    "nvidia h100 nvl": "h100 nvl",
    "nvidia h200": "h200",
    "nvidia h200 nvl": "h200",
    "nvidia b200": "b200",
    "nvidia l40s": "l40s",
    "amd instinct mi300x": "mi300x",
    "amd instinct mi300x vf": "mi300x",
}
"""Reported device names (normalised) -> PEAK_FLOPS key; the keys themselves are accepted too."""


def _normalise(name: str) -> str:
    return " ".join(name.strip().lower().split())


def peak_flops_for(device_name: str | None) -> float | None:
    """Dense BF16 peak FLOP/s of a device by its exact (normalised) name; None when unknown."""
    if not device_name:
        return None
    key = _normalise(device_name)
    return PEAK_FLOPS.get(DEVICE_NAMES.get(key, key))


def measure_flops_per_step(fn: Callable[[], Any]) -> float | None:
    """FLOPs counted by torch's FlopCounterMode while running `fn` once (e.g. forward + backward of one
    batch); None when the counter is unavailable or fails (MFU then shows "n/a")."""
    try:
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError:
        return None
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            fn()
    except Exception:
        return None
    total = float(counter.get_total_flops())
    return total if total > 0 else None
