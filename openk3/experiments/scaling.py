"""The scaling lab's experiments: K3's architectural claims as compute multipliers (issue 31).

    openk3 experiment k3-vs-k2 --profile smoke --out runs/exp/k3-vs-k2      # points kept in runs/exp/points
    openk3 experiment attnres --profile full --seed 0 --out runs/exp/attnres

Each experiment trains two model families (`openk3.scaling.families`) along the same ladder of widths and
token budgets (`openk3.scaling.ladder`: same data, tokenizer, sequence length, batch, schedule shape and
held-out batches for every point), fits held-out bits/byte against training compute for each arm and
reports the **compute multiplier** m = C_baseline(L*) / C_treatment(L*) (`openk3.scaling.fit`): the
shared-exponent fit's m is the effect, with a bootstrap interval over seeds and points; the free-exponent
fits' m(L*) over the loss range both arms reached and at the largest common compute are in `fit`.

The verdict: `supported` when the effect's interval lies above 1; `matches_published` when it contains the
published figure (null where the source gives none); `inconclusive` (with a reason) when a fit cannot
measure (loss not falling with compute in an arm). `resolution` says whether the run could have detected
the published multiplier at all: the minimal detectable multiplier for its noise, exp(1.96 se(log m)).

Learning rates are chosen per arm, never one for all: in profiles with a sweep, a grid at the smallest
width's shortest budget (extended while the best sits at an edge), then a guard (x0.5, x1, x2) at the second
width whose winner carries to the larger widths (Muon's RMS-matched update is meant to make the LR
width-portable; the guard checks it); the sweep points are in `lr_sweep`. The smoke profile uses one fixed
LR (plumbing, no claim). Points live in the store (`store` setting; default the folder beside --out named
`points`), so a ladder interrupted anywhere continues point by point, and experiments sharing an arm (all
five share `k3`) share its points and sweep; two processes may share a store (points are locked).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from openk3.experiments.result import Result

METRIC = ("compute multiplier m = C_baseline(L*) / C_treatment(L*): the baseline's training FLOPs over the "
          "treatment's for the same held-out bits/byte (shared-exponent power-law fit)")


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    treatment: str
    baseline: str
    published: float | None
    claim: str


SPECS = {s.name: s for s in (
    Spec("k3-vs-k2", "k3", "k2-style", 2.5,
         "K3's architecture and recipe (3:1 KDA hybrid, Block AttnRes, Stable LatentMoE, SiTU-GLU, Quantile "
         "Balancing, Per-Head Muon) reach a K2-style model's held-out loss with less training compute (published "
         "2.5x includes data recipes; on a fixed corpus only the architecture-and-recipe share is measured)"),
    Spec("attnres", "k3", "k3-no-attnres", 1.25,
         "Block Attention Residuals reach the standard residual stream's held-out loss with less training compute"),
    Spec("latent-moe", "k3", "k3-no-latent-moe", None,
         "Stable LatentMoE (experts in a d/2 latent, twice the experts and top-k) beats a plain MoE at width d "
         "per training FLOP"),
    Spec("kda-hybrid", "k3", "k3-all-mla", 1.16,
         "the 3:1 KDA:MLA hybrid reaches all-MLA's held-out loss with less training compute"),
    Spec("muon-vs-adamw", "k3", "k3-adamw", 2.0,
         "Per-Head Muon reaches AdamW's held-out loss with less training compute"),
)}

# smoke: plumbing in about a minute an arm on one core (two widths, two WSD budgets each; no claim can be
# resolved at this size). full: the CPU ladder (docs/scaling.md has its timing). gpu: one-GPU-hour sizes.
SMOKE = dict(layers=5, widths=(32, 64), steps=((30, 60), (30, 60)), seeds=1, lr=3e-3, lr_grid=(), lr_guard=False,
             batch_size=8, seq_len=256, eval_batches=8, max_bytes=3_000_000, val_fraction=0.02, warmup_steps=5,
             device="cpu",
             store=None, replicates=1000)
FULL = dict(layers=9, widths=(32, 64, 96, 128), steps=((150, 300), (150, 300), (200, 400), (200, 400)), seeds=3,
            lr=3e-3, lr_grid=(0.5, 1.0, 2.0), lr_guard=True, batch_size=8, seq_len=256, eval_batches=32,
            max_bytes=20_000_000, val_fraction=0.01, warmup_steps=10, device="cpu", store=None, replicates=2000)
# gpu: ~6e16 training FLOPs an arm at one seed (~8e16 with its sweep and seeds): at 100 TFLOP/s effective (~10 % of
# an H200's bf16 peak; tiny experts run far below it) ~15 minutes an arm, the six arms of the five experiments
# ~1.5 GPU-hours; 52M tokens at the top (~2 passes over the built-in corpus)
GPU = dict(layers=13, widths=(256, 384, 512, 768), steps=((500, 1000), (600, 1200), (700, 1400), (800, 1600)),
           seeds=3, lr=2e-3, lr_grid=(0.25, 0.5, 1.0, 2.0, 4.0), lr_guard=True, batch_size=32, seq_len=1024,
           eval_batches=64, max_bytes=None, val_fraction=0.01, warmup_steps=50, device="cuda", dtype="bf16",
           store=None, replicates=2000)
PROFILES = {"smoke": SMOKE, "full": FULL, "gpu": GPU}
MAX_EXTENSIONS = 4  # LR grid extensions past an edge optimum (x2 each: up to 16x beyond the grid)


def settings_of(s: dict):
    from openk3.scaling.ladder import LadderSettings

    return LadderSettings(layers=s["layers"], batch_size=s["batch_size"], seq_len=s["seq_len"],
                          eval_batches=s["eval_batches"], max_bytes=s["max_bytes"], val_fraction=s["val_fraction"],
                          warmup_steps=s["warmup_steps"], device=s["device"], dtype=s.get("dtype", "fp32"))


def choose_lrs(store, arm: str, s: dict, seed: int, say) -> tuple[dict[int, float], dict]:
    """{width: lr} for `arm` and the record of how (module docstring)."""
    widths, lr0 = s["widths"], s["lr"]
    if not s["lr_grid"]:
        return {w: lr0 for w in widths}, {"rule": f"fixed {lr0:g} (this profile has no sweep)", "points": []}
    record: list[dict] = []

    def sweep(width: int, steps: int, lrs: list[float]) -> float:
        losses = {}
        lrs = sorted(lrs)
        for _ in range(MAX_EXTENSIONS + 1):
            for lr in lrs:
                if lr not in losses:
                    p = store.point(arm, width, steps, lr, seed)
                    losses[lr] = p["loss"]
                    record.append({"width": width, "steps": steps, "lr": lr, "loss": p["loss"], "seed": seed})
            best = min(losses, key=losses.get)
            ordered = sorted(losses)
            if best == ordered[0]:
                lrs = [best / 2]
            elif best == ordered[-1]:
                lrs = [best * 2]
            else:
                return best
        say(f"{arm}: the LR sweep at width {width} still has its best ({best:g}) at an edge after "
            f"{MAX_EXTENSIONS} extensions; using it")
        return best

    best0 = sweep(widths[0], s["steps"][0][0], [lr0 * m for m in s["lr_grid"]])
    lrs = {widths[0]: best0}
    rule = f"grid x{list(s['lr_grid'])} around {lr0:g} at width {widths[0]}: {best0:g}"
    best1 = best0
    if s["lr_guard"] and len(widths) > 1:
        best1 = sweep(widths[1], s["steps"][1][0], [best0 / 2, best0, best0 * 2])
        rule += f"; guard x0.5/x1/x2 at width {widths[1]}: {best1:g}, used for widths {list(widths[1:])}"
    for w in widths[1:]:
        lrs[w] = best1
    say(f"{arm}: learning rates {lrs} ({rule})")
    return lrs, {"rule": rule, "points": record, "chosen": {str(w): lr for w, lr in lrs.items()}}


def ladder(store, arm: str, s: dict, seed: int, say) -> tuple[list[dict], dict]:
    """Every point of `arm` at its chosen LRs: each width's budgets (WSD branches), extra seeds at the smallest."""
    lrs, sweep = choose_lrs(store, arm, s, seed, say)
    points = []
    for i, width in enumerate(s["widths"]):
        for sd in ([seed + k for k in range(s["seeds"])] if i == 0 else [seed]):
            shorter = None
            for steps in s["steps"][i]:
                points.append(store.point(arm, width, steps, lrs[width], sd, branch_from=shorter))
                shorter = steps
    return points, sweep


def run_spec(spec: Spec, profile: str, s: dict, seed: int, say, out: Path) -> Result:
    import time

    from openk3.scaling.fit import fit_pair
    from openk3.scaling.ladder import PointStore

    t0 = time.perf_counter()
    if len(s["widths"]) != len(s["steps"]):
        raise ValueError(f"{spec.name}: settings 'widths' and 'steps' must have the same length")
    store = PointStore(s["store"] or Path(out).resolve().parent / "points", settings_of(s), say)
    points, sweeps = [], {}
    for arm in (spec.treatment, spec.baseline):
        p, sweeps[arm] = ladder(store, arm, s, seed, say)
        points += p
    keys = ("arm", "width", "steps", "params", "active_params", "flops_per_token", "tokens", "compute", "loss",
            "seed", "lr")
    table = [{k: p[k] for k in keys} for p in points]
    fit = fit_pair(points, treatment=spec.treatment, baseline=spec.baseline, seed=seed, replicates=s["replicates"])
    m = fit["multiplier"]
    lt, lb = fit["loss_at_c_max"]["treatment"], fit["loss_at_c_max"]["baseline"]
    flops_ratio = {}
    for w in s["widths"]:
        ft = next(p["flops_per_token"] for p in points if p["arm"] == spec.treatment and p["width"] == w)
        fb = next(p["flops_per_token"] for p in points if p["arm"] == spec.baseline and p["width"] == w)
        flops_ratio[str(w)] = fb / ft
    reason = None
    falling = {arm: fit["free"][f"b_{k}"] for arm, k in ((spec.treatment, "treatment"), (spec.baseline, "baseline"))}
    if not all(b > 0 for b in falling.values()):
        reason = f"held-out loss does not fall with compute in every arm (fitted exponents {falling})"
    elif not all(math.isfinite(v) for v in (m["estimate"], *m["ci95"])):
        reason = "the multiplier or its interval is not finite (too few bootstrap replicates could be fitted)"
    matches = None if spec.published is None or reason else bool(m["ci95"][0] <= spec.published <= m["ci95"][1])
    resolution = _resolution(spec, m)
    say(f"{spec.name}: m = {m['estimate']:.3f} [{m['ci95'][0]:.3f}, {m['ci95'][1]:.3f}] "
        f"({spec.treatment} over {spec.baseline}); {resolution}")
    return Result(
        experiment=spec.name, claim=spec.claim, metric=METRIC, profile=profile,
        seeds=sorted({p["seed"] for p in points}),
        treatment={"name": spec.treatment, **lt, "what": "fitted held-out bits/byte at the largest common compute"},
        control={"name": spec.baseline, **lb, "what": "fitted held-out bits/byte at the largest common compute"},
        effect={"estimate": m["estimate"], "ci95": m["ci95"], "form": m["form"], "mdm": m["mdm"]},
        seconds=round(time.perf_counter() - t0, 1), reason=reason, null=1.0,
        settings={k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()},
        details={"flops_ratio_baseline_over_treatment": flops_ratio, "store": str(store.root)},
        extra={"published": spec.published, "matches_published": matches, "resolution": resolution,
               "points": table, "fit": fit, "lr_sweep": sweeps},
        plot=lambda result, path: plot_scaling(result, fit, points, spec, path))


def _resolution(spec: Spec, m: dict) -> str:
    mdm = m["mdm"]
    if not math.isfinite(mdm):
        return "cannot say what this run resolves (no interval)"
    if spec.published is None:
        return f"the minimal detectable multiplier at this noise is {mdm:.2f}x (no published figure to compare)"
    if spec.published > mdm:
        return (f"resolves the claim: the published {spec.published}x is above the minimal detectable "
                f"multiplier {mdm:.2f}x at this noise")
    return (f"cannot resolve the claim: the published {spec.published}x is below the minimal detectable "
            f"multiplier {mdm:.2f}x at this noise (more seeds, sizes or tokens needed)")


def _loss_axes(ax, title: str) -> None:
    """Log-log held-out bits/byte against training compute: the axes of both loss-vs-compute figures."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute (FLOPs)")
    ax.set_ylabel("held-out bits per byte")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)


def plot_scaling(result: Result, fit: dict, points: list[dict], spec: Spec, path) -> None:
    """Left: held-out bits/byte against training FLOPs (log-log), both arms, points by seed, the free fits
    (solid) and the shared-exponent fits (dashed). Right: the multiplier with 95 % intervals: the shared form
    and the free form at each L*, the published figure dashed."""
    import numpy as np

    from openk3.chart import new_figure, save_png

    fig = new_figure(11.0, 4.2, 110)
    ax, bx = fig.subplots(1, 2)
    cs = np.geomspace(min(p["compute"] for p in points), max(p["compute"] for p in points), 50)
    for arm, key, color in ((spec.treatment, "treatment", "C0"), (spec.baseline, "baseline", "C3")):
        mine = [p for p in points if p["arm"] == arm]
        for sd in sorted({p["seed"] for p in mine}):
            xs = [p["compute"] for p in mine if p["seed"] == sd]
            ys = [p["loss"] for p in mine if p["seed"] == sd]
            ax.scatter(xs, ys, color=color, marker="os^vD"[sd % 5], s=22,
                       label=f"{arm} seed {sd}" if len(mine) else None)
        fr = fit["free"]
        ax.plot(cs, np.exp(fr[f"log_a_{key}"] - fr[f"b_{key}"] * np.log(cs)), color=color, linewidth=1.2,
                label=f"{arm}: L = a C^-{fr[f'b_{key}']:.3f}")
        sh = fit["shared"]
        ax.plot(cs, np.exp(sh[f"log_a_{key}"] - sh["b"] * np.log(cs)), color=color, linewidth=1, linestyle="--")
    _loss_axes(ax, f"{spec.name} ({result.profile}): loss vs compute")
    rows = [("shared b", fit["multiplier"])] + [(f"L*={r['loss']:.2f}", r) for r in fit["free"]["m_of_L"]] + \
        [("C max", fit["free"]["m_at_c_max"])]
    # (a free fit with an exponent near 0 gives an infinite or zero m: such rows are left out of the plot)
    rows = [(n, r) for n, r in rows if math.isfinite(r["estimate"]) and r["estimate"] > 0]
    xs = list(range(len(rows)))
    est = [r["estimate"] for _, r in rows]
    lo = [max(0.0, r["estimate"] - r["ci95"][0]) if math.isfinite(r["ci95"][0]) else 0.0 for _, r in rows]
    hi = [max(0.0, r["ci95"][1] - r["estimate"]) if math.isfinite(r["ci95"][1]) else 0.0 for _, r in rows]
    top = max([r["estimate"] for _, r in rows] + [spec.published or 1.0]) * 4  # an infinite upper end: drawn to here
    hi = [min(h, top) for h in hi]
    bx.errorbar(xs, est, yerr=[lo, hi], fmt="o", capsize=4, color="C2")
    bx.axhline(1.0, color="black", linewidth=1)
    if spec.published is not None:
        bx.axhline(spec.published, color="C1", linestyle="--", linewidth=1, label=f"published {spec.published}x")
        bx.legend(fontsize=7)
    bx.set_xticks(xs, [n for n, _ in rows], rotation=20, ha="right", fontsize=7)
    bx.set_yscale("log")
    bx.set_ylabel(f"compute multiplier ({spec.treatment} over {spec.baseline})")
    bx.set_title(f"m = {result.effect['estimate']:.2f}x [{result.effect['ci95'][0]:.2f}, "
                 f"{result.effect['ci95'][1]:.2f}]: {result.verdict}", fontsize=10)
    bx.grid(True, which="both", alpha=0.3)
    save_png(fig, str(path))


class ScalingExperiment:
    """One entry of `openk3.experiments.EXPERIMENTS` (the module interface: NAME, CLAIM, METRIC, PROFILES, run)."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.NAME, self.CLAIM, self.METRIC, self.PROFILES = spec.name, spec.claim, METRIC, PROFILES

    def run(self, profile: str, s: dict, seed: int, say, out: Path) -> Result:
        return run_spec(self.spec, profile, s, seed, say, out)


k3_vs_k2, attnres, latent_moe, kda_hybrid, muon_vs_adamw = (
    ScalingExperiment(SPECS[n]) for n in ("k3-vs-k2", "attnres", "latent-moe", "kda-hybrid", "muon-vs-adamw"))


def summary_plots(results: list[dict], out_dir) -> list[str]:
    """docs/scaling.md's figures from several experiments' result.json dicts: `scaling_ladder.png` (every arm's
    held-out bits/byte against compute, log-log, with its free fit) and `scaling_lr.png` (each arm's learning-
    rate sweep: loss against LR at the sweep's widths). Returns the paths written.

        python -c "import json, sys; from openk3.experiments.scaling import summary_plots; \\
            summary_plots([json.load(open(p)) for p in sys.argv[2:]], sys.argv[1])" docs runs/scaling/*/result.json
    """
    import numpy as np

    from openk3.chart import new_figure, save_png
    from openk3.scaling.fit import power_law

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arms: dict[str, list[dict]] = {}
    sweeps: dict[str, list[dict]] = {}
    for d in results:
        for p in d["points"]:
            arms.setdefault(p["arm"], [])
            if p not in arms[p["arm"]]:
                arms[p["arm"]].append(p)
        for arm, sw in d.get("lr_sweep", {}).items():
            sweeps.setdefault(arm, sw.get("points", []))
    fig = new_figure(7.5, 5.0, 110)
    ax = fig.subplots()
    for i, (arm, pts) in enumerate(sorted(arms.items())):
        xs = np.array([p["compute"] for p in pts])
        ys = np.array([p["loss"] for p in pts])
        ax.scatter(xs, ys, s=14, color=f"C{i}")
        alpha, b = power_law(np.log(xs), np.log(ys))
        cs = np.geomspace(xs.min(), xs.max(), 30)
        ax.plot(cs, np.exp(alpha - b * np.log(cs)), color=f"C{i}", linewidth=1.2, label=f"{arm}: b = {b:.3f}")
    _loss_axes(ax, "the ladder: every arm, every point (free power-law fits)")
    paths = [str(out / "scaling_ladder.png")]
    save_png(fig, paths[0])
    if any(sweeps.values()):
        fig = new_figure(7.5, 4.5, 110)
        ax = fig.subplots()
        for i, (arm, pts) in enumerate(sorted(sweeps.items())):
            for j, w in enumerate(sorted({p["width"] for p in pts})):
                mine = sorted((p["lr"], p["loss"]) for p in pts if p["width"] == w)
                ax.plot([a for a, _ in mine], [b for _, b in mine], marker="os"[j % 2], color=f"C{i}",
                        linestyle="-" if j == 0 else "--", label=f"{arm} width {w}")
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("held-out bits per byte (the sweep's budget)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        ax.set_title("learning-rate sweeps (grid at the smallest width, guard at the second)", fontsize=10)
        paths.append(str(out / "scaling_lr.png"))
        save_png(fig, paths[1])
    return paths
