"""Small-sample statistics for comparisons over seeds: mean +- sd and paired t intervals.

`mhc compare --seeds K` trains every kind on the same K seeds (same initial block weights and
the same batches in the same order per seed), so a kind's difference to the residual is
measured seed by seed and its 95% confidence interval comes from Student's t with K - 1
degrees of freedom:

    d_s = loss(kind, seed s) - loss(residual, seed s)
    mean(d) +- t_{0.975, K-1} * sd(d) / sqrt(K)

A difference is called significant when that interval excludes 0 (a two-sided paired t test
at the 5% level). Student's t quantile is computed here, without scipy: for an integer
number of degrees of freedom the t distribution's CDF has a closed form (a finite series in
theta = atan(t / sqrt(df)), Abramowitz and Stegun 26.7.3-4), inverted by bisection.
"""

from __future__ import annotations

import math

__all__ = ["mean_sd", "paired_difference", "t_cdf_two_sided", "t_quantile"]


def t_cdf_two_sided(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer df >= 1 (t >= 0)."""
    if not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an integer >= 1, got {df!r}")
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 1:  # 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        total, term = 0.0, math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c2 * (2 * k) / (2 * k + 1)
        return 2.0 / math.pi * (theta + s * total)
    total, term = 0.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for k in range(1, df // 2 + 1):
        total += term
        term *= c2 * (2 * k - 1) / (2 * k)
    return s * total


def t_quantile(p: float, df: int) -> float:
    """The p quantile (p in (0.5, 1)) of Student's t with integer df: t with P(T <= t) = p."""
    if not 0.5 < p < 1.0:
        raise ValueError(f"t_quantile expects p in (0.5, 1), got {p!r}")
    target = 2.0 * p - 1.0  # P(|T| <= t)
    lo, hi = 0.0, 1.0
    while t_cdf_two_sided(hi, df) < target:
        hi *= 2.0
    for _ in range(200):  # bisection to float precision
        mid = 0.5 * (lo + hi)
        if t_cdf_two_sided(mid, df) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator; NaN for one value)."""
    if not values:
        raise ValueError("mean_sd needs at least one value")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def paired_difference(values: list[float], baseline: list[float], level: float = 0.95) -> dict:
    """Mean of values[s] - baseline[s] with its t confidence interval over the pairs.

    Returns {"mean", "sd", "n", "ci_low", "ci_high", "significant"}; with one pair the
    interval is None and significant is None (one seed cannot separate a difference from
    noise).
    """
    if len(values) != len(baseline) or not values:
        raise ValueError(f"paired_difference needs equally many values and baseline values "
                         f"(at least one), got {len(values)} and {len(baseline)}")
    diffs = [v - b for v, b in zip(values, baseline, strict=True)]
    mean, sd = mean_sd(diffs)
    n = len(diffs)
    out = {"mean": mean, "sd": None if n == 1 else sd, "n": n,
           "ci_low": None, "ci_high": None, "significant": None}
    if n > 1:
        half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
        out.update(ci_low=mean - half, ci_high=mean + half,
                   significant=bool(mean - half > 0 or mean + half < 0))
    return out
