"""Uncertainty of evaluation means: seeded percentile bootstrap over examples.

An evaluation score is a mean over examples, often a mean of per-task means (RULER's six-task mean).
The intervals here resample *examples*, within each task (stratum) separately, so every replicate
keeps the design of the measurement: the same tasks, each with its own number of examples.

    bootstrap_mean_ci(scores, strata=tasks)        the stratified mean, its 95% CI and bootstrap stderr
    bootstrap_ratio_ci(cost_a, cost_b, strata=...)  a ratio of means over paired examples (a cost ratio)

Pure functions of numpy arrays: the same inputs and seed give the same interval on every machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["Interval", "stratified_mean", "resample_indices", "bootstrap_mean_ci", "bootstrap_ratio_ci"]

N_BOOT = 2000          # replicates: the 2.5% / 97.5% percentiles move by < 0.5 points on 0-100 scores
LEVEL = 0.95
SEED = 0


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap interval. n: examples the estimate rests on."""

    estimate: float
    low: float
    high: float
    stderr: float          # standard deviation of the bootstrap replicates
    n: int
    level: float = LEVEL

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def _groups(n: int, strata: Sequence | None) -> list[np.ndarray]:
    """Row indices of each stratum, strata in sorted order (one group of all rows without strata)."""
    if strata is None:
        return [np.arange(n)]
    s = np.asarray(strata)
    if len(s) != n:
        raise ValueError(f"strata has {len(s)} entries for {n} values")
    return [np.flatnonzero(s == k) for k in sorted(set(s.tolist()))]


def stratified_mean(values, strata: Sequence | None = None) -> float:
    """Mean over strata of the within-stratum means (the plain mean without strata)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("no values")
    return float(np.mean([x[g].mean() for g in _groups(len(x), strata)]))


def resample_indices(n: int, strata: Sequence | None = None, n_boot: int = N_BOOT,
                     seed: int = SEED) -> list[np.ndarray]:
    """Bootstrap draws: per stratum (sorted), an (n_boot, n_stratum) array of row indices drawn with
    replacement from that stratum's rows. One generator seeded with `seed` draws the strata in order."""
    rng = np.random.default_rng(seed)
    out = []
    for g in _groups(n, strata):
        out.append(g[rng.integers(0, len(g), size=(n_boot, len(g)))])
    return out


def _draws(n: int, strata: Sequence | None, n_boot: int, seed: int) -> list[np.ndarray]:
    """resample_indices, or one pooled draw when a stratum has a single example (it cannot vary)."""
    if strata is not None and min(len(g) for g in _groups(n, strata)) < 2:
        strata = None
    return resample_indices(n, strata, n_boot, seed)


def _interval(estimate: float, reps: np.ndarray, n: int, level: float) -> Interval:
    a = (1 - level) / 2
    lo, hi = np.quantile(reps, [a, 1 - a])
    return Interval(float(estimate), float(lo), float(hi), float(reps.std(ddof=1)) if len(reps) > 1 else 0.0,
                    int(n), float(level))


def _check(n_boot: int, level: float) -> None:
    if n_boot < 2:
        raise ValueError("n_boot must be >= 2")
    if not 0 < level < 1:
        raise ValueError("level must be in (0, 1)")


def bootstrap_mean_ci(values, strata: Sequence | None = None, *, n_boot: int = N_BOOT, level: float = LEVEL,
                      seed: int = SEED) -> Interval:
    """The stratified mean of `values` (see stratified_mean) with a percentile bootstrap interval:
    each replicate resamples the examples of every stratum with replacement and recomputes the mean
    of stratum means. A stratum of a single example cannot vary under resampling: when any stratum is
    that small, the replicates resample all examples together (the pooled mean; equal to the
    stratified mean when every stratum has one example), so the interval still shows the spread."""
    _check(n_boot, level)
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("no values")
    if np.isnan(x).any():
        raise ValueError("values contain NaN")
    draws = _draws(len(x), strata, n_boot, seed)
    reps = np.mean([x[idx].mean(axis=1) for idx in draws], axis=0)
    return _interval(stratified_mean(x, strata), reps, len(x), level)


def bootstrap_ratio_ci(numerator, denominator, strata: Sequence | None = None, *, n_boot: int = N_BOOT,
                       level: float = LEVEL, seed: int = SEED) -> Interval:
    """mean(numerator) / mean(denominator) over paired examples (row i of both is one example), means
    stratified as in bootstrap_mean_ci; each replicate resamples the pairs."""
    _check(n_boot, level)
    a, b = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError("numerator and denominator must be equal-length, non-empty 1-D arrays")
    draws = _draws(len(a), strata, n_boot, seed)
    num = np.mean([a[idx].mean(axis=1) for idx in draws], axis=0)
    den = np.mean([b[idx].mean(axis=1) for idx in draws], axis=0)
    if (den <= 0).any():
        raise ValueError("the denominator's mean must be positive")
    return _interval(stratified_mean(a, strata) / stratified_mean(b, strata), num / den, len(a), level)
