"""95 % intervals and paired tests for evaluations and experiments (stdlib only, deterministic).

    wilson(k, n)                          -> (lo, hi): a rate of k successes in n independent trials
    mean_ci(values, groups=ids)           -> (lo, hi): a mean, bootstrapped over groups (problems) when given
    paired(a, b)                          -> Paired: mean over shared problems of a - b, its interval and the
                                             one-sided p-value of "a > b"
    ordered([x, y, z])                    -> whether x < y < z holds pair by pair at 0.05 (paired tests)

Why these: a rate is Wilson's score interval (it keeps its coverage near 0 and 1, where the normal
approximation gives intervals outside [0, 1] or of width 0); a mean of think tokens is skewed, so it is the
percentile bootstrap. Two models (or two efforts) evaluated on the same problems are compared problem by
problem: the pairing removes the problems' own difficulty from the noise (background §3.9: 32 problems give a
standard error of ~0.06 on an accuracy; a paired difference is far tighter). Several samples of one problem
are not independent, so every bootstrap resamples problems (clusters), never single trajectories.

The bootstrap draws with `random.Random(seed)`: the same inputs give the same interval on every machine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054  # the normal quantile of 0.975
B_DEFAULT = 2000  # bootstrap resamples: the interval's ends move by ~0.01 standard errors between seeds
ALPHA = 0.05  # the one-sided level of "better" and "ordered"


def wilson(k: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a rate of k successes in n trials ((0, 1) when n is 0)."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"wilson: need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, centre - half), min(1.0, centre + half))


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _clusters(values: Sequence[float], groups: Sequence[Hashable] | None) -> list[tuple[float, int]]:
    """(sum, count) per group, in first-appearance order (each value its own group when `groups` is None)."""
    if groups is None:
        return [(float(v), 1) for v in values]
    if len(groups) != len(values):
        raise ValueError(f"mean_ci: {len(values)} values but {len(groups)} group ids")
    table: dict[Hashable, list[float]] = {}
    for v, g in zip(values, groups, strict=True):
        table.setdefault(g, [0.0, 0])
        table[g][0] += float(v)
        table[g][1] += 1
    return [(s, int(c)) for s, c in table.values()]


def mean_ci(values: Sequence[float], groups: Sequence[Hashable] | None = None, *, seed: int = 0,
            resamples: int = B_DEFAULT) -> tuple[float, float]:
    """Percentile-bootstrap 95 % interval of the mean of `values`, resampling whole groups (`groups[i]`: the
    problem of value i) so that samples of one problem move together. One group (or none): the point itself."""
    if not values:
        raise ValueError("mean_ci: no values")
    clusters = _clusters(values, groups)
    total = sum(s for s, _ in clusters) / sum(c for _, c in clusters)
    if len(clusters) < 2:
        return (total, total)
    rng = random.Random(seed)
    k = len(clusters)
    means = []
    for _ in range(resamples):
        s = c = 0.0
        for _ in range(k):
            cs, cc = clusters[rng.randrange(k)]
            s += cs
            c += cc
        means.append(s / c)
    means.sort()
    return (_quantile(means, 0.025), _quantile(means, 0.975))


def rate_ci(values: Sequence[float], groups: Sequence[Hashable] | None = None, *, seed: int = 0
            ) -> tuple[float, float]:
    """The interval of a rate: Wilson's when the values are 0/1 and each problem has one (independent trials),
    else the problem bootstrap (`mean_ci`; a fractional reward, or several samples per problem)."""
    binary = all(v in (0, 1) for v in values)
    single = groups is None or len(set(groups)) == len(groups)
    if binary and single:
        return wilson(sum(values), len(values))
    return mean_ci(values, groups, seed=seed)


@dataclass(frozen=True)
class Paired:
    """a - b over the problems both were evaluated on: the mean difference, its 95 % interval, the one-sided
    p-value of "a > b" (the bootstrap share of resamples whose difference is <= 0, with the +1 correction) and
    the number of problems."""

    estimate: float
    ci95: tuple[float, float]
    p_greater: float
    n: int

    def to_dict(self) -> dict:
        return {"estimate": self.estimate, "ci95": list(self.ci95), "p_greater": self.p_greater, "n": self.n}


def per_problem(values: Sequence[float], problems: Sequence[Hashable]) -> dict[Hashable, float]:
    """{problem: the mean of its values} (several samples of a problem become one paired observation)."""
    return {g: s / c for g, (s, c) in zip(dict.fromkeys(problems), _clusters(values, problems), strict=True)}


def paired(a: Mapping[Hashable, float], b: Mapping[Hashable, float], *, seed: int = 0,
           resamples: int = B_DEFAULT) -> Paired:
    """Compare two arms problem by problem (`a`, `b`: {problem: score}, e.g. `per_problem`), over the problems
    they share. ValueError when they share none."""
    shared = [p for p in a if p in b]
    if not shared:
        raise ValueError("paired: the two arms share no problem")
    d = [float(a[p]) - float(b[p]) for p in shared]
    n = len(d)
    estimate = sum(d) / n
    if n < 2 or all(x == d[0] for x in d):
        return Paired(estimate, (estimate, estimate), 0.0 if estimate > 0 else 1.0, n)
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    at_most_zero = sum(m <= 0 for m in means)
    return Paired(estimate, (_quantile(means, 0.025), _quantile(means, 0.975)),
                  (at_most_zero + 1) / (resamples + 1), n)


def ordered(arms: Sequence[Mapping[Hashable, float]], *, seed: int = 0, alpha: float = ALPHA) -> tuple[bool, list]:
    """Whether arms[0] < arms[1] < ... holds with a one-sided paired test at `alpha` for every adjacent pair;
    returns (verdict, [Paired of arms[i+1] - arms[i]])."""
    tests = [paired(hi, lo, seed=seed) for lo, hi in zip(arms, arms[1:])]
    return all(t.p_greater < alpha for t in tests), tests


@dataclass(frozen=True)
class Share:
    """(a - start) / (target - start) over shared problems: the share of the target's gain that `a` closes, its
    95 % interval and its one-sided lower bound at ALPHA (the bootstrap's 5th percentile), from resamples of
    problems (those where the target's gain is 0 are left out); None where the gain is 0 in the data."""

    estimate: float
    ci95: tuple[float, float]
    lower: float
    n: int

    def to_dict(self) -> dict:
        return {"estimate": self.estimate, "ci95": list(self.ci95), "lower": self.lower, "n": self.n}


def gap_closed(a: Mapping[Hashable, float], start: Mapping[Hashable, float], target: Mapping[Hashable, float], *,
               seed: int = 0, resamples: int = B_DEFAULT) -> Share | None:
    """The share of `target`'s gain over `start` that `a` closes, paired over the problems all three share."""
    shared = [p for p in a if p in start and p in target]
    if not shared:
        raise ValueError("gap_closed: the three arms share no problem")
    num = [float(a[p]) - float(start[p]) for p in shared]
    den = [float(target[p]) - float(start[p]) for p in shared]
    n = len(shared)
    if sum(den) == 0:
        return None
    estimate = sum(num) / sum(den)
    rng = random.Random(seed)
    shares = []
    for _ in range(resamples):
        rows = [rng.randrange(n) for _ in range(n)]
        d = sum(den[i] for i in rows)
        if d != 0:
            shares.append(sum(num[i] for i in rows) / d)
    shares.sort()
    if not shares:
        return Share(estimate, (estimate, estimate), estimate, n)
    return Share(estimate, (_quantile(shares, 0.025), _quantile(shares, 0.975)), _quantile(shares, ALPHA), n)
