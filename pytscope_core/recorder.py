"""The per-rank hot path: timeline marks from hooks, grouped into optimizer steps.

Hooks call `mark()` (or `loop_top()` where a new iteration may begin). A step closes at the first loop top
after an optimizer step, so a gradient-accumulation window is one step and the step's wall time runs loop
top to loop top. Closed steps wait in `window` as raw marks until the scope turns them into record rows
at the next gather: the hot path does two list appends per mark, and opens a step in place.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .batches import resolve_fingerprints
from .clocks import Clock, HostClock
from .records import COL, NCOLS, PHASE_COLS
from .timeline import Mark, attribute_many
from .values import to_floats

# Plain ints for the hot path (an enum member lookup costs more than the append it feeds).
_STEP_END, _FORWARD_END, _OPTIMIZER_END = int(Mark.STEP_END), int(Mark.FORWARD_END), int(Mark.OPTIMIZER_END)
_LOOP_COMM_BEGIN, _LOOP_COMM_END = int(Mark.LOOP_COMM_BEGIN), int(Mark.LOOP_COMM_END)
_BACKWARD_END = int(Mark.BACKWARD_END)
_FORWARD_BEGIN, _BACKWARD_BEGIN = int(Mark.FORWARD_BEGIN), int(Mark.BACKWARD_BEGIN)
# What a loop may still do after its last step, before finish(): wait in collectives (a metric's gather, a
# barrier before saving) and run a forward (evaluation in training mode).
_EPILOGUE = frozenset(
    (
        _LOOP_COMM_BEGIN,
        _LOOP_COMM_END,
        int(Mark.COMM_BEGIN),
        int(Mark.COMM_END),
        int(Mark.FORWARD_BEGIN),
        _FORWARD_END,
    )
)
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
MEMORY_EVERY = 8
"""Steps between memory reads: a high-water mark (host peak RSS, CUDA allocator max) only grows, and reading
it costs a syscall or a stats dict."""


def _any_nonfinite(values: list[Any]) -> bool:
    return any(v is not None and not math.isfinite(v) for v in to_floats(values))


def did_work(marks: list[int], losses: list[Any]) -> bool:
    """Whether a step ran a forward or logged a loss."""
    return _FORWARD_END in marks or bool(losses)


def skipped_untrained(marks: list[int], losses: list[Any]) -> bool:
    """Whether a step's batches were all skipped after their forward (a NaN guard's `continue`): forwards, a
    NaN or Inf loss logged, no backward. The loss is the rank's own: where ranks agree to skip a batch whose
    loss is not finite on one of them, the others' losses are finite, so with more ranks a step may not end
    on it (the ranks would end steps apart); at the run's end they decide together (`skipped_at_end`)."""
    return _FORWARD_END in marks and _BACKWARD_END not in marks and _any_nonfinite(losses)


def cut_epilogue(marks: list[int], stamps: list[Any]) -> int:
    """At the run's end, cut from the open step what the loop did after its last step: the marks after the
    step's own last work (an optimizer step or a backward; a skipped step's forward) that are collectives or
    forwards only. A loop that `break`s at its step limit does so after the optimizer step, and no fetch
    comes to close the step: an evaluation's `gather_for_metrics`, a `wait_for_everyone()` before saving,
    mark into it, and closed at its last mark it would run to the last of them (the time between too: a
    stall of the last step). Between epochs the loader's end pauses the same work. A collective of the loop's
    own after the last optimizer step (a logged metric's all-reduce) goes with them: one step's wait, never
    a step's own work. Returns the forwards cut (micro-batches that were not the step's)."""
    own = len(marks) - 1
    while own >= 0 and marks[own] not in (_OPTIMIZER_END, _BACKWARD_END):
        own -= 1
    if own < 0 and _FORWARD_END in marks:
        own = len(marks) - 1 - marks[::-1].index(_FORWARD_END)
    end = len(marks)
    while own >= 0 and end - 1 > own and marks[end - 1] in _EPILOGUE:
        end -= 1
    forwards = marks[end:].count(_FORWARD_END)
    del marks[end:], stamps[end:]
    return forwards


def host_peak_rss() -> float:
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT)


class ClosedStep(NamedTuple):
    """One finished step, still as raw marks (timestamps resolve lazily, e.g. CUDA events). A tuple: it is
    built on the hot path, once per step."""

    step: int  # the step's label: the framework's number for it
    host_start_ns: int
    marks: list[int]
    stamps: list[Any]
    losses: list[Any]  # every loss logged in the step, as logged (tensors resolve at drain)
    samples: float
    mem: float
    syncs: int
    micro: int
    fingerprint: Any  # batches.fingerprint of the step's first batch, or None


class Whereabouts:
    """Where a recorder's training thread is, for another thread (the hang watchdog): reads only."""

    steps_done: int
    _marks: list[int]

    def progress(self) -> tuple[tuple[int, int, int], int | None]:
        """For another thread: a signature that changes with every mark, and the latest mark (or None), read
        through a collective of the loop's (`place_mark`). Reads only; safe while the training thread appends."""
        marks = self._marks
        n = len(marks)
        return (self.steps_done, id(marks), n), (place_mark(marks, n) if n else None)

    def pass_now(self) -> tuple[int, str]:
        """For another thread: `pass_in_step` of the open step. Reads only, from a copy (the run's end cuts the
        open step's marks in place)."""
        return pass_in_step(list(self._marks))


class StepRecorder(Whereabouts):
    """Collects one rank's steps on the training thread (autograd threads mark too, through list.append). Another
    thread (the hang watchdog) may only read through `progress()`, `pass_now()` and `pending_rows()`, which
    never mutate anything. `stop()` makes every later call a no-op, so a disabled scope holds constant memory."""

    def __init__(
        self,
        clock: Clock | None = None,
        memory: Callable[[], float] = host_peak_rss,
        host_ns: Callable[[], int] | None = None,
        step_origin: int = 1,
    ) -> None:
        self.clock: Clock = clock or HostClock()
        self._now = self.clock.now
        self._host_clock = self.clock.__class__ is HostClock  # its stamps are host nanoseconds
        self._memory = memory
        self._host_ns = host_ns or HostClock.now
        self.step_origin = step_origin  # the number the framework gives its first step (Lightning: 0)
        self.on_first_step: Callable[[], None] | None = None  # once, as the first step opens (the run starts)
        self.on_step_closed: Callable[[], None] | None = None  # the scope's gather check...
        self.notify_at = 0  # ...called once the gather key (below) reaches this
        self.notify_on_syncs = False  # key: gradient syncs (DDP) or optimizer steps
        self._last_memory = math.nan
        self._stopped = False
        self.steps_done = 0  # optimizer steps completed, counting those before a resume
        self.grad_syncs = 0
        self.micro_batches = 0
        self.window: list[ClosedStep] = []
        self.in_step = False  # a step is open: marks are recorded (plain attributes: read on the hot path)
        self.wants_fingerprint = False  # the open step is one whose first batch is fingerprinted
        self._marks: list[int] = []
        self._stamps: list[Any] = []
        self._stepped = False
        self.host_start_ns = 0  # host clock at the open (or last) step's loop top, 0 before the first step
        self._losses: list[Any] = []  # every loss logged in the open step (a skipped step merges two)
        self._samples = 0.0
        self._step_syncs = 0
        self._step_micro = 0
        self._label: int | None = None
        self.last_label: int | None = None  # the last closed step's label
        self._fingerprint: Any = None
        self.untrained_step = -1  # steps_done while the last skipped step `_ends_unstepped` ended was open
        self.ends_unstepped = False  # an unstepped step may end at a loop top (`_ends_unstepped`)
        self.iteration_steps = False  # no optimizer watched: a step is an iteration that did work
        self.long_step_marks = sys.maxsize  # an open step, unstepped, with this many marks at a loop top is
        self.on_long_step: Callable[[list[int]], None] | None = None  # shown to this (`untrained.py`)

    # -- hot path -------------------------------------------------------------------------------------
    def mark(self, mark: int) -> None:
        if self.in_step:
            self._marks.append(mark)
            self._stamps.append(self._now())

    def loop_top(self, mark: int) -> None:
        """A mark where a new iteration may begin (fetching data, or the forward when no loader is watched):
        the step whose optimizer has stepped closes here, and the next one opens with `mark`."""
        if self._stepped or (self.ends_unstepped and self.in_step and self._ends_unstepped()):
            self._close_step()
            if (self.grad_syncs if self.notify_on_syncs else self.steps_done) >= self.notify_at:
                if self.on_step_closed is not None:
                    self.on_step_closed()  # may gather (or stop the recorder): the next step starts after it
        elif self.in_step:
            self.mark(mark)
            if len(self._marks) >= self.long_step_marks and self.on_long_step is not None:
                self.on_long_step(self._marks)
            return
        if self.on_first_step is not None:  # before the step's first stamp: its time is not the step's
            start, self.on_first_step = self.on_first_step, None
            start()
        if self._stopped:
            return
        now = self._now()
        self.in_step = True
        self.wants_fingerprint = self.steps_done & 7 == 0  # every 8th step, the same steps on every rank
        self.host_start_ns = now if self._host_clock else self._host_ns()
        self._marks = [mark]  # a step's first mark is its loop top: its stamp is the step's start
        self._stamps = [now]
        self._losses = []
        self._samples = 0.0
        self._step_syncs = 0
        self._step_micro = 0
        self._label = self._fingerprint = None

    def _ends_unstepped(self) -> bool:
        """Whether the unstepped open step ends here: none watched, an iteration that did work (forward, loss);
        in one-rank runs, batches all skipped (`skipped_untrained`; not Lightning's): none trained."""
        if self.iteration_steps:
            return did_work(self._marks, self._losses)
        if self._label is None and skipped_untrained(self._marks, self._losses):
            self._step_micro = 0
            self.untrained_step = self.steps_done
            return True
        return False

    def skipped_at_end(self) -> bool:
        """Whether the open step, unstepped at the run's end, logged a NaN or Inf loss: batches a NaN guard
        skipped, to keep (`close`); with more ranks, if any rank's says so, every rank keeps its step."""
        return self.in_step and not self._stepped and _any_nonfinite(self._losses)

    def drop_unstepped(self) -> None:
        """Forget the open step if its optimizer has not stepped: what opened it (a forward before the loop's
        first batch) was not the step's, and the loop top that follows opens it afresh."""
        if self.in_step and not self._stepped:
            self.in_step = False

    @property
    def opened_at(self) -> int | None:
        """The mark the open step began with (its loop top), None with no step open."""
        return self._marks[0] if self.in_step and self._marks else None

    def forward_ended(self, samples: float) -> None:
        """A forward of the open step ended: its mark, and one more micro-batch of `samples` (NaN when
        unknown)."""
        if self.in_step:
            self._marks.append(_FORWARD_END)
            self._stamps.append(self._now())
            self._step_micro += 1
            self._samples += samples

    def optimizer_stepped(self) -> None:
        if self.in_step:
            self._marks.append(_OPTIMIZER_END)
            self._stamps.append(self._now())
            self._stepped = True
        elif not self._stopped:  # no step open (compiled after watch(), no loader): counted, not timed
            self.steps_done += 1

    def count_grad_sync(self) -> None:
        self._step_syncs += 1

    def optimizer_skipped(self, certain: bool = False) -> None:
        """No optimizer step came where one would: `zero_grad()` after a backward or, `certain`, a GradScaler's
        step on inf or NaN gradients, a step Lightning counted. The step ends here, one of its own."""
        self._stepped |= self.in_step and (certain or _BACKWARD_END in self._marks)

    def forward_untrained(self) -> None:
        """The open step's last forward had no backward (the loop skipped its batch): no micro-batch."""
        if self.in_step and self._step_micro:
            self._step_micro -= 1

    def set_loss(self, loss: Any) -> None:
        """A loss logged in the open step, one of those whose mean is the step's (see `step_losses`)."""
        if loss is not None:
            self._losses.append(loss)

    def set_fingerprint(self, fingerprint: Any) -> None:
        """The fingerprint of the open step's first batch (see `wants_fingerprint`)."""
        self._fingerprint = fingerprint
        self.wants_fingerprint = False

    def label_step(self, label: int) -> None:
        """The framework's own number for the open step (Lightning's `global_step`, with several optimizers)."""
        self._label = label

    # -- step bookkeeping -----------------------------------------------------------------------------
    def use_clock(self, clock: Clock, memory: Callable[[], float]) -> None:
        """Switch clocks before the first step (e.g. to CUDA events, with the allocator's high-water mark)."""
        self.clock = clock
        self._now = clock.now
        self._host_clock = clock.__class__ is HostClock
        self._memory = memory

    def stop(self) -> None:
        """Record nothing more: the open step is dropped, none opens again (closed steps stay for a flush)."""
        self._stopped = True
        self.in_step = self.wants_fingerprint = self._stepped = False
        self._marks, self._stamps = [], []

    def step_label(self, steps_done: int) -> int:
        """The number the framework shows for the `steps_done`-th optimizer step (1-based count)."""
        return steps_done - 1 + self.step_origin

    def current_label(self, open_step: bool = False) -> int:
        """The last closed step's label (or the open one's): the framework's own where it gave one (`label_step`)."""
        if open_step and self.in_step and self._label is not None:
            return self._label
        if not open_step and self.last_label is not None:
            return self.last_label
        return self.step_label(max(self.steps_done + (1 if open_step else 0), 1))

    @property
    def completed(self) -> tuple[int, int, int]:
        """(optimizer steps, gradient syncs, micro-batches) done so far, counting the step that has just
        stepped but not yet closed (a checkpoint saved right after `optimizer.step()` includes it)."""
        steps, syncs, micro = self.steps_done, self.grad_syncs, self.micro_batches
        if self._stepped or (self.iteration_steps and self.in_step and self._ends_unstepped()):
            return steps + 1, syncs + self._step_syncs, micro + self._step_micro
        return steps, syncs, micro

    def counters(self) -> dict[str, int]:
        """The counters a checkpoint carries (see `completed`)."""
        steps, syncs, micro = self.completed
        return {"step": steps, "grad_syncs": syncs, "micro_batches": micro}

    def restore(self, counters: dict[str, Any]) -> None:
        """Continue from a checkpoint's counters; steps recorded since are replayed after it, so dropped."""
        self.steps_done = int(counters.get("step", 0))
        self.grad_syncs = int(counters.get("grad_syncs", 0))
        self.micro_batches = int(counters.get("micro_batches", 0))
        self.last_label = None
        self.untrained_step = -1
        self.window.clear()

    def _close_step(self, at_last_mark: bool = False) -> None:
        # The recorder's own work (the memory read, the closed tuple) comes before the step's last stamp: it
        # is billed to the step it serves, so the step times add up to the loop's own wall time.
        done = self.steps_done + 1
        if done % MEMORY_EVERY == 0 or self._last_memory != self._last_memory:
            self._last_memory = self._memory()
        closed = self._as_closed(done, self._marks, self._stamps)  # shares the lists: the end stamp
        self._marks.append(_STEP_END)  # below belongs to it
        self._stamps.append(self._stamps[-1] if at_last_mark else self._now())
        # A SIGTERM handler may read `pending_rows` between any two lines: the step is in the window or the
        # open stepped step, one statement apart, and the counters move after it.
        self.window.append(closed)
        self.last_label = closed[0]
        self._stepped = False
        self.in_step = False
        self.steps_done = done
        self.grad_syncs += self._step_syncs
        self.micro_batches += self._step_micro

    def _as_closed(self, steps_done: int, marks: list[int], stamps: list[Any]) -> ClosedStep:
        # tuple.__new__, not ClosedStep(...): the named tuple's own __new__ is a Python function (hot path).
        return tuple.__new__(  # type: ignore[no-any-return]
            ClosedStep,
            (
                steps_done - 1 + self.step_origin if self._label is None else self._label,  # step_label
                self.host_start_ns,
                marks,
                stamps,
                self._losses,
                self._samples if self._step_micro else math.nan,
                self._last_memory,
                self._step_syncs,
                self._step_micro,
                self._fingerprint,
            ),
        )

    def _stepped_snapshot(self) -> ClosedStep | None:
        """The open step, if its optimizer step is done, as if it had closed at its last mark (its next loop
        top never came: a hang or a signal before it). Copies only; for another thread."""
        if not (self.in_step and self._stepped):
            return None
        stamps, marks = list(self._stamps), list(self._marks)  # stamps first: each mark precedes its stamp
        n = min(len(marks), len(stamps))
        if n == 0:
            return None
        return self._as_closed(self.steps_done + 1, [*marks[:n], _STEP_END], [*stamps[:n], stamps[n - 1]])

    def close(self, keep_skipped: bool = False) -> None:
        """End of training: close the open step at its own last work (`cut_epilogue`) if an optimizer step came
        in it (none watched: if it did work) or, `keep_skipped`, if it ran a forward or logged a loss
        (`skipped_at_end` on some rank); else drop it, but count its syncs and micro."""
        kept = keep_skipped and self.in_step and did_work(self._marks, self._losses)
        if kept and not self._stepped:
            if _BACKWARD_END not in self._marks:
                self._step_micro = 0  # none of its batches trained
            self._stepped = True
        if self._stepped or (self.iteration_steps and self.in_step and self._ends_unstepped()):
            self._step_micro = max(0, self._step_micro - cut_epilogue(self._marks, self._stamps))
            self._close_step(at_last_mark=True)
        elif self.in_step:
            self.grad_syncs += self._step_syncs
            self.micro_batches += self._step_micro
        self.in_step = False
        self.wants_fingerprint = False

    def drain(self, rank: int, segment: int, epoch_offset_s: float) -> np.ndarray:
        """Turn the closed steps into record rows (see records.COLUMNS) and empty the window.

        `epoch_offset_s` converts host perf_counter seconds to seconds since the epoch.
        """
        window, self.window = self.window, []
        stamps = [s for w in window for s in w.stamps]
        rows = closed_rows(window, stamps, self.clock, rank, segment, epoch_offset_s)
        release = getattr(self.clock, "release", None)  # (CUDA events: reused once read for the last time)
        if release is not None:
            release(stamps)
        return rows

    def pending_rows(self, rank: int, segment: int, epoch_offset_s: float) -> np.ndarray:
        """The steps not yet drained, as rows, leaving the recorder as it is: for another thread (a hang or
        SIGTERM report) while the training thread is blocked or interrupted. Closed steps never change; an
        open step whose optimizer step is done counts too. Its stamps are read, not released: the steps are
        drained again later if training goes on."""
        window = list(self.window)
        last = self._stepped_snapshot()
        if last is not None:
            window.append(last)
        stamps = [s for w in window for s in w.stamps]
        return closed_rows(window, stamps, self.clock, rank, segment, epoch_offset_s)


def closed_rows(
    window: list[ClosedStep], stamps: list[Any], clock: Clock, rank: int, segment: int, epoch_offset_s: float
) -> np.ndarray:
    """The record rows (see records.COLUMNS) of closed steps, `stamps` theirs in order, read with `clock`."""
    rows = np.full((len(window), NCOLS), np.nan)
    if not window:
        return rows
    ms = clock.to_ms(stamps)
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
    rows[:, COL["loop_comm_ms"]] = timed[:, len(PHASE_COLS) + 2]
    rows[:, COL["loss"]] = step_losses([w.losses for w in window])
    rows[:, COL["batch_fp"]] = resolve_fingerprints([w.fingerprint for w in window])
    rows[:, [COL["samples"], COL["mem_bytes"], COL["grad_syncs"], COL["micro_batches"]]] = meta[:, 2:]
    rows[:, COL["optimizer_steps"]] = [w.marks.count(_OPTIMIZER_END) for w in window]
    return rows


def step_losses(logged: list[list[Any]]) -> list[float]:
    """Each step's loss for the records: NaN when none was logged (or nothing logged was a number), +inf
    when any logged value was NaN or infinite (so a logged NaN differs from "not logged", and is never
    hidden by a later one, e.g. in an iteration whose optimizer step a GradScaler skipped, which merges into
    the next step), else the mean of those logged: a gradient-accumulation window's micro-batches."""
    flat = [loss for losses in logged for loss in losses]
    values = iter(to_floats(flat))
    out = []
    for losses in logged:
        vals = [v for v in (next(values) for _ in losses) if v is not None]  # None: not a number
        if not vals:
            out.append(math.nan)
        elif all(math.isfinite(v) for v in vals):
            out.append(math.fsum(vals) / len(vals))
        else:
            out.append(math.inf)
    return out


def pass_in_step(marks: list[int]) -> tuple[int, str]:
    """The forwards begun in a step's marks, and the pass its latest marks are in: "forward" after a forward
    began, "backward" once it ended or a backward began ("" before any). Inside FSDP's collectives this is
    what tells a forward's all-gather from a backward's reduce-scatter: both are the same phase, at the same
    step and gradient-sync counts."""
    forwards = marks.count(_FORWARD_BEGIN)
    for i in range(len(marks) - 1, -1, -1):
        if marks[i] == _FORWARD_BEGIN:
            return forwards, "forward"
        if marks[i] in (_FORWARD_END, _BACKWARD_BEGIN):
            return forwards, "backward"
    return forwards, ""


def place_mark(marks: list[int], n: int) -> int:
    """The latest of the first `n` marks, or, where that ends a collective of the loop's (a barrier, a metric's
    all-reduce), the mark before that collective began: where the loop is in the step's order, which the
    watchdog compares across ranks."""
    depth, i = 0, n - 1
    while i >= 0 and (depth or marks[i] == _LOOP_COMM_END):  # (back to back: the one before all of them)
        depth += (marks[i] == _LOOP_COMM_END) - (marks[i] == _LOOP_COMM_BEGIN)
        i -= 1
    return marks[i] if i >= 0 and not depth else marks[n - 1]
