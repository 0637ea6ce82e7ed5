"""Logged values (losses and any scalars) as plain floats, read off the hot path.

`scope.log()` keeps what it is given (tensors stay on their device) and the gather reads them here: a tensor
of one element as its value, of several as its mean, a DTensor through its local shard (no collective), all
tensors on one device in one copy. A value that is not a number reads as None, never as an error: the
scope must not fail on what a user logs, and a loss that is not a number is not a non-finite loss.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np


def to_floats(values: list[Any]) -> list[float | None]:
    """Each value as a float (NaN and inf kept), or None for None and for anything that is not a number (text
    included: "1.5" is not parsed)."""
    out: list[float | None] = [None] * len(values)
    tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)  # a tensor means torch is imported
    tensors: dict[Any, list[tuple[int, Any]]] = {}  # by device
    for i, value in enumerate(values):
        if value is None or isinstance(value, (str, bytes)):
            continue
        if tensor_type is not None and isinstance(value, tensor_type):
            local = getattr(value, "to_local", None)  # a DTensor (FSDP2's clip_grad_norm_): its own shard
            t = (local() if callable(local) else value).detach()
            if not (t.is_complex() or t.numel() == 0):
                tensors.setdefault(t.device, []).append((i, t))
            continue
        try:
            out[i] = float(np.mean(value)) if isinstance(value, np.ndarray) else float(value)
        except (TypeError, ValueError, OverflowError):
            pass
    for device, items in tensors.items():
        try:
            for (i, _), v in zip(items, _read(device, [t for _, t in items]), strict=True):
                out[i] = float(v)
        except (RuntimeError, TypeError, ValueError):  # e.g. a tensor subclass that cannot be read this way
            pass
    return out


def _read(device: Any, tensors: list[Any]) -> list[float]:
    """Tensors on one device, in one copy to the host: at most one device sync."""
    if device.type == "cpu" and all(t.numel() == 1 for t in tensors):
        return [t.item() for t in tensors]
    import torch

    return list(torch.stack([t.float().mean() for t in tensors]).cpu().tolist())


class ScalarLog:
    """The extra scalars `scope.log()` was given since the last gather, one line per step: the latest value
    of a name in a step wins (every micro-batch may log)."""

    def __init__(self) -> None:
        self._lines: list[dict[str, Any]] = []

    def add(self, step: int, scalars: dict[str, Any]) -> None:
        # A copy of a tensor: one the user updates in place (a step counter) is read at the gather as logged.
        # (`detach` read from the type, as `Scope.log` reads it: a user's __getattr__ may raise anything.)
        values = {k: v.detach().clone() if hasattr(type(v), "detach") else v for k, v in scalars.items()}
        if self._lines and self._lines[-1]["step"] == step:
            self._lines[-1].update(values)
        else:
            self._lines.append({"step": step, **values})

    def take(self, segment: int) -> list[dict[str, Any]]:
        """The lines since the last call, every value a plain number (`scalar_lines`), each marked with the run
        `segment` it was logged in (a resumed run replays steps: the segment tells the copies apart)."""
        lines, self._lines = self._lines, []
        return [{**line, "segment": segment} for line in scalar_lines(lines)]


def scalar_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logged scalar lines ({"step": ..., name: value}), changed in place: numbers as floats, text as it is,
    anything else NaN."""
    keys = [(line, k) for line in lines for k, v in line.items() if k != "step" and not isinstance(v, str)]
    for (line, k), number in zip(keys, to_floats([line[k] for line, k in keys]), strict=True):
        line[k] = math.nan if number is None else number
    return lines
