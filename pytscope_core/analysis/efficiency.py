"""Where the wall time goes and how much of it bought training: the budget, goodput across restarts, MFU.

The budget splits counted wall time into useful compute (forward + backward), data wait, exposed transfer,
sync wait (imbalance: the straggler's bill, never communication cost), optimizer and other; the lines add up
to 1 and say which could be won back. Where communication is not measured (`parallelism.py`), its two lines say
"not measured" (share NaN) and forward + backward is not called useful compute: the waits are inside it. Goodput is the wall time of counted steps over the elapsed time of the
whole job, with the losses named: downtime between segments, steps replayed after a resume, warm-up, a
launch's time stuck in a hang (after its last step, until the watchdog reported it), and what no step covers
(start-up, validation, checkpoints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..arrays import RunArrays
from ..context import RunContext
from ..records import COL
from . import stats
from .distributed import DistributedTiming
from .timing import StepTiming, counted_steps

OPTIMIZER_HEAVY_SHARE = 0.25
"""The optimizer line is recoverable from a quarter of the step on: an optimizer step is needed work, but one
that long is rarely necessary (a per-parameter loop where a foreach or fused implementation exists, host
syncs inside a custom step, unsharded state)."""


@dataclass(frozen=True)
class BudgetLine:
    name: str
    share: float  # of counted wall time; the lines of a budget sum to 1
    ms_per_step: float
    recoverable: bool
    measured: bool = True  # False: share and ms are NaN, the time hides in another line


@dataclass(frozen=True)
class SegmentSpan:
    index: int
    started_s: float
    ended_s: float
    first_step: int
    last_step: int
    steps: int
    resumed_from_step: int
    world_size: int


@dataclass(frozen=True)
class Goodput:
    elapsed_s: float  # first segment start to last step end (or a hang report after it)
    productive_s: float  # wall of counted steps (rank mean)
    goodput: float  # productive_s / elapsed_s
    downtime_s: float  # gaps between one segment's last step and the next segment's start
    replayed_s: float  # wall of steps redone after a resume (rank mean)
    warmup_s: float  # wall of steps left out of statistics
    excluded_s: float  # validation, checkpoints ... inside steps
    hang_s: float  # time launches spent stuck in a hang: after their last step, until its report (`_hung`)
    unaccounted_s: float  # elapsed time no step covers (start-up, teardown, gaps inside a segment) but a hang
    segments: tuple[SegmentSpan, ...]


@dataclass(frozen=True)
class Efficiency:
    budget: tuple[BudgetLine, ...]
    recoverable_share: float
    mfu: float | None  # model FLOPs utilisation, None when FLOPs per step or the peak is unknown
    goodput: Goodput


def budget(timing: StepTiming, dist: DistributedTiming, comm_measured: bool = True) -> tuple[BudgetLine, ...]:
    share = {p.name: p.share for p in timing.phases}
    comm = share["comm"]
    transfer = min(max(dist.transfer_share, 0.0), comm) if comm_measured else math.nan
    compute = "useful compute" if comm_measured else "compute + unmeasured comm"
    lines = (  # name, share, recoverable, measured
        (compute, share["forward"] + share["backward"], False, True),
        ("data wait", share["data"], True, True),
        ("exposed transfer", transfer, comm_measured, comm_measured),
        ("sync wait (imbalance)", comm - transfer, comm_measured, comm_measured),
        ("optimizer", share["optimizer"], share["optimizer"] >= OPTIMIZER_HEAVY_SHARE, True),
        ("other", share["other"], True, True),
    )
    mean = timing.mean_ms if math.isfinite(timing.mean_ms) else 0.0
    return tuple(  # (a line with no time in it has nothing to recover: one rank's transfer and sync wait)
        BudgetLine(name, float(s), float(s * mean), rec and s > 0, measured)
        for name, s, rec, measured in lines
    )


def mfu(ctx: RunContext, timing: StepTiming) -> float | None:
    """FLOPs per step per rank over (mean step seconds x device peak); None when either is unknown."""
    if not ctx.flops_per_step or not ctx.peak_flops or not timing.mean_ms > 0:
        return None
    return float(ctx.flops_per_step / (timing.mean_ms / 1e3) / ctx.peak_flops)


def _per_step(x: np.ndarray, reduce: str) -> np.ndarray:
    """Reduce (S, R) over ranks, reading one column when the array is a broadcast of one value per step."""
    if x.shape[1] == 0:
        return np.full(x.shape[0], np.nan)
    if x.strides[1] == 0:
        return np.asarray(x[:, 0], dtype=np.float64)
    with np.errstate(all="ignore"):
        if np.isnan(x).all(axis=1).any():
            x = np.where(np.isnan(x), -np.inf if reduce == "max" else np.inf, x)
            out = x.max(axis=1) if reduce == "max" else x.min(axis=1)
            return np.where(np.isfinite(out), out, np.nan).astype(np.float64)
        return np.asarray(np.nanmax(x, axis=1) if reduce == "max" else np.nanmin(x, axis=1), np.float64)


def goodput(arrays: RunArrays, ctx: RunContext, wall: np.ndarray, sel: np.ndarray) -> Goodput:
    """Goodput over all segments; `wall` is the (S,) rank-mean step wall, `sel` the counted steps."""
    n = arrays.n_steps
    world = max(arrays.world_size, 1)
    seg = _per_step(arrays.segment, "max")
    seg = np.where(np.isfinite(seg), seg, 0.0).astype(np.int64)
    start = _per_step(arrays.start_s, "min")
    end = start + _per_step(arrays.wall_ms, "max") / 1e3
    rep = arrays.replayed
    rep_seg = rep[:, COL["segment"]].astype(np.int64) if rep.size else np.empty(0, np.int64)
    rep_end = rep[:, COL["start_s"]] + rep[:, COL["wall_ms"]] / 1e3 if rep.size else np.empty(0)
    rep_wall = float(np.nansum(rep[:, COL["wall_ms"]])) / world / 1e3 if rep.size else 0.0

    known = {s.index: s for s in ctx.segments}
    spans = []
    hung = 0.0
    for index in sorted(set(seg.tolist()) | set(rep_seg.tolist()) | set(known)):
        mine = seg == index
        ends = np.concatenate((end[mine], rep_end[rep_seg == index]))
        starts = np.concatenate((start[mine], rep[rep_seg == index, COL["start_s"]] if rep.size else []))
        ends, starts = ends[np.isfinite(ends)], starts[np.isfinite(starts)]
        info = known.get(index)
        began = info.started_s if info else (float(starts.min()) if starts.size else math.nan)
        # A launch that hung ran, stuck, at least until its hang report: that time is lost, not absent.
        reported = [t for s, t in ctx.alive if s == index]
        hung += _hung(ctx, index, float(ends.max()) if ends.size else None, began, reported)
        ends = np.concatenate((ends, reported))
        steps = arrays.steps[mine]
        resumed = info.resumed_from_step if info else 0
        if resumed > 0:
            replayed = rep[rep_seg == index, COL["step"]] if rep.size else np.empty(0)
            resumed = _resumed_label(resumed, ctx.step_origin, steps, replayed)
        spans.append(
            SegmentSpan(
                index=int(index),
                started_s=float(began),
                ended_s=float(ends.max()) if ends.size else float(began),
                first_step=int(steps.min()) if steps.size else 0,
                last_step=int(steps.max()) if steps.size else 0,
                steps=int(steps.size),
                resumed_from_step=resumed,
                world_size=info.world_size if info else arrays.world_size,
            )
        )
    downtime = sum(max(0.0, b.started_s - a.ended_s) for a, b in zip(spans, spans[1:], strict=False))
    begun = [s.started_s for s in spans if math.isfinite(s.started_s)]
    ended = [s.ended_s for s in spans if math.isfinite(s.ended_s)]
    elapsed = max(ended) - min(begun) if begun and ended else 0.0
    finite_wall = np.where(np.isfinite(wall), wall, 0.0)
    productive = float(finite_wall[sel].sum()) / 1e3 if n else 0.0
    warmup = float(finite_wall[~sel].sum()) / 1e3 if n else 0.0
    # Rank means, like the step wall: a pause on rank 0 and its peers' wait for it in the next step (moved to
    # excluded as well) are one stretch of the job's time, not two.
    excluded = float(np.nansum(stats.mean_over_ranks(arrays.excluded_ms))) / 1e3 if n else 0.0
    accounted = productive + warmup + excluded + rep_wall + downtime + hung
    elapsed = max(elapsed, accounted)  # clocks of different hosts can disagree; never report goodput > 1
    return Goodput(
        elapsed_s=elapsed,
        productive_s=productive,
        goodput=productive / elapsed if elapsed > 0 else math.nan,
        downtime_s=downtime,
        replayed_s=rep_wall,
        warmup_s=warmup,
        excluded_s=excluded,
        unaccounted_s=max(0.0, elapsed - accounted),
        segments=tuple(spans),
        hang_s=hung,
    )


def _resumed_label(count: int, origin: int, kept: np.ndarray, replayed: np.ndarray) -> int:
    """The step a launch resumed from, in the framework's numbers as every other step is: the launch's first
    step, less the number the framework gives its first (Lightning's `global_step` at the checkpoint, which
    with two optimizers is twice the steps done). `count`, the steps done, where the launch recorded none."""
    labels = np.concatenate((kept, replayed))
    return int(labels.min()) - origin if labels.size else count


def _hung(
    ctx: RunContext, segment: int, last_end: float | None, began: float, reported: list[float]
) -> float:
    """Seconds launch `segment` spent stuck in a hang: from the end of its last recorded step (the step the
    ranks then began is the one the hang stopped) to its latest hang report. A report that the launch's steps
    went on past was a stall inside a step, whose time the step holds: none here. A launch that hung before
    its first step recorded has no step to start from: its reports' longest wait (the watchdog's `idle_s`),
    within the launch, is the hang, and what came before it start-up."""
    if not reported:
        return 0.0
    if last_end is not None:
        return max(0.0, max(reported) - last_end)
    waits = [
        float(v)
        for h in ctx.hang_reports
        if h.get("segment") == segment
        for k, v in (h.get("evidence") or {}).items()
        if k.startswith("idle_s_rank") and isinstance(v, (int, float)) and math.isfinite(v)
    ]
    return min(max(waits), max(0.0, max(reported) - began)) if waits and math.isfinite(began) else 0.0


def efficiency(
    arrays: RunArrays,
    ctx: RunContext,
    timing: StepTiming,
    dist: DistributedTiming,
    wall: np.ndarray,
    sel: np.ndarray,
) -> Efficiency:
    lines = budget(timing, dist, ctx.comm_measured)
    return Efficiency(
        budget=lines,
        recoverable_share=float(sum(line.share for line in lines if line.recoverable)),
        mfu=mfu(ctx, timing),
        goodput=goodput(arrays, ctx, wall, counted_steps(arrays)),  # (skipped batches are not warm-up)
    )


def unrecorded_steps(spans: tuple[SegmentSpan, ...], steps: np.ndarray) -> tuple[tuple[int, int], ...]:
    """(first, last) step ranges that no launch recorded, between one launch's last record and the first of the
    next, which resumed past them: steps that ran (a checkpoint saved after them was resumed) but whose records
    went with the launch that ran them (killed before its next gather). Its time after its last record is
    downtime. `steps`: the run's step labels, whose spacing (2 under Lightning with two optimizers) is no gap."""
    labels = np.unique(steps)
    stride = int(np.diff(labels).min()) if labels.size > 1 else 1
    return tuple(
        (a.last_step + stride, b.first_step - stride)
        for a, b in zip(spans, spans[1:], strict=False)
        if a.steps and b.steps and b.resumed_from_step > 0 and b.first_step - a.last_step > stride
    )
