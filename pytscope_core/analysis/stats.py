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


UPPER_DECILE_SIGMAS = 1.2816
"""A normal distribution's 90th percentile sits this many sigmas above its median."""

MEDIAN_SE = math.sqrt(math.pi / 2.0)
"""The standard error of the median of n normal values is this times sigma / sqrt(n)."""


def row_quantile(rows: np.ndarray, q: float) -> np.ndarray:
    """The `q` quantile (numpy's linear interpolation) of each row of `rows` (..., n), n >= 2, without NaN: a
    partition at one order statistic and a min for the next, several times faster than `np.quantile` or a
    partition at both over the sliding windows of a long run."""
    position = q * (rows.shape[-1] - 1)
    k = min(int(position), rows.shape[-1] - 2)
    part = np.partition(rows, k, axis=-1)
    low, high = part[..., k], part[..., k + 1 :].min(axis=-1)
    return np.asarray(low + (position - k) * (high - low), dtype=np.float64)


def _nan_row_quantile(rows: np.ndarray, q: float) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (a row with no value: NaN)
        return np.asarray(np.nanquantile(rows, q, axis=-1), dtype=np.float64)


def trend_level_sigma(rows: np.ndarray, min_t: float, recent: int) -> tuple[np.ndarray, np.ndarray]:
    """For each row of `rows` (..., window): where its trend puts the point after it, and a robust sigma of
    its values around that trend; NaN in a row is left out.

    The trend is the line through the medians of the row's two halves where they differ by `min_t` standard
    errors or more (the noise from the median size of the row's successive differences, which a trend does
    not inflate), else flat: a loss still falling (or rising) over the row is judged against where it is now,
    not against the row's median, which lags, and its fall is not noise. A falling row's level is that line at
    the next point, moved by the median residual of the last `recent` values: a fall that slows (training's,
    exponential or a power law) lies above the line there, and extending the line alone put the level of a
    loss falling 5x in the row at half what it was. A flat row's level is its median: detrending noise would
    only add the slope's error to it. The sigma is the larger of the residuals' MAD's and their spread from the
    median to the 90th percentile, (90th percentile - median) / 1.2816: the MAD's sigma for symmetric noise,
    larger for right-skewed noise (a converged cross-entropy's batches), whose common high values a symmetric
    scale would call outliers."""
    window = rows.shape[-1]
    quantile = _nan_row_quantile if has_gaps(rows) else row_quantile
    half = window // 2
    with np.errstate(invalid="ignore"):
        first, last = quantile(rows[..., :half], 0.5), quantile(rows[..., window - half :], 0.5)
        noise = MAD_TO_SIGMA * quantile(np.abs(np.diff(rows, axis=-1)), 0.5) / math.sqrt(2.0)
        rise = last - first
        trending = np.abs(rise) >= min_t * MEDIAN_SE * noise * math.sqrt(2.0 / half)
        slope = np.where(
            trending, rise / (window - half), 0.0
        )  # (window - half: between the halves' centres)
        centre = window - half + (half - 1) / 2.0  # the last half's
        residual = rows - (last[..., None] + slope[..., None] * (np.arange(window) - centre))
        mid = quantile(residual, 0.5)
        mad = quantile(np.abs(residual - mid[..., None]), 0.5)
        upper = (quantile(residual, 0.9) - mid) / UPPER_DECILE_SIGMAS
        now = np.where(trending, quantile(residual[..., -recent:], 0.5), mid)
        level = last + slope * (window - centre) + now
        return np.asarray(level, dtype=np.float64), np.fmax(MAD_TO_SIGMA * mad, upper)


def trailing_level_sigma(
    x: np.ndarray, window: int, min_t: float, recent: int
) -> tuple[np.ndarray, np.ndarray]:
    """`trend_level_sigma` of the `window` values before each point of a 1-D array, at that point (NaN for
    the first `window` points)."""
    level = np.full(x.size, np.nan)
    sigma = np.full(x.size, np.nan)
    if x.size > window:
        views = np.lib.stride_tricks.sliding_window_view(x[:-1], window)  # views[i] = x[i : i + window]
        level[window:], sigma[window:] = trend_level_sigma(views, min_t, recent)
    return level, sigma


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
