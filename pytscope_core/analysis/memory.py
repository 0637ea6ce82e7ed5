"""Memory per step: the peak, which rank holds it, whether it climbs, and how close it is to the limit.

What is recorded is a high-water mark: the CUDA allocator's `max_memory_allocated` (never reset by pytscope,
so the user's own readings stay true) or the host's peak RSS. It only grows, so one long batch or an
evaluation raises it once for the rest of the run. Growth therefore compares the first and last quarter of
block means with the same trend-robust noise estimate as the loss trend, and also asks how the rise is
spread: a leak climbs block after block, a one-off peak rises in one place.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from ..arrays import RunArrays
from ..context import RunContext
from . import stats

GROWTH_MIN_STEPS = 50
"""Fewer finite steps and growth is not judged."""
_BLOCKS, _EDGE = 20, 5


@dataclass(frozen=True)
class MemoryStats:
    peak_bytes: float  # NaN when no memory was recorded
    peak_rank: int | None
    growth_bytes: float  # last-quarter mean minus first-quarter mean of the per-step peak
    growth_relative: float
    growth_t: float  # growth over its standard error
    largest_rise_share: float  # the largest rise between consecutive block means, as a share of growth
    limit_bytes: float | None
    peak_fraction: float | None  # peak_bytes / limit_bytes
    rank_peaks: tuple[float, ...]  # one per rank that has rows, in the order of `ranks`
    ranks: tuple[int, ...]  # the rank ids of `rank_peaks`: a rank with no rows has no column, so not 0..R-1


def memory_stats(arrays: RunArrays, ctx: RunContext, sel: np.ndarray) -> MemoryStats:
    mem = np.asarray(arrays.mem_bytes)
    nan = math.nan
    limit = float(ctx.mem_limit_bytes) if ctx.mem_limit_bytes else None
    rank_ids = tuple(int(r) for r in arrays.ranks)
    if mem.size == 0 or not np.isfinite(mem).any():
        return MemoryStats(
            nan, None, nan, nan, nan, nan, limit, None, tuple(nan for _ in arrays.ranks), rank_ids
        )
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        if mem.strides[1] == 0:
            per_step = np.asarray(mem[:, 0], dtype=np.float64)
            rank_peaks = np.full(mem.shape[1], np.nanmax(per_step))
        else:
            per_step = np.nanmax(mem, axis=1).astype(np.float64)
            rank_peaks = np.nanmax(mem, axis=0).astype(np.float64)
    peak_i = int(np.nanargmax(rank_peaks))
    peak = float(rank_peaks[peak_i])
    x = per_step[sel]
    x = x[np.isfinite(x)]
    growth, rel, t, rise_share = nan, nan, nan, nan
    if x.size >= GROWTH_MIN_STEPS:
        means = stats.block_means(x, _BLOCKS)
        first, last = float(means[:_EDGE].mean()), float(means[-_EDGE:].mean())
        growth = last - first
        rel = growth / first if first > 0 else nan
        se = stats.von_neumann_sd(means) * math.sqrt(2.0 / _EDGE)
        t = growth / se if se > 0 else (math.inf if growth > 0 else 0.0)
        rise_share = float(np.diff(means).max()) / growth if growth > 0 else nan
    return MemoryStats(
        peak_bytes=peak,
        peak_rank=rank_ids[peak_i],
        growth_bytes=growth,
        growth_relative=rel,
        growth_t=t,
        largest_rise_share=rise_share,
        limit_bytes=limit,
        peak_fraction=peak / limit if limit else None,
        rank_peaks=tuple(float(v) for v in rank_peaks),
        ranks=rank_ids,
    )
