"""A run as a Chrome trace (Perfetto, chrome://tracing): one process per rank, steps and phases on real time.

Each step is a complete ("X") slice starting at the rank's recorded loop-top time, and its phases are slices
inside it laid end to end in PHASES order. The records hold how long each phase took, not when, so the order
inside a step is canonical, not observed; the trace's `otherData` says so. Time excluded from the step
(validation, checkpoints) closes the step as its own slice. Restarts (the first step of each later segment)
and findings (at their first step, on their ranks) are instant ("i") events. Timestamps are microseconds from
the run's first loop top (the epoch origin is in `otherData`), which keeps them small enough for full
precision. Events are written one at a time, and the trace keeps at most the latest `max_steps` steps and
`MAX_STEP_SLICES` (step x rank) slices, so a huge run gives a file a viewer can open.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .arrays import RunArrays
from .findings import Finding
from .records import PHASES

DEFAULT_MAX_STEPS = 20_000
MAX_STEP_SLICES = 200_000
"""(step x rank) slices at most: about 1.4 M events and 150 MB of JSON, near what Perfetto's UI opens well."""


@dataclass(frozen=True)
class TraceInfo:
    path: Path
    events: int
    ranks: int
    steps_written: int
    steps_total: int
    first_step: int | None  # first step written (the latest steps are kept)


def steps_to_keep(arrays: RunArrays, max_steps: int) -> int:
    """How many of the latest steps fit in both the step cap and the slice cap."""
    per_rank_cap = max(1, MAX_STEP_SLICES // max(arrays.world_size, 1))
    return min(arrays.n_steps, max(max_steps, 1), per_rank_cap)


def trace_events(
    arrays: RunArrays, findings: Sequence[Finding] = (), max_steps: int = DEFAULT_MAX_STEPS
) -> Iterator[dict[str, Any]]:
    """The trace events in order: process names, then per rank its steps with their phases, then instants."""
    keep = steps_to_keep(arrays, max_steps)
    lo = arrays.n_steps - keep
    start = np.asarray(arrays.start_s)
    finite = np.isfinite(start)
    origin = float(start[finite].min()) if finite.any() else 0.0
    for rank in arrays.ranks:
        yield {
            "name": "process_name",
            "ph": "M",
            "pid": int(rank),
            "tid": 0,
            "args": {"name": f"rank {int(rank)}"},
        }
        yield {
            "name": "process_sort_index",
            "ph": "M",
            "pid": int(rank),
            "tid": 0,
            "args": {"sort_index": int(rank)},
        }
    for j, rank in enumerate(arrays.ranks):
        pid = int(rank)
        phases = np.asarray(arrays.phases[lo:, j, :], dtype=np.float64)
        walls = np.asarray(arrays.wall_ms[lo:, j], dtype=np.float64)
        excluded = np.nan_to_num(np.asarray(arrays.excluded_ms[lo:, j], dtype=np.float64))
        starts = start[lo:, j]
        for k in range(keep):
            t0, wall = starts[k], walls[k]
            if not (math.isfinite(t0) and math.isfinite(wall)):
                continue  # no record for this rank in this step
            # Whole nanoseconds: slice edges computed once and shared, so rounding never lets a phase poke
            # out of its step (viewers drop or mis-nest slices that overlap their parent by a hair).
            t_ns = round((t0 - origin) * 1e9)
            ph = np.nan_to_num(phases[k])
            edges = [t_ns, *(t_ns + int(x) for x in np.rint(np.cumsum(ph) * 1e6))]
            end_ns = max(t_ns + round(wall * 1e6), edges[-1])
            excl_ns = round(excluded[k] * 1e6)
            step = int(arrays.steps[lo + k])
            yield {"name": f"step {step}", "cat": "step", "ph": "X", "pid": pid, "tid": 0, "ts": t_ns / 1e3,
                   "dur": (end_ns + excl_ns - t_ns) / 1e3, "args": {"step": step, "wall_ms": float(wall)}}  # fmt: skip
            for p, name in enumerate(PHASES):
                if edges[p + 1] > edges[p]:
                    yield {"name": name, "cat": "phase", "ph": "X", "pid": pid, "tid": 0, "ts": edges[p] / 1e3,
                           "dur": (edges[p + 1] - edges[p]) / 1e3, "args": {"step": step}}  # fmt: skip
            if excl_ns > 0:
                yield {"name": "excluded (validation, checkpoint ...)", "cat": "excluded", "ph": "X", "pid": pid,
                       "tid": 0, "ts": end_ns / 1e3, "dur": excl_ns / 1e3, "args": {"step": step}}  # fmt: skip
    yield from _instants(arrays, findings, lo, origin)


def _step_ts(arrays: RunArrays, i: int, origin: float) -> float | None:
    row = np.asarray(arrays.start_s[i])
    ok = row[np.isfinite(row)]
    return round((float(ok.min()) - origin) * 1e9) / 1e3 if ok.size else None


def _instants(
    arrays: RunArrays, findings: Sequence[Finding], lo: int, origin: float
) -> Iterator[dict[str, Any]]:
    with np.errstate(all="ignore"):
        seg = np.nanmax(np.where(np.isnan(arrays.segment), -np.inf, arrays.segment), axis=1)
    for i in range(max(lo, 1), arrays.n_steps):
        if seg[i] > seg[i - 1]:
            ts = _step_ts(arrays, i, origin)
            if ts is not None:
                step = int(arrays.steps[i])
                yield {"name": f"restart (segment {int(seg[i])})", "cat": "restart", "ph": "i", "s": "g",
                       "pid": int(arrays.ranks[0]), "tid": 0, "ts": ts, "args": {"first_step": step}}  # fmt: skip
    index = {int(s): i for i, s in enumerate(arrays.steps)}
    ranks = {int(r) for r in arrays.ranks}
    for f in findings:
        # A finding with no step is pinned to the start of the trace.
        i = index.get(f.steps[0], lo) if f.steps else lo
        if i < lo or arrays.n_steps == 0:
            continue
        ts = _step_ts(arrays, i, origin)
        if ts is None:
            continue
        args = {"code": f.code, "severity": f.severity.name, "detail": f.detail, "ranks": list(f.ranks)}
        on = [r for r in f.ranks if r in ranks]
        for pid in on or [int(arrays.ranks[0])]:
            yield {"name": f"{f.code}: {f.title}", "cat": "finding", "ph": "i", "s": "p" if on else "g",
                   "pid": pid, "tid": 0, "ts": ts, "args": args}  # fmt: skip


def write_chrome_trace(
    arrays: RunArrays,
    path: str | Path,
    findings: Sequence[Finding] = (),
    max_steps: int = DEFAULT_MAX_STEPS,
    run_name: str = "",
) -> TraceInfo:
    """Write `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}` to `path`, streaming."""
    out = Path(path)
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    keep = steps_to_keep(arrays, max_steps)
    start = np.asarray(arrays.start_s)
    finite = start[np.isfinite(start)]
    other = {
        "run": run_name,
        "origin_epoch_s": float(finite.min()) if finite.size else None,
        "phase_order": "canonical, not observed: phases of a step are laid end to end in the order "
        + ", ".join(PHASES)
        + "; their durations are measured, their order inside the step is not",
        "steps_written": keep,
        "steps_total": arrays.n_steps,
    }
    count = 0
    with open(out, "w") as f:
        f.write('{"displayTimeUnit": "ms", "otherData": ')
        f.write(json.dumps(other))
        f.write(', "traceEvents": [\n')
        for event in trace_events(arrays, findings, max_steps):
            f.write((",\n" if count else "") + json.dumps(event, allow_nan=False))
            count += 1
        f.write("\n]}\n")
    first = int(arrays.steps[arrays.n_steps - keep]) if keep else None
    return TraceInfo(out, count, arrays.world_size, keep, arrays.n_steps, first)
