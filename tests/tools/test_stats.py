"""Student's t quantiles and paired differences over seeds (torch_mhc.tools.compare.stats)."""

import math

import pytest

from torch_mhc.tools.compare.stats import mean_sd, paired_difference, t_cdf_two_sided, t_quantile


def t_cdf_two_sided_numeric(t, df, steps=20000):
    """P(|T| <= t) by Simpson's rule on Student's t density (plain reference)."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    pdf = lambda u: c * (1 + u * u / df) ** (-(df + 1) / 2)  # noqa: E731
    h = t / steps
    s = pdf(0) + pdf(t) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, steps))
    return 2 * s * h / 3


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 12, 29])
@pytest.mark.parametrize("t", [0.3, 1.0, 2.5, 6.0])
def test_cdf_matches_numerical_integration(df, t):
    assert t_cdf_two_sided(t, df) == pytest.approx(t_cdf_two_sided_numeric(t, df), abs=1e-10)


def test_quantiles_closed_forms_and_table():
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-10)
    # df = 2: t = (2p - 1) / sqrt(2 p (1 - p))
    assert t_quantile(0.975, 2) == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), rel=1e-10)
    # the printed two-sided 95% table
    for df, want in [(3, 3.182), (4, 2.776), (5, 2.571), (9, 2.262), (10, 2.228), (30, 2.042)]:
        assert round(t_quantile(0.975, df), 3) == want
    assert t_quantile(0.995, 4) == pytest.approx(4.604, abs=5e-4)
    assert t_cdf_two_sided(0.0, 3) == 0.0
    assert t_quantile(0.975, 10_000) == pytest.approx(1.95996, abs=1e-3)  # -> normal


def test_mean_sd_and_paired_difference():
    assert mean_sd([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert math.isnan(mean_sd([5.0])[1])
    # differences 0.1, 0.1, 0.4: mean 0.2, sd sqrt(0.03), half width t(0.975, 2) sd / sqrt(3)
    d = paired_difference([1.1, 2.1, 3.4], [1.0, 2.0, 3.0])
    half = 4.302652729749464 * math.sqrt(0.03) / math.sqrt(3)
    assert d["mean"] == pytest.approx(0.2) and d["sd"] == pytest.approx(math.sqrt(0.03))
    assert d["ci_low"] == pytest.approx(0.2 - half) and d["ci_high"] == pytest.approx(0.2 + half)
    assert d["significant"] is False and d["n"] == 3  # 0.2 - 0.43 < 0 < 0.2 + 0.43
    tight = paired_difference([1.1, 2.1, 3.11], [1.0, 2.0, 3.0])
    assert tight["significant"] is True and tight["ci_low"] > 0
    below = paired_difference([0.9, 1.9, 2.89], [1.0, 2.0, 3.0])
    assert below["significant"] is True and below["ci_high"] < 0
    one = paired_difference([1.5], [1.0])
    assert one["mean"] == 0.5 and one["ci_low"] is None and one["significant"] is None
    with pytest.raises(ValueError, match="equally many values .* got 2 and 1"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match=r"p in \(0.5, 1\), got 0.4"):
        t_quantile(0.4, 3)
