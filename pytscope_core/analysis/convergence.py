"""Is the loss going anywhere: trend, spikes, and the first non-finite value.

The trend compares the first and last quarter of block means. Averaging steps into blocks removes per-step
noise; the noise of the block means is estimated from their successive differences, so a smooth descent does
not inflate it, leaving out the one or two that are far larger than the rest (a steep first block, a spike);
the test is one-sided and strict and must also clear a relative-change floor, because a significance test
alone calls any long run "changing". The records hold a logged NaN or Inf loss as +inf and
"not logged" as NaN. A rank that logged every step and then never logs again (NaN to the end) reads as
non-finite from there only where its training stopped with its loss: a NaN guard that skips the step (a
Lightning training_step that returns None) stops both, where a loop that merely stops logging keeps training;
in runs recorded before the distinction (and before optimizer steps were recorded), such a stop alone reads
so. A step is non-finite when any rank's loss is (its NaN gradients reach every rank through the all-reduce):
a rank whose loss stays NaN makes the run's loss non-finite to the end, whatever the mean of the other ranks'
finite losses does.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from ..arrays import RunArrays
from . import stats
from .timing import counted_steps

TREND_MIN_STEPS = 100
"""Fewer finite counted steps than this and the trend is "unknown": too few blocks to estimate noise."""
TREND_BLOCKS = 20
"""Block means per run; the first and last TREND_EDGE_BLOCKS are compared."""
TREND_EDGE_BLOCKS = 5
TREND_T_CRIT = 3.9
"""One-sided critical t (about p = 0.001 at the ~12 effective degrees of freedom of the noise estimate)."""
TREND_MIN_RELATIVE_CHANGE = 0.05
"""A change under 5% of the starting level is "flat" whatever its significance, unless a fall of at least
TREND_MIN_SLOW_FALL with TREND_T_CRIT..."""
TREND_MIN_SLOW_FALL = 0.01
"""...which is "improving" (slowly): a loss falling steadily by 1-5% over the window, as late in a long run,
is going somewhere; called "flat" it was a MED finding that the loss had stopped improving."""

TREND_UNCLEAR_T = 2.0
"""A fall of TREND_MIN_RELATIVE_CHANGE or more whose t is between this and TREND_T_CRIT is "unclear", not
"flat": of 1,000 healthy 200-step runs that fell fast and then sat flat under 30% noise per step, 458 read so
and 47 flat (about 500 were flat before "unclear"), where constant losses with 30-60% noise read so in 2-5%
(the rest stay "flat": MED)."""

PLATEAU_MIN_SHARE = 1 / 3
"""A plateau after a fall is a tail of at least a third of the counted steps (and TREND_MIN_STEPS)..."""
PLATEAU_MAX_CHANGE = 0.01
"""...over which the loss moved (either way) by less than 1% of its level, or by less than
PLATEAU_MAX_SHARE_OF_FALL of what it had fallen before, with confidence: the tail's first-to-last change plus
PLATEAU_Z standard errors, and the tail not still falling significantly. A tail too noisy to show that is not
called a plateau, and a slow fall stays "improving" (a power-law descent falls about 2% of its level, and 13%
of its earlier fall, over its last third). Either way: a tail that rose by chance at one of the candidate starts
must not pass for flat."""
PLATEAU_MAX_SHARE_OF_FALL = 0.05
PLATEAU_Z = 2.0
PLATEAU_STARTS = 24
"""Where a plateau (or a rise) may begin: every 1/24 of the counted steps; the earliest start whose tail is
flat (rising) wins."""

RISE_MIN_SHARE = 1 / 4
"""A rise after a fall is a tail of at least a quarter of the counted steps (and TREND_MIN_STEPS) whose last
quarter is above its first by TREND_MIN_RELATIVE_CHANGE of its level, with TREND_T_CRIT: the same test as a
run's "worsening", on the tail. It is looked for when the run as a whole reads "improving" or "flat", where
the earlier fall hides it (a run that got worse overall is "worsening" already); on a "flat" run only after a
clear fall to the tail's lowest block (5% of the first quarter's level and RISE_T_CRIT x sqrt(2) of the block
noise): searching a flat run's tails alone for a rise calls slow noise a rise (10% of flat losses with AR(1)
noise, phi 0.9)."""
RISE_T_CRIT = 5.0
"""Higher than TREND_T_CRIT: up to 19 tails are tested. At 3.9, 0.1-0.4% of losses that fell and then sat flat
with 10-30% iid noise per step were called rising, and up to 1.8% with AR(1) noise (phi 0.5); at 5.0, at most
0.2% and 0.5% (1,000 curves each)."""
RISE_TURN_SDS = 2.0
"""Where it turned: the start of the last of the rising tail's blocks whose mean is within 2 noise sds of the
lowest."""

SPIKE_WINDOW = 50
"""Trailing steps that define the local loss level for spike detection."""
SPIKE_TREND_T = 3.0
"""Where the medians of the window's two halves differ by this many standard errors, the level is their line
at the step, placed by the window's last SPIKE_EARLY_LEVEL steps, and the noise is the spread around that line
(`stats.trend_level_sigma`): a loss still falling fast sat far below its trailing median, within a spread its
own fall inflated, so a x8 spike at step 80 of a 150-step run went unseen (6.5 against about 0.7 at steps 79
and 81; median 1.71, spread 0.88). A window whose trend is within its noise keeps its median: a flat loss is
judged as before."""
SPIKE_MIN_HISTORY = 20
"""Steps before the first one that can be a spike. Until SPIKE_WINDOW steps exist, the level is the median of
the last SPIKE_EARLY_LEVEL steps and the noise comes from the successive differences of all earlier ones
(`stats.early_level_noise`), so the fast fall of early training is neither a level that lags nor noise."""
SPIKE_EARLY_LEVEL = 10
SPIKE_MADS = 6.0
"""A spike sits more than 6 robust sigmas above the local level (the larger of the MAD's and the upper
spread's, around the window's trend)..."""
SPIKE_MIN_RELATIVE = 0.25
"""...and at least 25% above it, so tiny steady noise cannot produce spikes."""


@dataclass(frozen=True)
class LossTrend:
    # "improving", "flat", "worsening", "unclear" (fell by TREND_MIN_RELATIVE_CHANGE or more, with
    # TREND_UNCLEAR_T <= -t < TREND_T_CRIT), "unknown", or "non-finite" (never finite again after a NaN/Inf)
    trend: str
    t: float  # (last - first) / its standard error; negative when the loss goes down
    relative_change: float  # (last quarter mean - first quarter mean) / |first quarter mean|
    finite_steps: int


@dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    baseline: float  # the local level it rose from (the trailing window's, at its trend)
    ranks: tuple[int, ...] = ()  # the ranks whose own loss spiked, when not all of them (`spiking_ranks`)
    sigmas: float = math.inf  # the jump at its onset in robust sigmas of the loss's noise there


def spiking_ranks(arrays: RunArrays, spike: Spike) -> tuple[int, ...]:
    """The ranks whose own loss at the spike's step is a spike against their own last SPIKE_WINDOW losses
    (the same level, noise and floors as the mean's); () when every rank's is (or the loss is one value on
    every rank)."""
    loss = np.asarray(arrays.loss)
    rows = np.flatnonzero(arrays.steps == spike.step)
    if rows.size == 0 or loss.strides[1] == 0:
        return ()
    i = int(rows[-1])
    before = loss[max(0, i - SPIKE_WINDOW) : i]
    before = np.where(np.isfinite(before), before, np.nan)
    # (A rank with no finite loss before: not judged.)
    level, sigma = stats.trend_level_sigma(before.T, SPIKE_TREND_T, SPIKE_EARLY_LEVEL)
    with np.errstate(invalid="ignore"):
        jump = loss[i] - level
        high = (jump > SPIKE_MADS * sigma) & (jump > SPIKE_MIN_RELATIVE * np.abs(level))
    if high.all() or not high.any():
        return ()
    return tuple(int(arrays.ranks[j]) for j in np.flatnonzero(high))


@dataclass(frozen=True)
class Convergence:
    trend: LossTrend
    first_loss: float
    last_loss: float
    nonfinite_step: int | None
    nonfinite_ranks: tuple[int, ...]
    spikes: tuple[Spike, ...]
    sparkline_values: tuple[float, ...]  # block means for a small chart (at most 40), NaN-free
    plateau: Plateau | None = None  # where an improving loss stopped improving (`plateau_start`)
    rise: Rise | None = None  # where a loss that had fallen turned up (`rise_start`)
    loss_before_nonfinite: float = math.nan  # the last finite loss before `nonfinite_step`, when recorded
    nonfinite_steps: int = 0  # steps in which some rank's loss was non-finite
    nonfinite_tail: NonfiniteTail | None = None  # where it stayed non-finite to the end (`nonfinite_tail`)
    nonfinite_last_steps: int = 0  # the run's last steps with a non-finite loss, too few for a tail
    skipped: SkippedSteps | None = None  # steps that trained nothing, with a finite loss (`skipped_steps`)


def loss_per_step(arrays: RunArrays) -> np.ndarray:
    """(S,) the mean over ranks of finite losses (NaN where no rank logged a finite loss)."""
    loss = np.asarray(arrays.loss)
    if loss.size == 0:
        return np.full(arrays.n_steps, np.nan)
    if loss.strides[1] == 0:  # one loss per step broadcast to every rank: no (S, R) work needed
        column = np.asarray(loss[:, 0], dtype=np.float64)
        return np.where(np.isfinite(column), column, np.nan)
    finite = np.isfinite(loss)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        total = np.where(finite, loss, 0.0).sum(axis=1)
        count = finite.sum(axis=1)
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def loss_trend(loss: np.ndarray) -> LossTrend:
    """Trend of the finite values of a 1-D loss series (already restricted to counted steps)."""
    x = loss[np.isfinite(loss)]
    if x.size < TREND_MIN_STEPS:
        return LossTrend("unknown", math.nan, math.nan, int(x.size))
    diff, se, first = _edge_change(x)
    t = diff / se if se > 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff))
    rel = diff / abs(first) if first != 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff))
    if t <= -TREND_T_CRIT and rel <= -TREND_MIN_SLOW_FALL:
        trend = "improving"
    elif t >= TREND_T_CRIT and rel >= TREND_MIN_RELATIVE_CHANGE:
        trend = "worsening"
    elif rel <= -TREND_MIN_RELATIVE_CHANGE and t <= -TREND_UNCLEAR_T:
        trend = "unclear"  # it fell by 5% or more, within the noise: it may be improving, or flat
    else:
        trend = "flat"
    return LossTrend(trend, float(t), float(rel), int(x.size))


def _edge_change(x: np.ndarray) -> tuple[float, float, float]:
    """(last quarter's block mean - first quarter's, its standard error, the first quarter's mean)."""
    means = stats.block_means(x, TREND_BLOCKS)
    first = float(means[:TREND_EDGE_BLOCKS].mean())
    se = stats.trimmed_von_neumann_sd(means) * math.sqrt(2.0 / TREND_EDGE_BLOCKS)
    return float(means[-TREND_EDGE_BLOCKS:].mean()) - first, se, first


@dataclass(frozen=True)
class Plateau:
    """Where an improving loss stopped improving, and how little it changed from there on."""

    step: int
    steps: int  # finite counted steps from there to the end
    relative_change: float  # last quarter of the tail against its first quarter
    # The most it may have moved (the change either way + PLATEAU_Z standard errors), of its level.
    bound: float
    fall: float  # how much it had fallen before, of the level of the run's first quarter


def plateau_start(loss: np.ndarray) -> tuple[int, float, float, float] | None:
    """(index into the finite values of `loss`, relative change from there and the bound on how much it may
    have moved, both of its level, how much it had fallen before, of the first quarter's) where an improving
    loss stopped
    improving: the earliest start of a tail (at least PLATEAU_MIN_SHARE of the values) that moved by less than
    PLATEAU_MAX_CHANGE of its level or PLATEAU_MAX_SHARE_OF_FALL of the fall before it, with confidence; None
    when the loss never improved or still does."""
    x = loss[np.isfinite(loss)]
    if loss_trend(x).trend not in ("improving", "unclear"):
        return None
    first = float(stats.block_means(x, TREND_BLOCKS)[:TREND_EDGE_BLOCKS].mean())
    shortest = max(TREND_MIN_STEPS, math.ceil(PLATEAU_MIN_SHARE * x.size))
    for start in np.linspace(0, x.size, PLATEAU_STARTS + 1).round().astype(int):
        if x.size - start < shortest:
            break
        change, se, level = _edge_change(x[start:])
        if not math.isfinite(se):
            continue
        moved = abs(change) + PLATEAU_Z * se  # the most it may have moved
        still_falling = se > 0 and change / se <= -TREND_T_CRIT
        fell = first - level
        if not still_falling and (
            moved < PLATEAU_MAX_CHANGE * abs(level) or moved < PLATEAU_MAX_SHARE_OF_FALL * fell
        ):
            scale = abs(level) if level else math.nan
            return int(start), change / scale, moved / scale, fell / abs(first) if first else math.nan
    return None


@dataclass(frozen=True)
class Rise:
    """Where a loss that had fallen turned up again, and by how much."""

    step: int  # where the rising tail's last block within noise of its lowest begins: the turn
    lowest: float  # the rising tail's lowest block mean
    steps: int  # finite counted steps from the turn to the end
    relative_change: float  # the tail's last quarter against its first quarter, of the first quarter's level
    t: float  # that change over its standard error
    last: float  # the mean of the tail's last quarter


def rise_start(loss: np.ndarray, steps: np.ndarray | None = None) -> Rise | None:
    """Where a loss that had fallen turned up again (a tail of at least RISE_MIN_SHARE of the finite values
    that rose significantly), at the lowest of that tail's block means; None when it did not. `steps`: the
    step number of each value of `loss` (default: its index)."""
    ok = np.isfinite(loss)
    x = loss[ok]
    at = (np.arange(loss.size) if steps is None else np.asarray(steps))[ok]
    trend = loss_trend(x).trend
    if trend not in ("improving", "flat", "unclear"):
        return None
    first = _edge_change(x)[2]
    shortest = max(TREND_MIN_STEPS, math.ceil(RISE_MIN_SHARE * x.size))
    for start in np.linspace(0, x.size, PLATEAU_STARTS + 1).round().astype(int):
        if x.size - start < shortest:
            break
        change, se, level = _edge_change(x[start:])
        if se > 0 and change / se >= RISE_T_CRIT and change >= TREND_MIN_RELATIVE_CHANGE * abs(level):
            means = stats.block_means(x[start:], TREND_BLOCKS)
            edges = start + np.linspace(0, x.size - start, TREND_BLOCKS + 1).round().astype(int)
            # The turn: where the last block still within noise of the lowest begins (a loss that sat flat
            # before it rose turned where the flat part ends, not at its noisiest low point; one that turned
            # in a V, about where its lowest block ends), before the last quarter.
            low = float(means.min())
            noise = stats.trimmed_von_neumann_sd(means)
            near = means[: TREND_BLOCKS - TREND_EDGE_BLOCKS] <= low + RISE_TURN_SDS * noise
            last_low = int(np.flatnonzero(near)[-1]) if near.any() else int(np.argmin(means))
            turn = edges[last_low]
            fell = first - low
            if trend in ("flat", "unclear") and not (
                fell >= TREND_MIN_RELATIVE_CHANGE * abs(first) and fell >= RISE_T_CRIT * math.sqrt(2) * noise
            ):
                return None  # a loss that ended where it began rose only if it clearly fell first
            return Rise(
                step=int(at[turn]),
                lowest=low,
                steps=int(x.size - turn),
                relative_change=change / abs(level),
                t=change / se,
                last=float(means[-TREND_EDGE_BLOCKS:].mean()),
            )
    return None


def find_spikes(loss: np.ndarray, steps: np.ndarray) -> tuple[Spike, ...]:
    """Upward jumps far above the local level (the trailing window's, at its trend); a run of consecutive
    spike steps counts once: at its first step, with its peak loss."""
    ok = np.isfinite(loss)
    x, st = loss[ok], steps[ok]
    med, sigma = stats.trailing_level_sigma(x, SPIKE_WINDOW, SPIKE_TREND_T, SPIKE_EARLY_LEVEL)
    early = slice(SPIKE_MIN_HISTORY, min(x.size, SPIKE_WINDOW))
    med[early], noise = stats.early_level_noise(x, SPIKE_MIN_HISTORY, SPIKE_WINDOW, SPIKE_EARLY_LEVEL)
    sigma[early] = stats.MAD_TO_SIGMA * noise
    with np.errstate(invalid="ignore"):
        jump = x - med
        hit = (jump > SPIKE_MADS * sigma) & (jump > SPIKE_MIN_RELATIVE * np.abs(med))
    idx = np.flatnonzero(hit)
    if idx.size == 0:
        return ()
    starts = np.concatenate(([True], np.diff(idx) > 1))
    group = np.cumsum(starts) - 1
    peaks = np.full(int(group[-1]) + 1, -1, dtype=np.int64)
    # The highest point of each consecutive run: order by loss so the last write per group wins.
    order = np.argsort(x[idx], kind="stable")
    peaks[group[order]] = idx[order]
    onsets = idx[starts]  # the step that started the run is the one to look at (its batch, its update)
    return tuple(
        Spike(
            int(st[o]),
            float(x[p]),
            float(med[o]),
            sigmas=float(jump[o] / sigma[o]) if sigma[o] > 0 else math.inf,
        )
        for o, p in zip(onsets, peaks, strict=True)
    )


def nonfinite_losses(arrays: RunArrays) -> np.ndarray:
    """(S, R) bool: where a rank's loss was non-finite: an infinite loss (a logged NaN or Inf), or each NaN
    after a rank's unbroken run of logged losses where it never logs a finite one again and its training
    stopped with it (`nonfinite_cells`). A loss broadcast to every rank is judged once, and blames every rank
    (a read-only view)."""
    loss = np.asarray(arrays.loss)
    s, r = loss.shape
    if s == 0 or r == 0:
        return np.zeros((s, r), dtype=bool)
    # A NaN where a rank has no record at all (never gathered: a hang, a kill) is missing, not a bad loss.
    present = np.isfinite(arrays.wall_ms)
    counts = np.asarray(arrays.optimizer_steps), np.asarray(arrays.micro_batches)
    if loss.strides[1] == 0:  # the same loss on every rank: judge one column, blame every rank
        return np.broadcast_to(nonfinite_cells(loss[:, :1], present.all(axis=1)[:, None], *counts), (s, r))
    return nonfinite_cells(loss, present, *counts)


def nonfinite_cells(
    loss: np.ndarray,
    present: np.ndarray | None = None,
    optimizer_steps: np.ndarray | None = None,
    micro_batches: np.ndarray | None = None,
) -> np.ndarray:
    """`nonfinite_losses` of a (S, C) loss array; `present`: where a rank has a record at all;
    `optimizer_steps`, `micro_batches`: the counts of the same cells (every rank's, when one loss column stands
    for all of them), for `stopped_training`; without them a rank's stop alone decides."""
    s = loss.shape[0]
    bad = np.isinf(loss)
    finite = np.isfinite(loss)
    has_finite = finite.any(axis=0)
    first_fin = finite.argmax(axis=0)
    last_fin = s - 1 - finite[::-1].argmax(axis=0)
    dense = finite.sum(axis=0) == (last_fin - first_fin + 1)  # logged every step, no gaps
    nan_end = has_finite & dense & (last_fin - first_fin >= 2) & (last_fin < s - 1)
    cols = np.flatnonzero(nan_end)
    if cols.size:
        # A rank that logged every step, then NaN to the end: what a NaN guard that skips the rest of each
        # step leaves (a Lightning training_step that returns None logs nothing), where training stopped too.
        after = np.isnan(loss[:, cols]) & (np.arange(s)[:, None] > last_fin[cols])
        if present is not None:
            after &= present[:, cols]
        stops = after[last_fin[cols] + 1, np.arange(cols.size)]  # (with a NaN, not with no record at all)
        if optimizer_steps is not None and micro_batches is not None:
            pick = cols if optimizer_steps.shape[1] == loss.shape[1] else slice(None)
            stops &= stopped_training(optimizer_steps[:, pick], micro_batches[:, pick], after)
        bad[:, cols[stops]] |= after[:, stops]
    return bad


def stopped_training(optimizer_steps: np.ndarray, micro_batches: np.ndarray, after: np.ndarray) -> np.ndarray:
    """(C,) bool: whether each column of `after` ((S, C) bool: where a rank's loss stopped being logged for
    good) is a rank whose training stopped with its loss: it trained before (a backward, where its backwards
    are seen, and an optimizer step, where its optimizer steps are) and not once from there on. A loop that
    stops calling `scope.log` and trains on has a loss not logged, not a NaN. The counts are (S, C), or
    (S, ranks) for one column that stands for every rank (one loss for all: some rank's counts). Where no
    optimizer step was ever recorded (runs from before the column, which also wrote a logged NaN as NaN),
    the stop alone decides: True."""
    opt = np.asarray(optimizer_steps, dtype=np.float64)
    if not np.isfinite(opt).any():
        return np.ones(after.shape[1], dtype=bool)
    stepped = np.asarray(np.nan_to_num(opt) > 0)
    backward = np.asarray(np.nan_to_num(np.asarray(micro_batches, dtype=np.float64)) > 0)
    if stepped.shape[1] != after.shape[1]:
        stepped = np.asarray(stepped.any(axis=1, keepdims=True))
        backward = np.asarray(backward.any(axis=1, keepdims=True))
    seen_steps, seen_backwards = stepped.any(axis=0), backward.any(axis=0)
    # (Neither seen in a column: no training to have stopped.)
    trained = (stepped | ~seen_steps) & (backward | ~seen_backwards) & (seen_steps | seen_backwards)
    return np.asarray((trained & ~after).any(axis=0) & ~(trained & after).any(axis=0))


def first_nonfinite(arrays: RunArrays, bad: np.ndarray | None = None) -> tuple[int | None, tuple[int, ...]]:
    """First step with a non-finite loss (`nonfinite_losses`, or `bad` when already computed), and the
    ranks whose loss was non-finite there."""
    bad = nonfinite_losses(arrays) if bad is None else bad
    any_bad = any_rank(bad)
    if not any_bad.any():
        return None, ()
    i = int(any_bad.argmax())
    return int(arrays.steps[i]), tuple(int(arrays.ranks[j]) for j in np.flatnonzero(bad[i]))


def any_rank(bad: np.ndarray) -> np.ndarray:
    """(S,) the steps where some rank's loss was non-finite, of `nonfinite_losses`."""
    return np.asarray(bad[:, 0] if bad.shape[1] and bad.strides[1] == 0 else bad.any(axis=1))


@dataclass(frozen=True)
class NonfiniteTail:
    """Where the loss stopped being finite for good: from `step` to the end, some rank's loss was non-finite
    in every step that had a loss (a rank's NaN poisons the all-reduced gradients of every rank)."""

    step: int
    steps: int  # the steps from there on with a non-finite loss
    ranks: tuple[int, ...]  # the ranks whose loss never became finite again; () where not known
    stepped: bool = True  # some optimizer step came after `step` (`never_stepped_from`)


NONFINITE_TAIL_MIN = 3
"""Non-finite steps at the end of a run before its loss reads as having stayed non-finite: one NaN on the last
step, after finite ones, is a transient that the run ended on, not where it was going. Unless the optimizer
never stepped again (`never_stepped_from`)."""


def nonfinite_tail(nonfinite: np.ndarray, loss: np.ndarray) -> tuple[int, int] | None:
    """(index of its first step, how many of its steps are non-finite) of the run's non-finite tail: the
    steps after the last one whose loss was finite (`loss`, the mean over ranks of finite losses, finite, and
    `nonfinite`, (S,) bool, False), from the first of them with a non-finite loss on some rank; None when
    there are none (the loss was finite again after its last non-finite step)."""
    finite = np.isfinite(loss) & ~nonfinite
    last_finite = int(finite.size - 1 - finite[::-1].argmax()) if finite.any() else -1
    after = np.flatnonzero(nonfinite[last_finite + 1 :])
    if after.size == 0:
        return None
    return last_finite + 1 + int(after[0]), int(after.size)


def never_stepped_from(arrays: RunArrays, step: int) -> bool:
    """No step updated the weights from `step` to the run's end (`weights_updated`): the weights the
    non-finite loss came from never changed again (a NaN guard skipping every batch since, one step that
    closed at the end; a scaler skipping every step), so the loss did not recover, however few steps that was."""
    since = arrays.steps >= step
    return bool(since.any()) and not weights_updated(arrays)[since].any()


def weights_updated(arrays: RunArrays) -> np.ndarray:
    """(S,) bool: some rank's optimizer stepped in the step and, in a run where backwards are seen, some rank
    ran one (a Lightning training_step that returns None skips the backward, and its optimizer still steps,
    on no gradient)."""
    stepped = (np.nan_to_num(np.asarray(arrays.optimizer_steps, dtype=np.float64)) > 0).any(axis=1)
    micro = np.nan_to_num(np.asarray(arrays.micro_batches, dtype=np.float64)) > 0
    return np.asarray(stepped & micro.any(axis=1) if micro.any() else stepped)


def never_finite_again(arrays: RunArrays, bad: np.ndarray, step: int) -> tuple[int, ...]:
    """The ranks with a non-finite loss (`bad`, (S, R)) at or after `step` whose loss was never finite after
    their last non-finite one."""
    since = arrays.steps >= step
    bad = bad[since]
    finite = np.isfinite(np.asarray(arrays.loss)[since])
    s = bad.shape[0]
    if s == 0:
        return ()
    last_bad = s - 1 - bad[::-1].argmax(axis=0)
    last_finite = np.where(finite.any(axis=0), s - 1 - finite[::-1].argmax(axis=0), -1)
    stuck = bad.any(axis=0) & (last_bad > last_finite)
    return tuple(int(arrays.ranks[j]) for j in np.flatnonzero(stuck))


SKIPPED_TAIL_MIN = 10
"""Steps in a row at the end of a run in which no optimizer stepped before the run reads as having stopped
training: a GradScaler halves its scale at each step it skips, so ten in a row are gradients still inf or NaN
at 1/1024 of the scale (an fp16 run's calibration skips a few in a row, and only at its start)."""
SKIPPED_MIN_SHARE = 0.1
SKIPPED_MIN_STEPS = 10
"""Skipped steps in the second half of the steps past warm-up that make a finding: 10% of them and at least
10. A healthy fp16 run's GradScaler skips about one step in its growth interval (2,000 steps by default) once
its scale has settled; while it settles, at the start, it skips more (15 of a 100-step run's first 17 steps,
with large gradients): the second half leaves those out."""


@dataclass(frozen=True)
class SkippedSteps:
    """Steps in which no rank's optimizer stepped (or none trained: forwards seen, no backward) while no
    rank's loss was non-finite (those are CONVERGENCE.NONFINITE's): a GradScaler skipping steps whose gradients
    hold inf or NaN, a guard that skips the step, a Lightning training_step that returned None."""

    steps: int  # skipped steps past warm-up
    counted: int  # steps past warm-up
    late_steps: int  # skipped steps in the second half of those
    late_counted: int
    first_step: int  # the first skipped step past warm-up (the tail's first where none is)
    last_step: int  # the last skipped step
    tail_step: int | None = None  # from here to the end no step trained: SKIPPED_TAIL_MIN steps or more
    tail_steps: int = 0


def skipped_steps(arrays: RunArrays, counted: np.ndarray, nonfinite: np.ndarray) -> SkippedSteps | None:
    """The run's skipped steps (see `SkippedSteps`), None when there are too few to report (`SKIPPED_*`) or
    no optimizer step is recorded at all (none watched). `counted`: (S,) bool, the steps past warm-up;
    `nonfinite`: (S,) bool, some rank's loss was non-finite (`any_rank`)."""
    optimizer_steps = np.asarray(arrays.optimizer_steps, dtype=np.float64)
    if not (np.nan_to_num(optimizer_steps) > 0).any():
        return None
    trained = weights_updated(arrays)
    # (A step whose optimizer steps were not recorded, NaN on every rank, is not known to be skipped.)
    skipped = np.isfinite(optimizer_steps).any(axis=1) & ~trained & ~nonfinite
    if not skipped.any():
        return None
    ended = trained | nonfinite
    last_ended = int(ended.size - 1 - ended[::-1].argmax()) if ended.any() else -1
    tail_steps = skipped.size - 1 - last_ended
    at = np.flatnonzero(counted)
    late = np.zeros_like(counted)
    late[at[at.size // 2 :]] = True
    n_late, late_counted = int(np.count_nonzero(skipped & late)), int(np.count_nonzero(late))
    if tail_steps < SKIPPED_TAIL_MIN and (
        n_late < SKIPPED_MIN_STEPS or n_late < SKIPPED_MIN_SHARE * max(late_counted, 1)
    ):
        return None
    tail_step = int(arrays.steps[last_ended + 1]) if tail_steps >= SKIPPED_TAIL_MIN else None
    first = np.flatnonzero(skipped & counted)
    return SkippedSteps(
        steps=int(first.size),
        counted=int(at.size),
        late_steps=n_late,
        late_counted=late_counted,
        first_step=int(arrays.steps[first[0]] if first.size else arrays.steps[last_ended + 1]),
        last_step=int(arrays.steps[np.flatnonzero(skipped)[-1]]),
        tail_step=tail_step,
        tail_steps=tail_steps if tail_steps >= SKIPPED_TAIL_MIN else 0,
    )


class LossHistory(NamedTuple):
    """Every step's loss in the run, for a diagnosis whose arrays hold only the latest steps (rank 0's live
    window): the loss's course (trend, plateau, rise, whether it stayed non-finite) is then judged as the
    final report judges it, and a live "stopped improving" cannot stand against an end-of-run "improving"."""

    steps: np.ndarray  # (S,)
    loss: np.ndarray  # (S,) the mean over ranks of finite losses, NaN where none was
    counted: np.ndarray  # (S,) bool: the steps the statistics use (`timing.statistics_steps`)
    nonfinite: np.ndarray  # (S,) bool: some rank's loss was non-finite (`nonfinite_losses`)


def convergence(
    arrays: RunArrays,
    sel: np.ndarray,
    seen: tuple[int, tuple[int, ...]] | None = None,
    history: LossHistory | None = None,
) -> Convergence:
    """`seen`: the run's first non-finite loss when known from steps before `arrays` (RunContext); `history`:
    the whole run's loss when `arrays` is a window of it. Spikes are looked for in `arrays` either way (they
    name the ranks that spiked), and so are the ranks whose loss stayed non-finite."""
    window = loss_per_step(arrays)
    bad = nonfinite_losses(arrays)
    if history is None:
        history = LossHistory(arrays.steps, window, sel, any_rank(bad))
    steps, per_step, sel_all, nonfinite = history
    # A step where some rank's loss was non-finite is a non-finite step: the mean of the other ranks' losses
    # there is not the run's loss ("last finite" would be half of a step that went NaN).
    finite = per_step[np.isfinite(per_step) & ~nonfinite]
    step, ranks = seen if seen is not None else first_nonfinite(arrays, bad)
    tail = None
    at = nonfinite_tail(nonfinite, per_step) if step is not None else None
    stepped = at is None or not never_stepped_from(arrays, int(steps[at[0]]))
    if at is not None and (at[1] >= NONFINITE_TAIL_MIN or not stepped):
        tail_step = int(steps[at[0]])
        tail = NonfiniteTail(tail_step, at[1], never_finite_again(arrays, bad, tail_step), stepped)
        # What the loss did before it stayed non-finite is the course to judge: after it, the finite losses of
        # the other ranks are the mean of fewer ranks, computed with poisoned weights.
        sel_all = sel_all & (steps < tail_step)
    counted = per_step[sel_all]
    counted_at = steps[sel_all]
    rise = rise_start(counted, counted_at)
    # A plateau bounds its tail's change by a share of the fall before it, which after a large fall admits a
    # tail that rose significantly: that tail is a rise, not a plateau.
    flat_from = plateau_start(counted) if rise is None else None
    plateau = None
    if flat_from is not None:
        finite_steps = counted_at[np.isfinite(counted)]
        start, change, bound, fall = flat_from
        plateau = Plateau(int(finite_steps[start]), int(finite_steps.size - start), change, bound, fall)
    before = math.nan
    if step is not None:
        earlier = np.flatnonzero(np.isfinite(per_step) & (steps < step))
        before = float(per_step[earlier[-1]]) if earlier.size else math.nan
    spark = finite
    if finite.size > 40:
        spark = stats.block_means(finite, 40)
    trend = loss_trend(counted)  # (of the finite losses)
    if tail is not None:
        trend = replace(trend, trend="non-finite")  # what fell before the NaN is not where the run is going
    return Convergence(
        trend=trend,
        first_loss=float(finite[0]) if finite.size else math.nan,
        last_loss=float(finite[-1]) if finite.size else math.nan,
        nonfinite_step=step,
        nonfinite_ranks=ranks,
        spikes=tuple(
            replace(x, ranks=spiking_ranks(arrays, x)) for x in find_spikes(window[sel], arrays.steps[sel])
        ),
        sparkline_values=tuple(float(v) for v in spark),
        plateau=plateau,
        rise=rise,
        loss_before_nonfinite=before,
        nonfinite_steps=int(np.count_nonzero(nonfinite)),
        nonfinite_tail=tail,
        nonfinite_last_steps=at[1] if at is not None and tail is None else 0,
        skipped=skipped_steps(arrays, counted_steps(arrays), any_rank(bad)),
    )
