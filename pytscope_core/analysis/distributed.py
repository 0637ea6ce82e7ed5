"""Cross-rank timing: each rank's local work, who is on the critical path, and what waiting costs.

A rank's *local work* is its step wall less its exposed communication. The rank with the most local work in
a step is on that step's critical path: everyone else waits for it inside the gradient all-reduce. Exposed
communication is split into *transfer*, estimated per step as the least-blocked rank's communication (what
even the last rank to arrive pays), and *sync wait* (the rest: waiting for slower peers). The split is an
estimate (docs/MEASUREMENTS.md, item 5): with several buckets it understates transfer, so reports say so. A straggler is
judged on local work with three gates (relative excess, persistence, and real wall time lost), because a
significance test alone grows with the number of steps and the max of many noisy ranks always looks slow.
Where communication is not measured (FSDP1, DeepSpeed, tensor parallel: `parallelism.py`), the waits sit
inside compute and local work would be plain wall time, equal on every rank: the comparison is switched off
and the result says why, instead of declaring the job balanced.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..arrays import RunArrays, step_segments
from ..parallelism import comm_note
from ..placement import Placement
from ..records import PHASES
from . import stats
from .timing import STALL_FACTOR

STRAGGLER_MIN_EXCESS = 0.045
"""Median local work >= 4.5% above the other ranks' median: healthy ranks differ by noise, not by this much."""
STRAGGLER_MIN_PERSISTENCE = 0.70
"""Slower than the others' median in >= 70% of steps: healthy 2-rank runs alternate 33-65% (docs/MEASUREMENTS.md, item 3)."""
STRAGGLER_LARGE_EXCESS = 3 * STRAGGLER_MIN_EXCESS
"""From this median excess on, STRAGGLER_LARGE_PERSISTENCE replaces STRAGGLER_MIN_PERSISTENCE."""
STRAGGLER_LARGE_PERSISTENCE = 0.60
"""A median excess 3x the floor (13.5%) needs less consistency, >= 60% of steps: 4 ranks on 2 cores made a rank
+18% and +28% slower by median the slower one in only 66% and 70% of its steps. Healthy ranks' medians differ
by ~2% (docs/MEASUREMENTS.md, item 3), nowhere near this."""
STRAGGLER_MIN_Z = 3.0
"""Binomial z of that persistence against a fair coin: keeps 200-step windows from flagging luck."""
STRAGGLER_MIN_COST_SHARE = 0.02
"""The slow ranks' extra local work over the next-slowest rank must cost >= 2% of wall to be worth fixing."""

STRAGGLER_STALL = STALL_FACTOR
"""A step where some rank's own work took 10x the slowest rank's in the median step is a stall (TIMING.STALL's
factor, without its 100 ms floor: a 50 ms pause in a 4 ms step is no usual lag either), left out of what a
straggler costs. Slow steps short of that stay in: the 1.2-2x hiccups every rank has now and then are part of
its usual work (leaving out steps from 1.5x the median lost 4 of 10 detections of a 5% straggler among 8
ranks in benchmarks/detection.py)."""

LATE_TAILS = (2, 4, 8)
"""A straggler's time course: the last and the first 1/2, 1/4 and 1/8 of the window's steps (each of at least
LATE_MIN_STEPS) are tried for one that began late or that stopped, whether or not the whole window names it:
a rank +80% slower from step 800 of 1,300 moved the run's medians by 7% only, and its whole-run numbers said
nothing; one +89% slower from step 150 of 300 passed the whole run's gates (on 2 ranks the healthy half is
slower in about half of its steps by chance) with its numbers blended and its onset lost. The same gates
apply; a part is judged only where its slowest rank's median local work is STRAGGLER_MIN_EXCESS above the
others' there and by that much more than over the rest of the window (a cheap screen, per rank, not per
step)."""
LATE_MIN_STEPS = 100
"""...and a straggler is said to have stopped only after this many steps without it."""
LATE_SCREEN_STEPS = 256

INTERMITTENT_SLOW = 1.5
"""Slow steps take at least 1.5x the median step (TIMING.JITTER's p95 ratio) and INTERMITTENT_SIGMAS robust
sigmas above it (on a busy host a third of the steps can be 1.5x the median: the rank's own slow steps would
drown in them), and there are at least INTERMITTENT_MIN_STEPS of them."""
INTERMITTENT_SIGMAS = 6.0
INTERMITTENT_MIN_STEPS = 5
INTERMITTENT_SHARE = 2 / 3
"""A rank is an intermittent straggler when its own work grew the most in at least 2/3 of the slow steps
(and beyond chance: binomial z >= INTERMITTENT_Z against 1/W), by at least half of what those steps took
beyond the median step, and by 3x what the other ranks' own work grew there (a slow host slows every rank's
own work; a rank slow on its own leaves the others waiting)."""
INTERMITTENT_Z = 3.0

_DATA = PHASES.index("data")
_COMM = PHASES.index("comm")


@dataclass(frozen=True)
class RankTiming:
    rank: int
    local_ms: float  # median local work per step (wall - exposed comm)
    comm_ms: float  # median exposed communication per step (transfer + sync wait)
    sync_wait_ms: float  # median per step of comm - the step's transfer estimate
    data_ms: float  # median data wait per step
    data_mean_ms: float  # mean data wait per step: what data_share is made of (waits come in bursts)
    data_share: float  # data wait as a share of this rank's wall
    critical_share: float  # fraction of counted steps where this rank has the most local work
    excess: float  # median over steps of local work / median of the other ranks' local work - 1
    slower_share: float  # fraction of steps with local work above the other ranks' median
    z: float  # binomial z of slower_share against 0.5
    straggler: bool
    extra_phase: str | None = None  # straggler candidates: the phase holding most of the extra local work
    extra_phase_ms: float = 0.0  # ...and by how much its median exceeds the other ranks' (ms per step)


@dataclass(frozen=True)
class CountDivergence:
    """First step where a rank's count of gradient syncs or of optimizer steps departs from the majority's
    (from there its cumulative count differs)."""

    counter: str  # "grad_syncs" or "optimizer_steps" (the records' column)
    step: int
    ranks: tuple[int, ...]
    counts: tuple[float, ...]  # those ranks' counts in that step
    majority: float  # NaN: no majority (`majority`), every rank is listed


@dataclass(frozen=True)
class Intermittent:
    """A rank that makes most of the slowest steps slow while the others wait for it: a straggler now and
    then (every 10th step, say), which per-rank medians do not see."""

    rank: int
    phase: str  # its phase that grows most in those steps (communication aside)
    extra_ms: float  # its local work in those steps above its median (median over them)
    steps: int  # how many of the slow steps (INTERMITTENT_SLOW) it made slow
    slow_steps: int  # the slow steps, how many
    every: int | None  # the most common spacing of those steps, when at least half of the gaps have it


@dataclass(frozen=True)
class DistributedTiming:
    per_rank: tuple[RankTiming, ...]
    stragglers: tuple[int, ...]  # ranks passing every gate (one: a straggler; several: load imbalance)
    candidates: tuple[int, ...]  # ranks passing excess and persistence, before the wall-cost gate
    transfer_ms: float  # median per step of the least-blocked rank's exposed comm
    transfer_share: float  # transfer as a share of step wall
    sync_wait_share: float  # mean rank's sync wait as a share of its wall
    lost_to_imbalance: float  # the candidates' extra local work over the next-slowest rank, share of wall
    lost_ms_per_step: float  # the same, in ms per counted step
    next_slowest_local_ms: float  # median local work of the slowest rank outside the candidates
    steps_counted: int
    count_divergence: CountDivergence | None = None
    split_is_estimate: bool = True
    comm_measured: bool = True  # False: local work, the straggler gates and the transfer split are off
    note: str | None = None  # why, when they are off
    hosts: tuple[str, ...] = ()  # per_rank's hosts, in its order (empty: placement unknown)
    local_ranks: tuple[int, ...] = ()  # ...and local ranks
    intermittent: Intermittent | None = None  # a rank that makes most of the slow steps slow
    # Of transfer_ms: the least-blocked rank's time in collectives the loop calls itself (a barrier, a logging
    # all-reduce, Lightning's per-batch SIGTERM broadcast), not gradient communication; NaN where not recorded
    loop_transfer_ms: float = math.nan
    since: int | None = None  # this analysis covers the steps from this one on (a straggler that began late)
    until: int | None = None  # ...and before this one (a straggler that stopped): see `late` and `ended`
    lost_share_of_window: float = math.nan  # a straggler's span: its lost time, of the window's wall
    late: DistributedTiming | None = None  # a straggler that began late and still is one: its steps' analysis
    ended: DistributedTiming | None = None  # a straggler that stopped before the window's end: its steps'

    def rank(self, rank: int) -> RankTiming:
        return next(r for r in self.per_rank if r.rank == rank)

    @property
    def effective(self) -> DistributedTiming:
        """The analysis whose stragglers count: over the steps a straggler ran slow where it began late or
        stopped (`late`, `ended`), else the whole window's. The finding, the summary, the plot and the live
        metric all read this."""
        return self.late or self.ended or self

    @property
    def cost_share(self) -> float:
        """What the stragglers cost as a share of wall: of the steps they slow now, or, for one that stopped,
        of the whole window's (it slows none now)."""
        return self.lost_share_of_window if self.until is not None else self.lost_to_imbalance


def distributed_timing(
    arrays: RunArrays,
    sel: np.ndarray,
    comm_measured: bool = True,
    parallelism: str | None = None,
    records_lost: bool = False,
    joins: tuple[tuple[int, int], ...] = (),
) -> DistributedTiming:
    """Per-rank local work and the straggler gates over the steps in `sel` (S,) bool; with communication not
    measured under `parallelism`, only the data waits and the sync-count check (over every step; a step
    missing on one rank counts as diverged unless the reader dropped `records_lost`: it may be one of them,
    or the rank waited inside torch's Join then, out of batches: `joins`, as RunContext's)."""
    divergence = count_divergence(arrays, not records_lost, joins)
    timing = replace(_distributed_timing(arrays, sel), count_divergence=divergence)
    if not comm_measured:
        return _without_comm(timing, parallelism)
    span = _course(arrays, sel, timing)
    if span is None:
        return timing
    return replace(timing, late=span) if span.until is None else replace(timing, ended=span)


def _course(arrays: RunArrays, sel: np.ndarray, whole: DistributedTiming) -> DistributedTiming | None:
    """The analysis over the steps a straggler ran slow, where it began after the window's start (`since`) or
    stopped before its end (`until`), or None. It is looked for in the longest part of `sel` (LATE_TAILS:
    last steps first, then first steps) whose screen passes and that names a straggler, the same ranks the
    whole window names where it names any (the same straggler's course, not another rank's)."""
    idx = np.flatnonzero(sel)
    if arrays.world_size < 2 or len(whole.per_rank) != arrays.world_size:
        return None
    for part in LATE_TAILS:
        k = idx.size // part
        if k < LATE_MIN_STEPS:
            return None
        for tail in (True, False):
            inside, rest = (idx[-k:], idx[:-k]) if tail else (idx[:k], idx[k:])
            if not _screen(arrays, inside, rest):
                continue
            d = _distributed_timing(arrays, _mask(sel, inside))
            if not d.stragglers or (whole.stragglers and d.stragglers != whole.stragglers):
                continue
            span = _span(arrays, sel, d, tail, whole)
            if span is not None:
                return span
    return None


def _screen(arrays: RunArrays, inside: np.ndarray, rest: np.ndarray) -> bool:
    """Whether the slowest rank in the steps `inside` (by median local work, over at most LATE_SCREEN_STEPS
    of them) is STRAGGLER_MIN_EXCESS above the other ranks' there, and by that much more than in `rest`."""
    excess = []
    slowest = -1
    for steps in (inside, rest):
        sample = steps[:: max(1, steps.size // LATE_SCREEN_STEPS)]
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (a rank with no record there)
            med = np.nanmedian(arrays.wall_ms[sample] - arrays.comm_ms[sample], axis=0)
            if not np.isfinite(med).any():
                return False
            if slowest < 0:
                slowest = int(np.nanargmax(med))
            excess.append(med[slowest] / np.nanmedian(np.delete(med, slowest)) - 1)
    there, elsewhere = excess
    return bool(there >= STRAGGLER_MIN_EXCESS and there - elsewhere >= STRAGGLER_MIN_EXCESS)


def _span(
    arrays: RunArrays, sel: np.ndarray, part: DistributedTiming, tail: bool, whole: DistributedTiming
) -> DistributedTiming | None:
    """The analysis over the steps of `sel` where `part`'s stragglers (found in its last steps, `tail`, or in
    its first) were slower than the others: from the change point where they began to be, where the steps
    before it name no straggler and they were not STRAGGLER_MIN_EXCESS slower there, to the one where they
    stopped, where at least LATE_MIN_STEPS steps follow in which they were not. None where neither boundary
    stands, where another rank was the straggler before (it is that one's course), or where the span names
    other ranks. A straggler in the last steps that the whole window does not name began late by its own
    account: its change point stands where it was slower before it all the same (short of a straggler), and
    where the span from there names other ranks, `part` itself is kept."""
    ranks = part.stragglers
    idx = np.flatnonzero(sel)
    cols = [int(np.flatnonzero(arrays.ranks == r)[0]) for r in ranks]
    lag = _lag((arrays.wall_ms - arrays.comm_ms)[idx], cols)
    n = lag.size
    if tail:
        start = _change(lag, rising=True)
        stop = start + _change(lag[start:], rising=False)
    else:
        stop = _change(lag, rising=False)
        start = _change(lag[:stop], rising=True)
    own = tail and not whole.stragglers
    if start > 0:
        before = _distributed_timing(arrays, _mask(sel, idx[:start]))
        if set(before.stragglers) - set(ranks):
            return None  # the others waited for another rank then: not where this one began
        if not own and not _quiet(before, ranks):
            start = 0  # slow before it too: no onset
    if stop < n and (
        n - stop < LATE_MIN_STEPS or not _quiet(_distributed_timing(arrays, _mask(sel, idx[stop:])), ranks)
    ):
        stop = n  # still slow after it, or too soon to tell
    if start == 0 and stop == n and not own:
        return None
    since = int(arrays.steps[idx[start]]) if start > 0 or own else None
    d = _distributed_timing(arrays, _mask(sel, idx[start:stop]))
    if d.stragglers != ranks:
        if not own:
            return None
        d, stop = part, n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (a step no rank recorded)
        total = float(np.nansum(np.nanmean(arrays.wall_ms[idx], axis=1)))
    return replace(
        d,
        since=since,
        until=int(arrays.steps[idx[stop]]) if stop < n else None,
        lost_share_of_window=d.lost_ms_per_step * d.steps_counted / total if total > 0 else 0.0,
    )


def _quiet(d: DistributedTiming, ranks: tuple[int, ...]) -> bool:
    """Whether none of `ranks` is a straggler in `d` nor even STRAGGLER_MIN_EXCESS slower in its median step:
    a few steps cannot pass the gates, so the excess alone tells a short stretch of the same straggler
    apart. (Not how often it was slower: healthy ranks' medians differ by ~2%, which over a few hundred steps
    is significant but no straggler.)"""
    return not any(r.straggler or r.excess >= STRAGGLER_MIN_EXCESS for r in d.per_rank if r.rank in ranks)


def _mask(sel: np.ndarray, steps: np.ndarray) -> np.ndarray:
    out = np.zeros_like(sel)
    out[steps] = True
    return out


def _lag(local: np.ndarray, cols: list[int]) -> np.ndarray:
    """(S,) how much more local work the ranks in columns `cols` of `local` (S, R) did in each step than the
    other ranks' median (the least of them, as a ratio less 1); a step missing there gets the median lag."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # (a step no other rank recorded)
        others = np.nanmedian(np.delete(local, cols, axis=1), axis=1)
        lag = local[:, cols].min(axis=1) / others - 1
    finite = np.isfinite(lag)
    return np.where(finite, lag, np.median(lag[finite]) if finite.any() else 0.0)


def _change(lag: np.ndarray, rising: bool) -> int:
    """The change point of `lag` (S,): where it rises (`rising`: the first step of the higher part; 0 where it
    never does) or falls (the first step of the lower part; S where it never does), at the extreme of the
    cumulative sum of its ranks about their mean (Pettitt's statistic). Ranks, not the values: a 2x hiccup
    moves it no more than any other slow step. Ranks, not whether the rank was above the others' median: a
    real rank that stopped straggling at step 150 stayed a little slower for the next 7 steps (+9-39%, against
    +90% before), which placed the end at step 157."""
    if lag.size == 0:
        return 0
    ranks = np.argsort(np.argsort(lag, kind="stable"), kind="stable").astype(np.float64)
    walk = np.cumsum(ranks - ranks.mean())
    return int(np.argmin(walk) + 1) % lag.size if rising else int(np.argmax(walk)) + 1


def _without_comm(d: DistributedTiming, parallelism: str | None) -> DistributedTiming:
    nan = math.nan
    off: dict[str, Any] = dict(local_ms=nan, comm_ms=nan, sync_wait_ms=nan, excess=nan, slower_share=nan)
    off.update(critical_share=nan, z=nan, straggler=False, extra_phase=None, extra_phase_ms=0.0)
    return replace(
        d,
        per_rank=tuple(replace(r, **off) for r in d.per_rank),
        stragglers=(),
        candidates=(),
        intermittent=None,
        transfer_ms=nan,
        transfer_share=nan,
        sync_wait_share=nan,
        lost_to_imbalance=nan,
        lost_ms_per_step=nan,
        next_slowest_local_ms=nan,
        comm_measured=False,
        note=comm_note(parallelism, False),
    )


def _distributed_timing(arrays: RunArrays, sel: np.ndarray) -> DistributedTiming:
    ranks = [int(r) for r in arrays.ranks]
    comm_all = arrays.comm_ms[sel]
    wall_all = arrays.wall_ms[sel]
    complete = np.all(np.isfinite(wall_all) & np.isfinite(comm_all), axis=1)
    if not complete.all():  # cross-rank comparisons need every rank in the step
        comm_all, wall_all = comm_all[complete], wall_all[complete]
    local = wall_all - comm_all
    n, r = local.shape
    if n == 0 or r == 0:
        return _empty(arrays, ranks)

    transfer = comm_all.min(axis=1)
    sync_wait = comm_all - transfer[:, None]
    loop = arrays.loop_comm_ms[sel][complete] if not complete.all() else arrays.loop_comm_ms[sel]
    loop_transfer = np.minimum(loop[np.arange(n), comm_all.argmin(axis=1)], transfer)  # (the same rank's)
    data = arrays.phases[:, :, _DATA][sel]
    if not complete.all():
        data = data[complete]
    wall_sum = wall_all.sum(axis=0, dtype=np.float64)

    critical = np.bincount(local.argmax(axis=1), minlength=r) / n
    if r >= 2:
        others = stats.median_of_others(local)
        rows = stats.median_sample(n)
        with np.errstate(all="ignore"):
            excess = stats.median_over_steps(local[rows] / others[rows] - 1.0)
        slower = np.count_nonzero(local > others, axis=0)
        del others
    else:
        excess, slower = np.zeros(r), np.zeros(r, dtype=np.int64)
    z = stats.binomial_z(slower, n)
    slower_share = slower / n
    persistent = (slower_share >= STRAGGLER_MIN_PERSISTENCE) | (
        (excess >= STRAGGLER_LARGE_EXCESS) & (slower_share >= STRAGGLER_LARGE_PERSISTENCE)
    )
    is_candidate = (excess >= STRAGGLER_MIN_EXCESS) & persistent
    is_candidate &= z >= STRAGGLER_MIN_Z

    phases = arrays.phases[sel][complete] if not complete.all() else arrays.phases[sel]
    extra = _extra_phases(phases, is_candidate)
    local_med = stats.median_over_steps(local)
    numbers = arrays.steps[sel][complete] if not complete.all() else arrays.steps[sel]
    intermittent, its_steps = _intermittent(local, local_med, wall_all, phases, numbers, ranks)
    del phases  # (S, R, P): not kept while the medians below make their own temporaries

    # What a persistent straggler costs is its usual lag: over the steps that stalled and those an intermittent
    # one made slow, it is TIMING.STALL's and TIMING.JITTER's (a rank-0-only checkpoint every 10th step is not
    # a slow rank; one 6 s checkpoint on the straggler's rank, averaged into its lag, billed it at 41 ms a step).
    total_wall = float(wall_all.mean(axis=1, dtype=np.float64).sum())
    slowest = local.max(axis=1)
    stall_bar = STRAGGLER_STALL * float(np.median(slowest))
    typical = slowest < stall_bar if stall_bar > 0 else np.ones(n, dtype=bool)
    typical[its_steps] = False
    if not typical.any():  # (no usual step left to measure a lag over: each is billed)
        typical[:] = True
    lost_ms, next_local = _straggler_cost(local if typical.all() else local[typical], is_candidate)
    lost_share = lost_ms * n / total_wall if total_wall > 0 else 0.0  # (its usual lag, in every step)
    is_straggler = is_candidate & (lost_share >= STRAGGLER_MIN_COST_SHARE)
    comm_med = stats.median_over_steps(comm_all)
    wait_med = stats.median_over_steps(sync_wait)
    data_med = stats.median_over_steps(data)
    data_sum = data.sum(axis=0, dtype=np.float64)
    with np.errstate(all="ignore"):
        data_share = np.where(wall_sum > 0, data_sum / wall_sum, 0.0)
    # One Python object per rank: columns go to lists first (numpy scalars cost 16k x 10 conversions).
    columns = zip(
        ranks,
        *(np.asarray(c, dtype=np.float64).tolist() for c in (local_med, comm_med, wait_med, data_med)),
        (data_sum / n).tolist(),
        *(np.asarray(c, dtype=np.float64).tolist() for c in (data_share, critical, excess, slower_share, z)),
        np.asarray(is_straggler, dtype=bool).tolist(),
        strict=True,
    )
    per_rank = tuple(
        RankTiming(rank, lm, cm, wm, dm, da, ds, cs, ex, ss, zz, st, *extra.get(i, (None, 0.0)))
        for i, (rank, lm, cm, wm, dm, da, ds, cs, ex, ss, zz, st) in enumerate(columns)
    )
    return DistributedTiming(
        per_rank=per_rank,
        stragglers=tuple(ranks[i] for i in np.flatnonzero(is_straggler)),
        candidates=tuple(ranks[i] for i in np.flatnonzero(is_candidate)),
        transfer_ms=float(np.median(transfer)),
        transfer_share=float(transfer.sum(dtype=np.float64) / total_wall) if total_wall > 0 else 0.0,
        sync_wait_share=float(sync_wait.sum(dtype=np.float64) / wall_sum.sum()) if total_wall > 0 else 0.0,
        lost_to_imbalance=lost_share if is_straggler.any() else 0.0,
        lost_ms_per_step=lost_ms if is_straggler.any() else 0.0,
        next_slowest_local_ms=next_local,
        steps_counted=n,
        intermittent=intermittent,
        loop_transfer_ms=float(np.median(loop_transfer)),  # (NaN in runs recorded before the column)
    )


def _intermittent(
    local: np.ndarray,
    local_med: np.ndarray,
    wall: np.ndarray,
    phases: np.ndarray,
    numbers: np.ndarray,
    ranks: list[int],
) -> tuple[Intermittent | None, np.ndarray]:
    """The rank whose local work grew the most in most of the slow steps (`INTERMITTENT_SHARE`),
    with its phase and the steps' spacing, and the positions of the steps it made slow; None (and no steps)
    on one rank, or when no rank holds them (the host, the network, noise). `local`, `wall` (n, R) and
    `phases` (n, R, P) are the counted steps', `numbers` their step numbers, `local_med` (R,) each rank's
    median local work."""
    none = (None, np.zeros(0, dtype=np.int64))
    n, r = local.shape
    if n < 20 or r < 2:
        return none
    step_wall = wall.mean(axis=1, dtype=np.float64)
    median = float(np.median(step_wall))
    noise = stats.MAD_TO_SIGMA * float(np.median(np.abs(step_wall - median)))
    slow = np.flatnonzero(step_wall >= max(INTERMITTENT_SLOW * median, median + INTERMITTENT_SIGMAS * noise))
    if slow.size < INTERMITTENT_MIN_STEPS:
        return none
    top = np.argmax(local[slow] - local_med, axis=1)
    counts = np.bincount(top, minlength=r)
    k = int(counts.argmax())
    p = 1.0 / r
    z = (counts[k] - slow.size * p) / math.sqrt(slow.size * p * (1 - p))
    if counts[k] < INTERMITTENT_SHARE * slow.size or z < INTERMITTENT_Z:
        return none
    mine = slow[top == k]
    extra = float(np.median(local[mine, k] - local_med[k]))
    others = float(np.median(np.delete(local[mine] - local_med, k, axis=1)))  # a slow host grows them too
    if not (extra >= 0.5 * float(np.median(step_wall[mine] - median)) and extra >= 3 * max(others, 0)):
        return none
    growth = np.median(phases[mine, k], axis=0) - np.median(phases[:, k], axis=0)
    growth[_COMM] = -np.inf  # its own work, not its waits
    gaps = np.diff(np.sort(numbers[mine]))
    every = 0
    if gaps.size >= 2:
        spacings, times = np.unique(gaps, return_counts=True)
        if times.max() >= 0.5 * gaps.size:
            every = int(spacings[times.argmax()])
    found = Intermittent(
        ranks[k],
        PHASES[int(np.argmax(growth))],
        extra,
        int(mine.size),
        int(slow.size),
        every if every >= 2 else None,
    )
    return found, mine


def _extra_phases(phases: np.ndarray, candidates: np.ndarray) -> dict[int, tuple[str, float]]:
    """For each candidate column: the non-communication phase whose median exceeds the other ranks' (their
    per-step mean) the most. Cheap: only candidates are looked at one by one."""
    cols = np.flatnonzero(candidates)
    r = phases.shape[1]
    if cols.size == 0 or cols.size == r or phases.shape[0] == 0:
        return {}
    total = np.einsum("srp->sp", phases)
    others = (total - phases[:, cols, :].sum(axis=1)) / (r - cols.size)
    typical = np.median(others, axis=0)
    out = {}
    for c in cols:
        diff = np.median(phases[:, c, :], axis=0) - typical
        diff[_COMM] = -np.inf  # the straggler waits least: its extra work is never communication
        p = int(np.argmax(diff))
        out[int(c)] = (PHASES[p], float(diff[p]))
    return out


def _straggler_cost(local: np.ndarray, slow: np.ndarray) -> tuple[float, float]:
    """Mean ms per step the slow ranks add over the slowest other rank, and that rank's median local work.

    This is an upper bound on what fixing them saves (docs/MEASUREMENTS.md, item 5): the step would then wait for the
    next-slowest rank instead.
    """
    if not slow.any() or slow.all():
        return 0.0, math.nan
    slowest_bad = np.max(local, axis=1, where=slow, initial=-np.inf)  # (no copy of the ranks' columns)
    slowest_good = np.max(local, axis=1, where=~slow, initial=-np.inf)
    lost = np.clip(slowest_bad - slowest_good, 0.0, None)
    return float(lost.mean(dtype=np.float64)), float(np.median(slowest_good))


def count_divergence(
    arrays: RunArrays, gaps: bool = True, joins: tuple[tuple[int, int], ...] = ()
) -> CountDivergence | None:
    """The first step where some rank's gradient syncs, or else its optimizer steps, differ from the
    majority's: a skipped or extra optimizer step, `no_sync()` on some ranks only. (An extra optimizer step
    changes no count of syncs or of steps: the loop top closes a step, so both calls fall in one.)"""
    joined = inside_joins(arrays, joins)
    found = [
        d for d in (_divergence(arrays, c, gaps, joined) for c in ("grad_syncs", "optimizer_steps")) if d
    ]
    return min(found, key=lambda d: d.step) if found else None  # (syncs first at the same step)


def _divergence(
    arrays: RunArrays, counter: str, gaps: bool = True, joined: np.ndarray | None = None
) -> CountDivergence | None:
    """First step where some rank's per-step `counter` differs from the majority's.

    Before that step every rank's cumulative count is equal, so the first per-step difference is exactly
    where a rank's cumulative count falls behind or runs ahead. (A run from before the optimizer_steps
    column has NaN there on every rank: no record, no divergence.) With `gaps` False, a step some rank has no
    record of is not a divergence (the reader dropped damaged rows).
    """
    g = getattr(arrays, counter)
    if g.shape[1] < 2 or g.shape[0] == 0:
        return None
    with np.errstate(invalid="ignore"):
        differs = np.isfinite(g) & np.isfinite(g[:, :1]) & (g != g[:, :1])
        present = np.isfinite(g)
        # A rank missing a step another rank recorded also breaks the count (NaN vs a number), unless its
        # records in that step's segment ended before it (a hang or a kill before the gather) or it has none
        # there (a job resumed on fewer or more ranks), or it waited inside a join: missing is not diverged.
        partial = present.any(axis=1) & ~present.all(axis=1) & gaps
        if partial.any():  # (a healthy run has no gap: nothing more to look at)
            accounted = present | _excused(present, arrays.segment, partial)
            partial &= ~(accounted if joined is None else accounted | joined).all(axis=1)
    bad_steps = np.flatnonzero(differs.any(axis=1) | partial)
    if bad_steps.size == 0:
        return None
    i = int(bad_steps[0])
    row = np.asarray(g[i], dtype=np.float64)
    most = majority(row, history=g)
    off = np.flatnonzero(~np.isfinite(row) | (row != most)) if most is not None else np.arange(row.size)
    return CountDivergence(
        counter=counter,
        step=int(arrays.steps[i]),
        ranks=tuple(int(arrays.ranks[j]) for j in off),
        counts=tuple(float(row[j]) for j in off),
        majority=most if most is not None else math.nan,
    )


@dataclass(frozen=True)
class JoinWait:
    """A rank that ran out of batches first and waited inside torch's Join while the others trained on,
    over every join it went through (one per epoch, where each epoch joins)."""

    rank: int
    last_step: int  # its last step before its first join
    joins: int
    steps_missed: int  # steps the others took while it waited
    wait_s: float  # their wall time
    share: float  # of the run's wall time (the steps analysed)


def join_waits(
    arrays: RunArrays, joins: tuple[tuple[int, int], ...], wall: np.ndarray
) -> tuple[JoinWait, ...]:
    """Each rank of `joins` (RunContext's), with the steps it missed inside a join and their wall time
    (`wall`, (S,) the job's wall time per step)."""
    if not joins:
        return ()
    inside = inside_joins(arrays, joins)
    total = float(np.nansum(wall))
    column = {int(r): i for i, r in enumerate(arrays.ranks.tolist())}
    out = []
    for rank in sorted(
        {r for r, _ in joins}
    ):  # (a rank with no batch at all has no record: every step missed)
        missed = (
            inside[:, column[rank]]
            if rank in column
            else arrays.steps > min(j for r, j in joins if r == rank)
        )
        wait = float(np.nansum(wall[missed])) / 1e3
        out.append(
            JoinWait(
                rank=rank,
                last_step=min(step for r, step in joins if r == rank),
                joins=sum(1 for r, _ in joins if r == rank),
                steps_missed=int(missed.sum()),
                wait_s=wait,
                share=wait * 1e3 / total if total > 0 else math.nan,
            )
        )
    return tuple(out)


def inside_joins(arrays: RunArrays, joins: tuple[tuple[int, int], ...]) -> np.ndarray:
    """(S, R) bool: the steps each rank of `joins` (rank, its last step) missed while it waited inside torch's
    Join, out of batches: from the step after its last until its next record (the next epoch's join), or
    the end."""
    out = np.zeros(arrays.wall_ms.shape, dtype=bool)
    column = {int(r): i for i, r in enumerate(arrays.ranks.tolist())}
    present = np.isfinite(arrays.wall_ms)
    for rank, step in joins:
        i = column.get(rank)
        if i is None:
            continue
        start = int(np.searchsorted(arrays.steps, step, side="right"))
        back = np.flatnonzero(present[start:, i])
        out[start : start + (int(back[0]) if back.size else arrays.n_steps), i] = True
    return out


def majority(values: np.ndarray, history: np.ndarray | None = None) -> float | None:
    """The count most ranks hold (NaN: no record, left out). On a tie, the tied count most common in
    `history` (the same counter over the run), where that breaks it. None where nothing singles one count out
    (2 ranks at odds and no history to go by): no rank can then be blamed. Every DIST.DESYNC uses this."""
    values = np.asarray(values, dtype=np.float64)
    uniq, counts = np.unique(values[np.isfinite(values)], return_counts=True)
    tied = uniq[counts == counts.max()] if uniq.size else uniq
    if tied.size > 1 and history is not None:
        seen = np.array([np.count_nonzero(history == v) for v in tied])
        tied = tied[seen == seen.max()]
    return float(tied[0]) if tied.size == 1 else None


def _excused(present: np.ndarray, segment: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """(S, R) bool, on the steps in `gaps` only: the rank has no record in the step's segment, or its records
    there ended before the step. Segments are contiguous runs of steps, so each is one slice of rows."""
    out = np.zeros(present.shape, dtype=bool)
    step_segment = step_segments(segment)
    for value in np.unique(step_segment[gaps & np.isfinite(step_segment)]):
        rows = np.flatnonzero(step_segment == value)
        a, b = int(rows[0]), int(rows[-1]) + 1
        mine = present[a:b] & (step_segment[a:b] == value)[:, None]
        last = np.where(mine.any(axis=0), b - a - 1 - mine[::-1].argmax(axis=0), -1)
        out[rows] = (np.arange(b - a)[:, None] > last[None, :])[rows - a]  # after its last record, or none
    return out


def _empty(arrays: RunArrays, ranks: list[int]) -> DistributedTiming:
    nan = math.nan
    return DistributedTiming(
        per_rank=tuple(RankTiming(r, nan, nan, nan, nan, nan, nan, 0.0, nan, nan, 0.0, False) for r in ranks),
        stragglers=(),
        candidates=(),
        intermittent=None,
        transfer_ms=nan,
        transfer_share=0.0,
        sync_wait_share=0.0,
        lost_to_imbalance=0.0,
        lost_ms_per_step=0.0,
        next_slowest_local_ms=nan,
        steps_counted=0,
    )


def with_placement(d: DistributedTiming, placement: Placement) -> DistributedTiming:
    """`d` with the host and local rank of each of its ranks, where the run recorded them."""
    if not placement.known:
        return d
    ranks = [r.rank for r in d.per_rank]
    return replace(
        d,
        hosts=tuple(placement.host(r) or "?" for r in ranks),
        local_ranks=tuple(placement.local_rank(r) or 0 for r in ranks),
    )
