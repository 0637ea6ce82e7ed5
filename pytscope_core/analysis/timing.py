"""Step time and where it goes: median/p95 step wall and each phase's share of it.

The job's step wall in a step is the mean of the ranks' walls (under DDP they are nearly equal: every rank
waits for the slowest); phase shares are totals over counted steps and ranks divided by the total of all
phases, so they add up to exactly 1 whatever rounding the records carry.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..arrays import RunArrays, step_segments
from ..records import PHASES
from . import stats


@dataclass(frozen=True)
class PhaseTiming:
    name: str
    share: float  # of the step wall, over counted steps and ranks; shares of all phases sum to 1
    median_ms: float  # median over counted steps of the rank-mean time in this phase


@dataclass(frozen=True)
class Stall:
    """One step that took many times the median: who held it up, and where."""

    step: int
    wall_ms: float  # the stalled rank's wall in that step (a stall of the collective: the job's)
    rank: int  # the rank whose own work (wall less communication) stalled (the collective: the least waiting)
    phase: str  # that rank's phase that grew most over its own median (communication aside), or "comm"
    phase_ms: float  # that phase's time in the step
    others_waited: bool  # the other ranks spent most of the excess waiting in communication


STALL_FACTOR = 10.0
"""A stalled step takes at least 10x the median step..."""
STALL_MIN_MS = 100.0
"""...and at least 100 ms: a 10 ms garbage collection in a 1 ms step is jitter, not a stall."""
STALL_LISTED = 5
"""The longest stalls described; the share counts them all."""


@dataclass(frozen=True)
class StepTiming:
    steps_counted: int
    median_ms: float
    p95_ms: float
    mean_ms: float
    phases: tuple[PhaseTiming, ...]
    jitter_cost_share: float  # wall above the median step, as a share of all wall: what instability costs
    p95_ratio: float = math.nan  # p95 step / median step (each step against its launch size's median)
    jitter_phase: str | None = None  # the phase that grows most in the slowest 10% of steps
    jitter_phase_ms: float = 0.0  # by how much (median over slow steps - median over typical steps)
    stalls: tuple[Stall, ...] = ()  # the longest stalled steps (`find_stalls`), longest first
    stall_share: float = 0.0  # wall the stalled steps took beyond the median step, as a share of all wall
    stall_count: int = 0  # stalled steps in all (`stalls` lists the longest)
    # Warm-up steps the watchdog reported as a hang that every rank went on past, that stalled
    # (`reported_warm_up`): apart, since the share, the jitter and the budget are the counted steps'.
    warm_up_stalls: tuple[Stall, ...] = ()

    def phase(self, name: str) -> PhaseTiming:
        return next(p for p in self.phases if p.name == name)


MIN_STATISTIC_STEPS = 50
"""Below this many counted steps, medians and shares are anecdotes: timing findings stay LOW (a
`fast_dev_run`, or 24 steps of 1.3 ms before a hang in which one rank happened to run +0.4 ms, must not
raise a HIGH next to the real problem)."""


def few_steps_note(steps_counted: int) -> str | None:
    """What the report says when there are too few steps for timing statistics, else None."""
    if steps_counted >= MIN_STATISTIC_STEPS:
        return None
    return (
        f"statistics from {steps_counted} step(s): too few (< {MIN_STATISTIC_STEPS}) for timing findings "
        "above LOW"
    )


def counted_steps(arrays: RunArrays) -> np.ndarray:
    """Steps past warm-up, or all of them when a short run is still in warm-up."""
    counted = np.asarray(arrays.counted, dtype=bool)
    return counted if counted.any() else np.ones(arrays.n_steps, dtype=bool)


def statistics_steps(arrays: RunArrays) -> np.ndarray:
    """Steps the statistics use: the counted ones that trained (`trained_steps`), else the counted ones. A
    step with no micro-batch and no optimizer step on any rank is batches a NaN guard skipped after their
    forward: a fraction of a step's work, which would pull the median down and read as jitter."""
    counted = counted_steps(arrays)
    trained = counted & trained_steps(arrays)
    return trained if trained.any() else counted


def trained_steps(arrays: RunArrays) -> np.ndarray:
    """(S,) bool: some rank counted a micro-batch or an optimizer step in the step. In a run where no forward
    is seen (no model watched, or one compiled after `watch()`: no micro-batch anywhere), every step: a step
    the GradScaler skipped there ran its forward and backward all the same."""
    micro = arrays.micro_batches > 0  # (NaN, a rank without the step: False)
    if not micro.any():
        return np.ones(arrays.n_steps, dtype=bool)
    return np.asarray((micro | (arrays.optimizer_steps > 0)).any(axis=1), dtype=bool)


def step_wall_ms(arrays: RunArrays) -> np.ndarray:
    """(S,) the job's wall time per step: the mean over ranks (NaN-aware)."""
    return stats.mean_over_ranks(arrays.wall_ms)


def phase_ms_per_step(arrays: RunArrays) -> np.ndarray:
    """(S, P) the rank-mean time per phase per step, reduced per step so no (S, R, P) temporary is made."""
    s, r, p = arrays.phases.shape
    if r == 0:
        return np.full((s, p), np.nan)
    if stats.has_gaps(arrays.wall_ms):
        present = np.isfinite(arrays.wall_ms).sum(axis=1)
        with np.errstate(all="ignore"):
            return np.nansum(arrays.phases, axis=1, dtype=np.float64) / present[:, None]
    # einsum reduces the middle axis without a temporary and about twice as fast as sum(axis=1).
    return np.einsum("srp->sp", arrays.phases).astype(np.float64) / r


def step_timing(
    arrays: RunArrays,
    wall: np.ndarray,
    phase_ms: np.ndarray,
    launch_size: np.ndarray | None = None,
    hang_steps: Sequence[int] = (),
) -> StepTiming:
    """Median, p95 and phase breakdown of the counted steps (`wall` (S,) and `phase_ms` (S, P) per step).

    Instability (jitter, stalls) is judged against each step's own kind of step: `launch_size` (S,) is the
    number of ranks each step's launch ran on (`launch_sizes`); a job resumed on other numbers of ranks has
    a typical step per size, and pooling them would make a stable run look unstable. So does a step of more
    micro-batches (an accumulation schedule, an epoch's short last window): each count has its own.
    `hang_steps`: the steps the watchdog's hang reports name (`reported_warm_up`)."""
    sel = statistics_steps(arrays)
    w = wall[sel]
    w = w[np.isfinite(w)]
    pm = phase_ms[sel]
    pm = pm[np.all(np.isfinite(pm), axis=1)]
    totals = pm.sum(axis=0) if pm.size else np.zeros(len(PHASES))
    grand = float(totals.sum())
    shares = totals / grand if grand > 0 else np.zeros(len(PHASES))
    medians = np.median(pm, axis=0) if pm.shape[0] else np.full(len(PHASES), np.nan)
    median = float(np.median(w)) if w.size else math.nan
    typical = _typical_step(wall, sel, _step_kinds(arrays, launch_size))
    ok = sel & np.isfinite(wall) & (typical > 0)
    relative = wall[ok] / typical[ok]  # each counted step against its launch size's median step
    above = float(np.clip(wall[ok] - typical[ok], 0, None).sum())
    jitter = above / float(wall[ok].sum()) if ok.any() and wall[ok].sum() > 0 else 0.0
    grows, grows_ms = _phase_that_grows(relative, phase_ms[ok])
    stalls, stall_share, stall_count = find_stalls(arrays, wall, ok, typical)
    warm_up = reported_warm_up(arrays, wall, sel, typical, hang_steps)
    early = find_stalls(arrays, wall, ok, typical, judged=warm_up)[0] if warm_up.any() else ()
    return StepTiming(
        steps_counted=int(w.size),
        median_ms=median,
        p95_ms=float(np.quantile(w, 0.95)) if w.size else math.nan,
        mean_ms=float(w.mean()) if w.size else math.nan,
        phases=tuple(PhaseTiming(name, float(shares[i]), float(medians[i])) for i, name in enumerate(PHASES)),
        jitter_cost_share=jitter,
        p95_ratio=float(np.quantile(relative, 0.95)) if relative.size else math.nan,
        jitter_phase=grows,
        jitter_phase_ms=grows_ms,
        stalls=stalls,
        stall_share=stall_share,
        stall_count=stall_count,
        warm_up_stalls=early,
    )


def launch_sizes(segment: np.ndarray, sizes: dict[int, int]) -> np.ndarray:
    """(S,) the number of ranks each step's launch ran on, from the (S, R) segment of every record and each
    segment's size (0 where unknown)."""
    return np.array(
        [sizes.get(int(x), 0) if math.isfinite(x) else 0 for x in step_segments(segment)], dtype=np.int64
    )


def launch_sequence(sizes: Sequence[int]) -> tuple[int, ...]:
    """The numbers of ranks a job ran on, launch after launch, each change once ((4, 4, 2) -> (4, 2));
    () when it never changed."""
    changes = tuple(w for i, w in enumerate(sizes) if i == 0 or w != sizes[i - 1])
    return changes if len(changes) > 1 else ()


def _step_kinds(arrays: RunArrays, launch_size: np.ndarray | None) -> np.ndarray:
    """(S,) one number per kind of step: its launch's size and its micro-batches (the most any rank had; fmax
    skips the ranks without a record, with no copy)."""
    micro = np.fmax.reduce(arrays.micro_batches, axis=1) if arrays.n_steps else np.zeros(0)
    size = launch_size if launch_size is not None else np.zeros(arrays.n_steps, dtype=np.int64)
    return size.astype(np.float64) * 1e6 + np.nan_to_num(micro, nan=0.0)


def _typical_step(wall: np.ndarray, sel: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """(S,) the median counted step of each step's kind (`_step_kinds`)."""
    typical = np.full(wall.size, np.nan)
    counted = sel & np.isfinite(wall)
    for g in np.unique(groups):
        mine = groups == g
        if (mine & counted).any():
            typical[mine] = np.median(wall[mine & counted])
    return typical


def reported_warm_up(
    arrays: RunArrays, wall: np.ndarray, sel: np.ndarray, typical: np.ndarray, hang_steps: Sequence[int]
) -> np.ndarray:
    """(S,) bool: steps left out of the statistics (warm-up) that a hang report names, or the step before it
    (the late rank's own: `rules._stalls_reported_as_hangs`), and that every rank went on past (a later step
    on every rank). Warm-up is left out because start-up work is expected there; but a wait there that the
    watchdog reported as a hang (a hang_timeout shorter than start-up), every rank then going on, was a
    stall, and is judged as one: else the summary keeps it as a hang the run went on past."""
    named = np.isin(arrays.steps, [s - d for s in hang_steps for d in (0, 1)]) & ~sel
    if not named.any():
        return named
    everyone = np.flatnonzero(np.isfinite(arrays.wall_ms).all(axis=1))
    gone_on = np.arange(arrays.n_steps) < (everyone[-1] if everyone.size else -1)
    with np.errstate(invalid="ignore"):
        return named & gone_on & np.isfinite(wall) & (typical > 0)


def find_stalls(
    arrays: RunArrays,
    wall: np.ndarray,
    counted: np.ndarray,
    typical: np.ndarray,
    judged: np.ndarray | None = None,
) -> tuple[tuple[Stall, ...], float, int]:
    """Stalls (a checkpoint or an evaluation left out of `paused()`, a recompilation, a storage hiccup): the
    longest STALL_LISTED of them, what all of them cost beyond the typical step, as a share of the counted
    steps' wall, and how many there are. `counted` (S,) bool: the steps judged; `typical` (S,): each one's
    median step (`_typical_step`); `wall` (S,): the job's step wall (the mean over ranks).

    A stall is a rank whose own work (wall less communication) in a counted step took at least STALL_FACTOR x
    the typical step and STALL_MIN_MS. The other ranks wait for it in that step's collective, or in the next
    step's when the stall came after the gradient all-reduce (a checkpoint before `optimizer.step()`), so the
    next step's wait is part of the same stall, not another one, and the stall costs the stalled rank's
    excess, once. A step that long for the job in which no rank's own work grew, and that does not wait for
    an earlier stall, is a stall of the collective itself ("comm": every rank waited).

    `judged` (S,) bool: the steps to judge, where not the counted ones (`reported_warm_up`); each rank's
    usual phases are still its counted steps'."""
    counted_steps = np.flatnonzero(counted)
    steps = counted_steps if judged is None else np.flatnonzero(judged)
    if steps.size == 0:
        return (), 0.0, 0
    comm = PHASES.index("comm")
    own_phases = [i for i, name in enumerate(PHASES) if name != "comm"]
    bar = np.maximum(STALL_FACTOR * typical, STALL_MIN_MS)

    # A step's most own work (no (S, R) temporary beyond one slice: this runs over every counted step).
    most = np.fmax.reduce(
        arrays.wall_ms[steps] - np.nan_to_num(arrays.phases[steps, :, comm], nan=0.0), axis=1
    )
    with np.errstate(invalid="ignore"):
        own = steps[most >= bar[steps]]
        collective = steps[(wall[steps] >= bar[steps]) & ~np.isin(steps, own) & ~np.isin(steps, own + 1)]
    usual: dict[int, np.ndarray] = {}  # per stalled rank: its median own phases over the counted steps
    out: list[Stall] = []
    cost = 0.0
    for i in own:
        row = arrays.wall_ms[i] - np.nan_to_num(arrays.phases[i, :, comm], nan=0.0)  # each rank's own work
        row = np.where(np.isfinite(row), row, -np.inf)
        r = int(np.argmax(row))
        excess = float(row[r] - typical[i])
        cost += excess
        if r not in usual:
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # a phase without counted records
                usual[r] = np.nanmedian(arrays.phases[counted_steps, r][:, own_phases], axis=0)
        growth = np.nan_to_num(arrays.phases[i, r, own_phases] - usual[r], nan=-np.inf)
        p = own_phases[int(np.argmax(growth))]
        waits = np.nan_to_num(arrays.phases[i : i + 2, :, comm], nan=0.0)  # this step's and the next's
        others = np.delete(waits.max(axis=0), r)
        waited = bool(others.size) and bool(others.min() >= 0.5 * excess)
        out.append(
            Stall(
                int(arrays.steps[i]),
                float(arrays.wall_ms[i, r]),
                int(arrays.ranks[r]),
                PHASES[p],
                float(arrays.phases[i, r, p]),
                waited,
            )
        )
    for i in collective:
        cost += float(wall[i] - typical[i])
        waits = np.where(
            np.isfinite(arrays.wall_ms[i]), np.nan_to_num(arrays.phases[i, :, comm], nan=0.0), np.inf
        )
        r = int(np.argmin(waits))
        out.append(
            Stall(int(arrays.steps[i]), float(wall[i]), int(arrays.ranks[r]), "comm", float(waits[r]), False)
        )
    out.sort(key=lambda x: x.wall_ms, reverse=True)
    return tuple(out[:STALL_LISTED]), cost / float(wall[steps].sum()), len(out)


def _phase_that_grows(wall: np.ndarray, phase_ms: np.ndarray) -> tuple[str | None, float]:
    """Which phase makes slow steps slow: its median over the slowest 10% of steps minus over typical ones
    (`wall` orders the steps: their wall, or each one's wall over its typical step)."""
    ok = np.isfinite(wall) & np.all(np.isfinite(phase_ms), axis=1)
    wall, phase_ms = wall[ok], phase_ms[ok]
    if wall.size < 20:
        return None, 0.0
    slow = wall >= np.quantile(wall, 0.9)
    typical = wall <= np.median(wall)
    growth = np.median(phase_ms[slow], axis=0) - np.median(phase_ms[typical], axis=0)
    i = int(np.argmax(growth))
    return (PHASES[i], float(growth[i])) if growth[i] > 0 else (None, 0.0)
