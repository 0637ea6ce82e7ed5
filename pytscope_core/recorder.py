"""The per-rank hot path: timeline marks from hooks, grouped into optimizer steps.

Hooks call `mark()` (or `loop_top()` where a new iteration may begin). A step closes at the first loop top
after an optimizer step, so a gradient-accumulation window is one step and the step's wall time runs loop
top to loop top. Closed steps wait in `window` as raw marks until the scope turns them into record rows
at the next gather: the hot path does two list appends per mark and nothing else.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .clocks import Clock, HostClock
from .records import COL, NCOLS, PHASE_COLS
from .timeline import Mark, attribute_many

# Plain ints for the hot path (an enum member lookup costs more than the append it feeds).
_STEP_START, _STEP_END, _OPTIMIZER_END = int(Mark.STEP_START), int(Mark.STEP_END), int(Mark.OPTIMIZER_END)
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux


def host_peak_rss() -> float:
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT)


class ClosedStep(NamedTuple):
    """One finished step, still as raw marks (timestamps resolve lazily, e.g. CUDA events). A tuple: it is
    built on the hot path, once per step."""

    step: int
    host_start_ns: int
    marks: list[int]
    stamps: list[Any]
    loss: Any
    samples: float
    mem: float
    syncs: int
    micro: int


class StepRecorder:
    """Collects one rank's steps. Not thread-safe beyond what list.append gives (autograd threads mark too)."""

    def __init__(
        self,
        clock: Clock | None = None,
        memory: Callable[[], float] = host_peak_rss,
        host_ns: Callable[[], int] | None = None,
    ) -> None:
        self.clock: Clock = clock or HostClock()
        self._now = self.clock.now
        self._memory = memory
        self._host_ns = host_ns or HostClock.now
        self.on_step_closed: Callable[[], None] | None = None  # the scope's gather check...
        self.notify_at = 0  # ...called once the gather key (below) reaches this
        self.notify_on_syncs = False  # key: gradient syncs (DDP) or optimizer steps
        self._memory_every = 8  # host RSS is a syscall: read it every 8th step (its peak only grows)
        self._last_memory = math.nan
        self.steps_done = 0  # optimizer steps completed, counting those before a resume
        self.grad_syncs = 0
        self.micro_batches = 0
        self.window: list[ClosedStep] = []
        self._marks: list[int] = []
        self._stamps: list[Any] = []
        self._open = False
        self._stepped = False
        self._host_start = 0
        self._loss: Any = None
        self._samples = 0.0
        self._step_syncs = 0
        self._step_micro = 0

    # -- hot path -------------------------------------------------------------------------------------
    def mark(self, mark: int) -> None:
        if self._open:
            self._marks.append(mark)
            self._stamps.append(self._now())

    def loop_top(self, mark: int) -> None:
        """A mark where a new iteration may begin (fetching data, or the forward when no loader is watched)."""
        if self._stepped:
            self._close_step()
            if (self.grad_syncs if self.notify_on_syncs else self.steps_done) >= self.notify_at:
                if self.on_step_closed is not None:
                    self.on_step_closed()  # may gather: the next step starts after it
            self._open_step()
        elif not self._open:
            self._open_step()
        self._marks.append(mark)
        self._stamps.append(self._now())

    def optimizer_stepped(self) -> None:
        self._marks.append(_OPTIMIZER_END)
        self._stamps.append(self._now())
        self._stepped = True

    def count_micro_batch(self, samples: float) -> None:
        self._step_micro += 1
        self._samples += samples

    def count_grad_sync(self) -> None:
        self._step_syncs += 1

    def set_loss(self, loss: Any) -> None:
        self._loss = loss

    # -- step bookkeeping -----------------------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        return self._open

    @property
    def completed(self) -> tuple[int, int, int]:
        """(optimizer steps, gradient syncs, micro-batches) done so far, counting the step that has just
        stepped but not yet closed (a checkpoint saved right after `optimizer.step()` includes it)."""
        if self._stepped:
            return (
                self.steps_done + 1,
                self.grad_syncs + self._step_syncs,
                self.micro_batches + self._step_micro,
            )
        return (self.steps_done, self.grad_syncs, self.micro_batches)

    def _open_step(self) -> None:
        self._open = True
        self._stepped = False
        now = self._now()
        self._host_start = now if self.clock.__class__ is HostClock else self._host_ns()
        self._marks = [_STEP_START]
        self._stamps = [now]
        self._loss = None
        self._samples = 0.0
        self._step_syncs = 0
        self._step_micro = 0

    def _close_step(self) -> None:
        self._marks.append(_STEP_END)
        self._stamps.append(self._now())
        self.steps_done += 1
        self.grad_syncs += self._step_syncs
        self.micro_batches += self._step_micro
        if self.steps_done % self._memory_every == 0 or self._last_memory != self._last_memory:
            self._last_memory = self._memory()
        self.window.append(
            ClosedStep(
                self.steps_done,
                self._host_start,
                self._marks,
                self._stamps,
                self._loss,
                self._samples if self._step_micro else math.nan,
                self._last_memory,
                self._step_syncs,
                self._step_micro,
            )
        )
        self._open = False
        self._stepped = False

    def close(self) -> None:
        """End of training: close the open step if an optimizer step happened in it, else drop it."""
        if self._stepped:
            self._close_step()
        self._open = False

    def drain(self, rank: int, segment: int, epoch_offset_s: float) -> np.ndarray:
        """Turn the closed steps into record rows (see records.COLUMNS) and empty the window.

        `epoch_offset_s` converts host perf_counter seconds to seconds since the epoch.
        """
        window, self.window = self.window, []
        rows = np.full((len(window), NCOLS), np.nan)
        if not window:
            return rows
        ms = self.clock.to_ms([s for w in window for s in w.stamps])
        timed = attribute_many([w.marks for w in window], ms)
        meta = np.array(
            [(w.step, w.host_start_ns, w.samples, w.mem, w.syncs, w.micro) for w in window], dtype=np.float64
        )
        rows[:, COL["rank"]] = rank
        rows[:, COL["segment"]] = segment
        rows[:, COL["step"]] = meta[:, 0]
        rows[:, COL["start_s"]] = meta[:, 1] / 1e9 + epoch_offset_s
        rows[:, list(PHASE_COLS)] = timed[:, : len(PHASE_COLS)]
        rows[:, COL["excluded_ms"]] = timed[:, len(PHASE_COLS)]
        rows[:, COL["wall_ms"]] = timed[:, len(PHASE_COLS) + 1]
        rows[:, COL["loss"]] = _losses_to_floats([w.loss for w in window])
        rows[:, [COL["samples"], COL["mem_bytes"], COL["grad_syncs"], COL["micro_batches"]]] = meta[:, 2:]
        return rows


def _losses_to_floats(losses: list[Any]) -> list[float]:
    """Loss tensors stay on their device until here, so the hot path never forces a device sync."""
    out = [math.nan] * len(losses)
    tensors = []
    where = []
    for i, loss in enumerate(losses):
        if loss is None:
            continue
        if isinstance(loss, (int, float)):
            out[i] = float(loss)
        else:
            tensors.append(loss)
            where.append(i)
    if tensors:
        import torch

        if all(t.device.type == "cpu" and t.numel() == 1 for t in tensors):
            values = [t.item() for t in tensors]
        else:  # one stack and one copy for the window: at most one device sync per gather
            values = torch.stack([t.detach().float().mean() for t in tensors]).cpu().tolist()
        for i, v in zip(where, values, strict=True):
            out[i] = v
    return out
