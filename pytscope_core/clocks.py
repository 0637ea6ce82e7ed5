"""Clocks for the step timeline: host `perf_counter_ns` on CPU, CUDA events read lazily on GPU.

A clock's `now()` is called on the hot path and must be cheap; `to_ms()` resolves a whole window of
timestamps at once, off the hot path. The CUDA clock synchronizes at most once per call to `to_ms`, which
the scope makes once per gather interval, never per step. A clock whose stamps are worth reusing (CUDA
events) also has `release(stamps)`: the recorder calls it for stamps it will never read again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


class Clock(Protocol):
    def now(self) -> Any: ...

    def to_ms(self, stamps: Sequence[Any]) -> Any: ...  # float ms, one per stamp (list or array)


class HostClock:
    """CLOCK_MONOTONIC in nanoseconds: shared by processes on one host, cheap (about 50 ns)."""

    now = staticmethod(time.perf_counter_ns)

    @staticmethod
    def to_ms(stamps: Sequence[Any]) -> Any:
        return np.asarray(stamps, dtype=np.float64) / 1e6


class CudaEventClock:
    """Marks recorded as CUDA events on the current stream of the model's device, so GPU phases are
    execution, not launch, times, on the GPU that runs the model (not whichever device is current).

    The device is resolved once, to its index; the stream is read at every mark, as the current stream is
    whatever the training code has selected at that moment (`torch.cuda.stream(...)` may change it).
    Events are recycled from a pool once released (each event stamps one mark only: recording it again
    would move that mark). `to_ms` waits for the newest event (one synchronize) and measures every stamp
    from the one before it.
    """

    def __init__(self, device: Any = None) -> None:
        import torch

        self.device = cuda_device(device)
        self._index: int = self.device.index  # an int: torch's device lookups take it as is
        self._event = torch.cuda.Event
        self._current_stream = torch.cuda.current_stream
        self._stats = torch.cuda.memory_stats_as_nested_dict
        self._pool: list[Any] = []

    def now(self) -> Any:
        ev = self._pool.pop() if self._pool else self._event(enable_timing=True)
        ev.record(self._current_stream(self._index))
        return ev

    def peak_memory(self) -> float:
        """The allocator's high-water mark on this device, as `torch.cuda.max_memory_allocated` gives it,
        taken from the allocator's statistics without flattening and sorting them all into one dict first.
        Never reset here: the user's own `torch.cuda.max_memory_allocated()` readings stay true, and like the
        host's peak RSS it only grows."""
        stats = self._stats(self._index)  # {} before CUDA is initialised: nothing allocated yet
        return float(stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0))

    def to_ms(self, stamps: Sequence[Any]) -> list[float]:
        if not stamps:
            return []
        stamps[-1].synchronize()
        # Each stamp from the one before, summed in float64: `elapsed_time` is single precision, so measured
        # from the window's first event, a step hours into a window would be rounded to ms or worse.
        times, total = [0.0], 0.0
        for before, ev in zip(stamps, stamps[1:], strict=False):
            total += before.elapsed_time(ev)
            times.append(total)
        return times

    def release(self, stamps: Sequence[Any]) -> None:
        """Events the recorder will not read again go back to the pool (each once)."""
        self._pool.extend(dict.fromkeys(stamps))


def cuda_device(device: Any = None) -> Any:
    """`device` as a `torch.device` with its index (a bare "cuda" means the current device)."""
    import torch

    d = torch.device("cuda") if device is None else torch.device(device)
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())
