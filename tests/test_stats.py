"""openk3.stats: Wilson intervals against published values, the problem bootstrap, paired tests."""

from __future__ import annotations

import random

import pytest

from openk3 import stats


def test_wilson_matches_published_values():
    # Newcombe (1998), Table I: 0/10, 1/29 and 81/263 (method 3, the score interval without correction)
    assert stats.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert stats.wilson(1, 29) == pytest.approx((0.0061, 0.1718), abs=1e-4)
    assert stats.wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert stats.wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="k=3, n=2"):
        stats.wilson(3, 2)


def test_the_bootstrap_covers_the_true_mean_about_95_percent_of_the_time():
    rng = random.Random(1)
    hits = 0
    for trial in range(200):
        values = [rng.expovariate(1.0) for _ in range(40)]  # skewed, like think-token counts; true mean 1
        lo, hi = stats.mean_ci(values, seed=trial, resamples=400)
        hits += lo <= 1.0 <= hi
    assert 0.88 <= hits / 200 <= 0.99, hits


def test_samples_of_one_problem_move_together():
    """Four identical samples per problem are one observation: the interval is as wide as one sample each
    (and wider than treating 4 x 20 trajectories as independent)."""
    rng = random.Random(0)
    per = [float(rng.random() < 0.5) for _ in range(20)]
    values = [v for v in per for _ in range(4)]
    problems = [p for p in range(20) for _ in range(4)]
    clustered = stats.mean_ci(values, problems)
    naive = stats.mean_ci(values)
    single = stats.mean_ci(per)
    assert clustered == pytest.approx(single, abs=0.03)
    assert clustered[1] - clustered[0] > 1.5 * (naive[1] - naive[0])
    assert stats.rate_ci(per) == stats.wilson(sum(per), 20)  # 0/1, one per problem: Wilson
    assert stats.rate_ci(values, problems) == clustered


def test_paired_tests_use_the_pairing():
    """Problems of very different difficulty, b always a little better than a: unpaired intervals overlap
    completely, the paired difference is clearly positive."""
    hard = {f"p{k}": k / 10 for k in range(30)}
    better = {p: v + 0.05 for p, v in hard.items()}
    t = stats.paired(better, hard)
    assert t.estimate == pytest.approx(0.05) and t.ci95 == pytest.approx((0.05, 0.05)) and t.p_greater < 1e-3
    noisy = {p: v + (0.05 if k % 3 else -0.02) for k, (p, v) in enumerate(hard.items())}
    t = stats.paired(noisy, hard)
    assert t.ci95[0] > 0 and t.p_greater < 0.05 and t.n == 30
    assert stats.paired(hard, noisy).p_greater > 0.95
    assert stats.paired({"a": 1.0}, {"a": 0.0, "b": 1.0}).n == 1
    with pytest.raises(ValueError, match="share no problem"):
        stats.paired({"a": 1.0}, {"b": 1.0})
    ok, tests = stats.ordered([hard, noisy, {p: v + 1 for p, v in hard.items()}])
    assert ok and len(tests) == 2
    assert not stats.ordered([noisy, hard])[0]


def test_the_bootstrap_is_deterministic():
    values = [random.Random(3).random() for _ in range(50)]
    assert stats.mean_ci(values, seed=7) == stats.mean_ci(values, seed=7)


def test_gap_closed_is_a_paired_share_with_a_one_sided_bound():
    start = {f"p{k}": 0.0 for k in range(40)}
    target = {f"p{k}": float(k < 20) for k in range(40)}  # the target gains 0.5
    half = {f"p{k}": float(k < 10) for k in range(40)}  # closes half of it
    share = stats.gap_closed(half, start, target)
    assert share.estimate == pytest.approx(0.5) and share.ci95[0] < 0.5 < share.ci95[1]
    assert share.ci95[0] <= share.lower <= 0.5 and share.n == 40
    full = stats.gap_closed(target, start, target)
    assert full.estimate == 1.0 and full.ci95 == (1.0, 1.0) and full.lower == 1.0
    assert share.to_dict() == {"estimate": share.estimate, "ci95": list(share.ci95), "lower": share.lower, "n": 40}
    assert stats.gap_closed(half, start, start) is None  # no gain to close
    with pytest.raises(ValueError, match="share no problem"):
        stats.gap_closed({"x": 1.0}, start, target)
