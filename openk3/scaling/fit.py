"""Loss-vs-compute fits of two arms and the compute multiplier, with bootstrap intervals.

    f = fit_pair(points, treatment="k3", baseline="k2-style", seed=0)
    f["multiplier"]          # {"estimate", "ci95", "form": "shared exponent", "se_log", "mdm"}
    f["free"]["m_of_L"]      # the free-exponent form's multiplier at each loss of the grid (with intervals)

Forms (both pure power laws in compute C, the papers' form; log L = log a - b log C, least squares in log-log):
- **shared exponent**: one b for both arms, a per arm. The multiplier is then one number at every loss,
  m = (a_base / a_treat)^(1/b): the most stable estimator at small scale (the headline).
- **free exponent**: a and b per arm. Then m depends on the loss level: m(L*) = C_base(L*) / C_treat(L*) with
  C_arm(L) = (a / L)^(1/b), reported on a grid of L* inside the range both arms reached (interpolation only)
  and at the largest compute both measured.

m > 1: the baseline needs m times the treatment's compute for the same held-out loss (the treatment is more
compute-efficient).

Bootstrap (2,000 replicates, percentile intervals): each (arm, width, steps) cell is resampled on its own: a
cell with several seeds draws its seeds with replacement; a single-seed cell keeps its one value plus a noise
draw from the noise model: the pooled seed-to-seed spread of the multi-seed cells in log loss, or the free fits'
residual spread where that is larger (a power law in compute does not fit the two budgets of every width
exactly; the misfit is counted as noise, so the interval is never narrower than the fit). Both forms are
refitted per replicate. `mdm` (minimal detectable multiplier): the smallest m whose interval would exclude 1
at this noise, exp(1.96 * se(log m)), se from the middle 68 % of the bootstrap draws.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np


def _cells(points: list[dict], arm: str) -> dict[tuple, list[tuple[float, float]]]:
    """(width, steps) -> [(log C, log L) per seed] of one arm."""
    out: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for p in points:
        if p["arm"] == arm:
            out[(p["width"], p["steps"])].append((math.log(p["compute"]), math.log(p["loss"])))
    return dict(out)


def power_law(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """One arm's free fit: log L = alpha - b log C by least squares over (x = log C, y = log L) -> (alpha, b)."""
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(-slope)


def _shared(xa, ya, xb, yb) -> tuple[float, float, float]:
    """One slope, two intercepts -> (alpha_a, alpha_b, b)."""
    n_a, n_b = len(xa), len(xb)
    X = np.zeros((n_a + n_b, 3))
    X[:n_a, 0] = 1.0
    X[n_a:, 1] = 1.0
    X[:, 2] = -np.concatenate([xa, xb])
    coef, *_ = np.linalg.lstsq(X, np.concatenate([ya, yb]), rcond=None)
    return float(coef[0]), float(coef[1]), float(coef[2])


def log_compute_at(alpha: float, b: float, log_loss: float) -> float:
    return (alpha - log_loss) / b


def _estimates(xt, yt, xb, yb, grid_logL: np.ndarray, log_c_max: float) -> dict:
    at, bt = power_law(xt, yt)
    ab, bb = power_law(xb, yb)
    st, sb, b = _shared(xt, yt, xb, yb)
    shared_log_m = (sb - st) / b if b > 0 else float("nan")
    free_log_m = np.array([log_compute_at(ab, bb, g) - log_compute_at(at, bt, g) for g in grid_logL]) \
        if bt > 0 and bb > 0 else np.full(len(grid_logL), np.nan)
    # at the largest compute both arms measured: the loss the treatment's fit gives there, and the baseline's
    # compute for that loss
    l_treat = at - bt * log_c_max
    free_cmax = log_compute_at(ab, bb, l_treat) - log_c_max if bb > 0 else float("nan")
    return {"treat": (at, bt), "base": (ab, bb), "shared": (st, sb, b), "shared_log_m": shared_log_m,
            "loss_cmax": (math.exp(l_treat), math.exp(ab - bb * log_c_max)),
            "free_log_m": free_log_m, "free_cmax_log_m": free_cmax}


def _arrays(cells: dict) -> tuple[np.ndarray, np.ndarray]:
    xs = [c for v in cells.values() for c, _ in v]
    ys = [loss for v in cells.values() for _, loss in v]
    return np.array(xs), np.array(ys)


def _ci(values: np.ndarray) -> list[float]:
    v = values[np.isfinite(values)]
    if len(v) < 10:
        return [float("nan"), float("nan")]
    return [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))]


def fit_pair(points: list[dict], *, treatment: str, baseline: str, seed: int = 0, replicates: int = 2000,
             grid: int = 5) -> dict:
    """Both forms' fits, the multiplier with its interval, and the numbers behind them (module docstring).
    Needs >= 2 distinct compute values per arm (ValueError otherwise)."""
    ct, cb = _cells(points, treatment), _cells(points, baseline)
    for arm, cells in ((treatment, ct), (baseline, cb)):
        if len({round(x, 9) for v in cells.values() for x, _ in v}) < 2:
            raise ValueError(f"arm {arm!r}: a fit needs points at >= 2 compute values, got {len(cells)} cell(s)")
    xt, yt = _arrays(ct)
    xb, yb = _arrays(cb)
    # L* grid inside both arms' measured loss range (interpolation only); empty when the ranges do not overlap
    lo, hi = max(yt.min(), yb.min()), min(yt.max(), yb.max())
    overlap = bool(hi > lo)
    grid_logL = np.linspace(lo, hi, grid) if overlap else np.array([(lo + hi) / 2])
    log_c_max = float(min(xt.max(), xb.max()))
    point = _estimates(xt, yt, xb, yb, grid_logL, log_c_max)

    # the noise model: the pooled within-cell spread of log loss over multi-seed cells (seed noise) or the free
    # fits' residual spread, whichever is larger: a power law in compute alone does not pass exactly through the
    # points of two budgets at each width, and that misfit counts as noise too, so that the interval is never
    # narrower than the fit's own quality
    spreads = [np.var([y for _, y in v], ddof=1) * (len(v) - 1) for v in (*ct.values(), *cb.values()) if len(v) > 1]
    dof = sum(len(v) - 1 for v in (*ct.values(), *cb.values()) if len(v) > 1)
    sigma_seeds = math.sqrt(sum(spreads) / dof) if dof > 0 else None
    res = np.concatenate([yt - (point["treat"][0] - point["treat"][1] * xt),
                          yb - (point["base"][0] - point["base"][1] * xb)])
    sigma_res = math.sqrt(float(np.sum(res ** 2)) / max(1, len(res) - 4))
    if sigma_seeds is not None and sigma_seeds >= sigma_res:
        sigma, noise_from = sigma_seeds, "seeds"
    else:
        sigma, noise_from = sigma_res, "fit residuals"

    rng = np.random.default_rng(seed)

    def resample(cells: dict) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for v in cells.values():
            if len(v) > 1:
                pick = rng.integers(0, len(v), len(v))
                xs += [v[i][0] for i in pick]
                ys += [v[i][1] for i in pick]
            else:
                xs.append(v[0][0])
                ys.append(v[0][1] + rng.normal(0.0, sigma))
        return np.array(xs), np.array(ys)

    shared, free_grid, free_cmax, b_t, b_b, b_s, l_t, l_b = [], [], [], [], [], [], [], []
    for _ in range(replicates):
        rt, rb = resample(ct), resample(cb)
        if len(set(np.round(rt[0], 9))) < 2 or len(set(np.round(rb[0], 9))) < 2:
            continue
        e = _estimates(*rt, *rb, grid_logL, log_c_max)
        shared.append(e["shared_log_m"])
        free_grid.append(e["free_log_m"])
        free_cmax.append(e["free_cmax_log_m"])
        b_t.append(e["treat"][1])
        b_b.append(e["base"][1])
        b_s.append(e["shared"][2])
        l_t.append(e["loss_cmax"][0])
        l_b.append(e["loss_cmax"][1])
    shared_a, free_a, cmax_a = np.array(shared), np.array(free_grid), np.array(free_cmax)

    def mult(log_m: float, draws: np.ndarray) -> dict:
        lo_, hi_ = _ci(draws)
        # the spread of log m from the middle 68 % of the draws (a normal's 1 sd each side): robust to the few
        # replicates whose free exponent comes out near 0 and sends their log m towards infinity
        fin = draws[np.isfinite(draws)] if len(draws) else draws
        se = float(np.percentile(fin, 84) - np.percentile(fin, 16)) / 2 if len(fin) >= 10 else float("nan")
        return {"estimate": _exp(log_m), "ci95": [_exp(lo_), _exp(hi_)], "se_log": se, "mdm": _exp(1.96 * se)}

    exps = {"treatment": {"estimate": point["treat"][1], "ci95": _ci(np.array(b_t))},
            "baseline": {"estimate": point["base"][1], "ci95": _ci(np.array(b_b))},
            "shared": {"estimate": point["shared"][2], "ci95": _ci(np.array(b_s))}}
    diff = np.array(b_t) - np.array(b_b)
    exponents_differ = bool(len(diff) and (np.percentile(diff, 2.5) > 0 or np.percentile(diff, 97.5) < 0))
    return {
        "form": "pure power law L = a * C^-b per arm (log-log least squares); compute C = training FLOPs",
        "treatment": treatment, "baseline": baseline,
        "multiplier": {**mult(point["shared_log_m"], shared_a), "form": "shared exponent"},
        "shared": {"log_a_treatment": point["shared"][0], "log_a_baseline": point["shared"][1],
                   "b": point["shared"][2]},
        "free": {"log_a_treatment": point["treat"][0], "b_treatment": point["treat"][1],
                 "log_a_baseline": point["base"][0], "b_baseline": point["base"][1],
                 "m_of_L": [{"loss": math.exp(g), **mult(point["free_log_m"][i], free_a[:, i] if len(free_a) else
                                                         np.array([]))}
                            for i, g in enumerate(grid_logL)],
                 "m_at_c_max": {"compute": math.exp(log_c_max), **mult(point["free_cmax_log_m"], cmax_a)}},
        "exponents": exps, "exponents_differ": exponents_differ,
        # each arm's free fit at the largest compute both measured (result.json's treatment and control)
        "loss_at_c_max": {"compute": math.exp(log_c_max),
                          "treatment": {"estimate": point["loss_cmax"][0], "ci95": _ci(np.array(l_t))},
                          "baseline": {"estimate": point["loss_cmax"][1], "ci95": _ci(np.array(l_b))}},
        "loss_overlap": overlap, "loss_range": [math.exp(lo), math.exp(hi)],
        "noise": {"sigma_log_loss": sigma, "from": noise_from, "seeds": sigma_seeds, "fit_residuals": sigma_res,
                  "replicates": int(len(shared_a))},
    }


def _exp(x: float) -> float:
    """exp that gives inf past float range and nan for nan (a multiplier from a near-flat fit)."""
    if not math.isfinite(x):
        return x if math.isnan(x) else (math.inf if x > 0 else 0.0)
    return math.exp(x) if x < 700 else math.inf
