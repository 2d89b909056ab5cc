"""Statistics shared by the benchmarks: percentile-bootstrap intervals of medians and of ratios.

Used by `bench.cluster.report` (unpaired cells: each side resampled on its own) and by
`bench.ab.report` (paired: the same request sent to every system, so a ratio is taken per
request and its median bootstrapped, whole sessions at a time). Intervals are percentile bootstrap intervals (Efron &
Tibshirani, "An Introduction to the Bootstrap", ch. 13), `RESAMPLES` resamples, seeded, so the
same values always give the same interval.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


def bootstrap_ci(values: Sequence[float], statistic: Callable = np.median, resamples: int = RESAMPLES,
                 level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic` over `values` (None dropped; NaNs if none left)."""
    data = np.asarray([v for v in values if v is not None], dtype=float)
    if data.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    stats = statistic(rng.choice(data, size=(resamples, data.size), replace=True), axis=1)
    tail = (1.0 - level) / 2 * 100
    return float(np.percentile(stats, tail)), float(np.percentile(stats, 100 - tail))


def ratio_ci(numerator: Sequence[float], denominator: Sequence[float], resamples: int = RESAMPLES,
             level: float = LEVEL, seed: int = 0) -> tuple[float, float, float]:
    """median(numerator) / median(denominator) and its bootstrap interval (each side resampled
    on its own: the samples are not paired). NaNs if either side is empty."""
    a = np.asarray(numerator, dtype=float)
    b = np.asarray(denominator, dtype=float)
    if a.size == 0 or b.size == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    ra = np.median(rng.choice(a, size=(resamples, a.size)), axis=1)
    rb = np.median(rng.choice(b, size=(resamples, b.size)), axis=1)
    tail = (1.0 - level) / 2 * 100
    ratios = ra / rb
    return float(np.median(a) / np.median(b)), float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))


def paired_ratios(numerator: dict, denominator: dict) -> list[float]:
    """Per-key ratios `numerator[k] / denominator[k]` over the keys both have (sorted keys;
    None and non-positive denominators dropped). Keys are e.g. (repeat, session, turn)."""
    return [ratio for _, ratio in paired_ratio_items(numerator, denominator)]


def paired_ratio_items(numerator: dict, denominator: dict) -> list[tuple]:
    """`(key, ratio)` pairs of `paired_ratios`, in the same order."""
    out = []
    for key in sorted(set(numerator) & set(denominator)):
        a, b = numerator[key], denominator[key]
        if a is not None and b is not None and b > 0:
            out.append((key, a / b))
    return out


def paired_statistic_ratio_ci(numerator: dict, denominator: dict, statistic: Callable = np.mean,
                              resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0) -> tuple[float, float, float, int]:
    """statistic(numerator's values) / statistic(denominator's) over the keys both have, and its
    bootstrap interval with the same keys resampled on both sides (paired: e.g. the mean TTFT of
    the same requests on two systems). `statistic` takes `axis`. Returns (ratio, low, high, n);
    NaNs and 0 without common keys."""
    keys = sorted(set(numerator) & set(denominator))
    if not keys:
        return math.nan, math.nan, math.nan, 0
    a = np.array([numerator[k] for k in keys], dtype=float)
    b = np.array([denominator[k] for k in keys], dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(keys), size=(resamples, len(keys)))
    samples = statistic(a[idx], axis=1) / statistic(b[idx], axis=1)
    tail = (1.0 - level) / 2 * 100
    return (float(statistic(a) / statistic(b)), float(np.percentile(samples, tail)),
            float(np.percentile(samples, 100 - tail)), len(keys))


def paired_ratio_ci(ratios: Sequence[float], groups: Optional[Sequence] = None, resamples: int = RESAMPLES,
                    level: float = LEVEL, seed: int = 0) -> tuple[float, float, float]:
    """Median of per-request paired ratios and its bootstrap interval.

    Args:
        ratios: One paired ratio per request.
        groups: Optional group of each ratio (e.g. its (repeat, session)): then whole groups are
            resampled (a cluster bootstrap), since the turns of one session are not independent;
            None resamples requests.

    Returns:
        (median, low, high); NaNs if `ratios` is empty.
    """
    if len(ratios) == 0:
        return math.nan, math.nan, math.nan
    median = float(np.median(np.asarray(ratios, dtype=float)))
    if groups is None:
        lo, hi = bootstrap_ci(ratios, resamples=resamples, level=level, seed=seed)
        return median, lo, hi
    blocks: dict = {}
    for ratio, group in zip(ratios, groups):
        blocks.setdefault(group, []).append(ratio)
    arrays = [np.asarray(b, dtype=float) for b in blocks.values()]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(arrays), size=(resamples, len(arrays)))
    stats = np.array([np.median(np.concatenate([arrays[i] for i in row])) for row in picks])
    tail = (1.0 - level) / 2 * 100
    return median, float(np.percentile(stats, tail)), float(np.percentile(stats, 100 - tail))


def excludes_one(interval: Sequence[float]) -> bool:
    """True if the interval `(low, high)` lies wholly above or below 1.0 (False with NaNs)."""
    lo, hi = interval[0], interval[1]
    return not (math.isnan(lo) or math.isnan(hi)) and (hi < 1.0 or lo > 1.0)


def half_width(median: float, interval: Sequence[float]) -> Optional[float]:
    """The interval's larger half-width relative to the median (0.1 = +-10%); None with NaNs."""
    lo, hi = interval[0], interval[1]
    if any(math.isnan(x) for x in (median, lo, hi)) or median == 0:
        return None
    return max(median - lo, hi - median) / median
