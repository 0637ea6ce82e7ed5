"""Robust statistics over (steps x ranks) arrays, shared by every analysis module.

Everything here is vectorised over steps and ranks (no Python loop over either) because the analysis has to
diagnose 1,024 ranks x 10,000 steps in under two seconds; functions tolerate NaN (a rank with no record in a
step) and return NaN rather than raising when there is nothing to measure.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

MAD_TO_SIGMA = 1.4826
"""Scales a median absolute deviation to a standard deviation for normal noise."""


def has_gaps(x: np.ndarray) -> bool:
    """True when some entries are NaN (missing records): callers then take the slower nan-aware path."""
    return bool(np.isnan(x).any()) if x.size else False


MEDIAN_MAX_STEPS = 4096
"""Per-rank medians use at most this many evenly spaced steps: a partition over 10,000 steps x 1,024 ranks
costs 0.3 s each, and the sampling error of a median of 4,096 steps is far below step-to-step noise."""


def median_sample(steps: int) -> slice:
    """The evenly spaced steps (at most MEDIAN_MAX_STEPS of `steps`) that per-rank medians are taken over:
    slice a derived array's operands with it, and the steps left out are never computed."""
    return slice(None, None, max(1, -(-steps // MEDIAN_MAX_STEPS)))


def median_over_steps(x: np.ndarray) -> np.ndarray:
    """Per-rank median of a (steps x ranks) array, ignoring NaN; NaN for a rank with no value."""
    if x.shape[0] == 0:
        return np.full(x.shape[1:], np.nan)
    x = np.ascontiguousarray(x[median_sample(x.shape[0])].T)  # each rank's steps adjacent: a faster partition
    if not has_gaps(x):
        return np.asarray(np.median(x, axis=1), dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(np.nanmedian(x, axis=1), dtype=np.float64)


def mean_over_ranks(x: np.ndarray) -> np.ndarray:
    """Per-step mean across ranks, ignoring NaN; NaN for a step no rank recorded."""
    if x.shape[1] == 0:
        return np.full(x.shape[0], np.nan)
    if not has_gaps(x):
        return np.asarray(x.mean(axis=1), dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(np.nanmean(x, axis=1), dtype=np.float64)


def nanquantile(x: np.ndarray, q: float) -> float:
    """Quantile of the finite values of a 1-D array; NaN when there are none."""
    x = x[np.isfinite(x)]
    return float(np.quantile(x, q)) if x.size else math.nan


def median_of_others(x: np.ndarray) -> np.ndarray:
    """For each step and rank, the median of the *other* ranks' values in that step.

    Uses three order statistics per step instead of R medians: removing the element at sorted position k
    from a sorted row shifts every position above k down by one, so the median of the rest is one of the
    row's central order statistics, chosen by comparing the element with them (ties give equal values).
    Rows must not contain NaN. Returns NaN everywhere for a single rank.
    """
    s, r = x.shape
    if r < 2 or s == 0:
        return np.full(x.shape, np.nan, dtype=x.dtype)
    if r % 2 == 0:  # the others are an odd count: one central element
        j = r // 2 - 1
        part = np.partition(x, (j, j + 1), axis=1)
        lo, hi = part[:, j : j + 1], part[:, j + 1 : j + 2]
        return np.where(x > lo, lo, hi)
    a = (r - 3) // 2  # the others are an even count: mean of two central elements
    part = np.partition(x, (a, a + 1, a + 2), axis=1)
    sa, sb, sc = part[:, a : a + 1], part[:, a + 1 : a + 2], part[:, a + 2 : a + 3]
    lower = np.where(x > sa, sa, sb)
    upper = np.where(x > sb, sb, sc)
    return (lower + upper) * 0.5


def binomial_z(successes: np.ndarray, trials: int, p: float = 0.5) -> np.ndarray:
    """Normal-approximation z score of `successes` out of `trials` against chance `p`."""
    if trials <= 0:
        return np.zeros(np.shape(successes))
    return (np.asarray(successes, dtype=np.float64) - trials * p) / math.sqrt(trials * p * (1.0 - p))


def block_means(x: np.ndarray, n_blocks: int) -> np.ndarray:
    """Means of `n_blocks` contiguous, (nearly) equal blocks of a 1-D array; averaging kills per-step noise."""
    edges = np.linspace(0, x.size, n_blocks + 1).round().astype(np.int64)
    sums = np.add.reduceat(x, edges[:-1]) if x.size else np.zeros(n_blocks)
    counts = np.diff(edges)
    with np.errstate(all="ignore"):
        return np.asarray(sums / counts, dtype=np.float64)


def von_neumann_sd(x: np.ndarray) -> float:
    """Noise standard deviation from successive differences: a slow trend barely inflates it."""
    if x.size < 3:
        return math.nan
    return float(math.sqrt(np.sum(np.diff(x) ** 2) / (2.0 * (x.size - 1))))


def trimmed_von_neumann_sd(x: np.ndarray, outlier: float = 5.0, max_trimmed: int = 2) -> float:
    """`von_neumann_sd` without the (at most `max_trimmed`) successive differences more than `outlier`
    times their median size: a steep first block or one spike would otherwise pass for noise. With normal
    noise a difference that large is rare (about 1 in 1,300), so flat runs keep nearly every difference."""
    if x.size < 3:
        return math.nan
    d = np.abs(np.diff(x))
    scale = float(np.median(d))
    big = np.argsort(d)[::-1][:max_trimmed]
    drop = big[d[big] > outlier * scale] if scale > 0 else big[:0]
    kept = np.delete(d, drop)
    return float(math.sqrt(np.sum(kept**2) / (2.0 * kept.size)))


def trailing_median_mad(x: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Median and MAD of the `window` values before each point (NaN for the first `window` points)."""
    n = x.size
    med = np.full(n, np.nan)
    mad = np.full(n, np.nan)
    if n <= window:
        return med, mad
    views = np.lib.stride_tricks.sliding_window_view(x[:-1], window)  # views[i] = x[i : i + window]
    m = np.median(views, axis=1)
    med[window:] = m
    mad[window:] = np.median(np.abs(views - m[:, None]), axis=1)
    return med, mad


UPPER_DECILE_SIGMAS = 1.2816
"""A normal distribution's 90th percentile sits this many sigmas above its median."""


def trailing_upper_sigma(x: np.ndarray, window: int, med: np.ndarray) -> np.ndarray:
    """The spread of the `window` values before each point above their median `med`, as a sigma: (90th
    percentile - median) / 1.2816. The MAD's sigma for symmetric noise; larger for right-skewed noise (a
    converged cross-entropy's batches), whose common high values a symmetric scale would call outliers."""
    out = np.full(x.size, np.nan)
    if x.size > window:
        views = np.lib.stride_tricks.sliding_window_view(x[:-1], window)
        out[window:] = (np.quantile(views, 0.9, axis=1) - med[window:]) / UPPER_DECILE_SIGMAS
    return out


def early_level_noise(x: np.ndarray, start: int, stop: int, recent: int) -> tuple[np.ndarray, np.ndarray]:
    """For each point i in [start, min(stop, x.size)): the median of the `recent` values before it (a level that
    keeps up with the fast fall at the start of training), and a robust noise scale from the successive
    differences of all the values before it (their MAD over sqrt(2): the values' own MAD for independent noise
    around a level, but not inflated, as that is, by the fall itself)."""
    idx = range(start, min(stop, x.size))
    d = np.diff(x[: idx.stop])  # d[: i - 1]: the differences among the values before point i
    level = np.array([np.median(x[max(0, i - recent) : i]) for i in idx])
    noise = np.array([np.median(np.abs(d[: i - 1] - np.median(d[: i - 1]))) for i in idx]) / math.sqrt(2.0)
    return level, noise
