"""Marks on a step's timeline, and the pure function that turns them into phase times.

Hooks only append `(mark, timestamp)` pairs while a step runs; the attribution happens later, off the hot
path. Every interval between two consecutive marks goes to exactly one phase (the innermost one open), so
the phases of a step always add up to its wall time, whatever order the hooks fire in.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from .records import PHASES


class Mark(enum.IntEnum):
    STEP_START = 0  # a step start with no loop-top mark of its own (the recorder opens with the loop top's)
    DATA_BEGIN = 1
    DATA_END = 2
    FORWARD_BEGIN = 3
    FORWARD_END = 4
    BACKWARD_BEGIN = 5
    GRAPH_DONE = 6  # autograd graph computed; the rest of backward is waiting for gradient all-reduce
    BACKWARD_END = 7
    OPTIMIZER_BEGIN = 8
    OPTIMIZER_END = 9
    PAUSE_BEGIN = 10  # validation, checkpointing, epoch ends: not charged to the step
    PAUSE_END = 11
    STEP_END = 12  # next loop top
    COMM_BEGIN = 13  # a collective's wait starts inside another phase (FSDP's all-gathers, reduce-scatters)
    COMM_END = 14  # ...and ends: the enclosing phase (forward, backward) resumes
    LOOP_COMM_BEGIN = 15  # a wait in a collective the loop calls itself (a barrier, a metric's all-reduce)
    LOOP_COMM_END = 16  # ...ends: as COMM_BEGIN/COMM_END, told apart only by where a hung rank waits


DATA, FORWARD, BACKWARD, COMM, OPTIMIZER, OTHER = range(len(PHASES))
EXCLUDED = len(PHASES)
LOOP_COMM = EXCLUDED + 1  # comm, in a collective the loop calls itself: counted in COMM, and apart too

# mark -> (phase it opens or None, phase it closes or None)
_TRANSITIONS: dict[int, tuple[int | None, int | None]] = {
    Mark.DATA_BEGIN: (DATA, None),
    Mark.DATA_END: (None, DATA),
    Mark.FORWARD_BEGIN: (FORWARD, None),
    Mark.FORWARD_END: (None, FORWARD),
    Mark.BACKWARD_BEGIN: (BACKWARD, None),
    Mark.GRAPH_DONE: (COMM, BACKWARD),
    Mark.BACKWARD_END: (None, COMM),
    Mark.OPTIMIZER_BEGIN: (OPTIMIZER, None),
    Mark.OPTIMIZER_END: (None, OPTIMIZER),
    Mark.PAUSE_BEGIN: (EXCLUDED, None),
    Mark.PAUSE_END: (None, EXCLUDED),
    Mark.COMM_BEGIN: (COMM, None),  # nested: the innermost open phase wins, so the wait is comm, not forward
    Mark.COMM_END: (None, COMM),
    Mark.LOOP_COMM_BEGIN: (LOOP_COMM, None),
    Mark.LOOP_COMM_END: (None, LOOP_COMM),
}
_NESTED_ENDS = (Mark.COMM_END, Mark.LOOP_COMM_END)


def attribute(marks: Sequence[int], times_ms: Sequence[float]) -> tuple[list[float], float, float]:
    """Phase times of one step from its marks.

    `marks[0]` is the step's first mark (STEP_START, or the loop top's own mark, e.g. DATA_BEGIN) and the
    last is STEP_END; `times_ms` are their timestamps on one clock. Returns (per-phase ms in PHASES order,
    excluded ms, wall ms), where wall = span - excluded and the phases sum to wall. A close without its open
    is ignored; an open never closed runs to the step end.
    """
    acc = _attributed(marks, times_ms)
    return (
        acc[: len(PHASES)],
        acc[EXCLUDED],
        (times_ms[-1] - times_ms[0] - acc[EXCLUDED] if len(marks) > 1 else 0.0),
    )


def _attributed(marks: Sequence[int], times_ms: Sequence[float]) -> list[float]:
    """ms per phase (PHASES order), then excluded, then the part of COMM spent in the loop's own collectives."""
    acc = [0.0] * (LOOP_COMM + 1)
    if len(marks) < 2:
        return acc
    stack: list[int] = []
    prev = times_ms[0]
    for mark, t in zip(marks, times_ms, strict=False):  # (the first interval is empty)
        phase = stack[-1] if stack else OTHER
        acc[COMM if phase == LOOP_COMM else phase] += t - prev
        if phase == LOOP_COMM:
            acc[LOOP_COMM] += t - prev
        prev = t
        opens, closes = _TRANSITIONS.get(mark, (None, None))
        if closes is not None and closes in stack:
            innermost = len(stack) - 1 - stack[::-1].index(closes)
            # A nested wait's end resumes what opened during it (backward can begin in the wait for FSDP's
            # all-gather before it); any other close also ends what opened inside it.
            del stack[innermost : innermost + 1 if mark in _NESTED_ENDS else None]
        if opens is not None:
            stack.append(opens)
    return acc


_PATTERNS: dict[tuple[int, ...], np.ndarray] = {}


def _pattern_matrix(marks: tuple[int, ...]) -> np.ndarray:
    """For a sequence of marks: which phase (or EXCLUDED) each interval between consecutive marks goes to, and
    whether it is in a loop's collective, as an (intervals x phases+2) 0/1 matrix. Found once per distinct
    sequence by `_attributed` itself."""
    m = _PATTERNS.get(marks)
    if m is None:
        n = len(marks) - 1
        m = np.zeros((n, LOOP_COMM + 1))
        for i in range(n):
            times = [0.0] * (i + 1) + [1.0] * (n - i)  # only interval i has length 1
            m[i] = _attributed(marks, times)
        if len(_PATTERNS) < 4096:
            _PATTERNS[marks] = m
    return m


def attribute_many(marks: Sequence[Sequence[int]], times_ms: Sequence[float] | np.ndarray) -> np.ndarray:
    """`attribute` for a window of steps: (n, phases + 3) array of phase ms, excluded ms, wall ms, and the ms
    of comm spent in the loop's own collectives.

    `times_ms` is every step's timestamps one after another (flat). Training loops repeat the same sequence
    of marks step after step, so steps are grouped by their sequence and each group is one matrix product
    instead of a Python loop over marks.
    """
    n = len(marks)
    out = np.zeros((n, len(PHASES) + 3))
    flat = np.asarray(times_ms, dtype=np.float64)
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(m) for m in marks], out=starts[1:])
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, m in enumerate(marks):
        groups.setdefault(tuple(m), []).append(i)
    for pattern, idx in groups.items():
        width = len(pattern)
        if width < 2:
            continue
        rows = np.asarray(idx)
        t = flat[starts[rows, None] + np.arange(width)]
        parts = np.diff(t, axis=1) @ _pattern_matrix(pattern)
        out[rows, : len(PHASES) + 1] = parts[:, : EXCLUDED + 1]
        out[rows, len(PHASES) + 1] = (t[:, -1] - t[:, 0]) - parts[:, EXCLUDED]
        out[rows, len(PHASES) + 2] = parts[:, LOOP_COMM]
    return out
