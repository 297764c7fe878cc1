"""What every experiment writes: result.json (one schema for all) and result.png (both arms with intervals).

    result = Result(experiment="rl-heldout", claim=..., metric=..., profile="smoke", seeds=[0],
                    treatment=arm(treated, start), control=arm(control, start, name="shuffled rewards"),
                    effect=arm(treated, control))
    write_result(result, "out/rl-heldout")   # out/rl-heldout/result.json + result.png

`treatment` is the claimed arm's change in the metric from the common starting point, `control` the control
arm's change from the same start, `effect` their difference; all three are paired over the same held-out
problems (`openk3.stats.paired`: the mean difference per problem, bootstrapped over problems), signed so
that a positive effect supports the claim.

The verdict rule: `supported` when the effect's whole 95 % interval is above zero (and every one of the
experiment's `requirements` holds, where it states more than an effect), `not supported` otherwise;
`inconclusive` only when the experiment could not measure, with a `reason`. The control arm gets the same
rule applied to its own change (`control.verdict`): a working control is "not supported".
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

from openk3.stats import paired

VERDICTS = ("supported", "not supported", "inconclusive")


def arm(a: Mapping[Hashable, float], b: Mapping[Hashable, float], *, seed: int = 0,
        name: str | None = None) -> dict[str, Any]:
    """{"estimate", "ci95", "p_greater", "n"} of a - b over their shared problems (and "name" when given)."""
    t = paired(a, b, seed=seed)
    return {**({"name": name} if name is not None else {}), "estimate": t.estimate, "ci95": list(t.ci95),
            "p_greater": t.p_greater, "n": t.n}


def verdict_of(ci95, null: float = 0.0) -> str:
    return "supported" if ci95[0] > null else "not supported"


@dataclasses.dataclass
class Result:
    experiment: str
    claim: str
    metric: str
    profile: str
    seeds: list[int]
    treatment: dict  # the claimed arm's change from the start: {"estimate", "ci95", ...}
    control: dict  # the control's change from the same start: {"name", "estimate", "ci95", ...}
    effect: dict  # treatment - control, paired
    seconds: float = 0.0
    reason: str | None = None  # why the experiment could not measure (verdict "inconclusive")
    baselines: dict = dataclasses.field(default_factory=dict)  # other arms (merges, ...): {name: change}
    details: dict = dataclasses.field(default_factory=dict)  # the experiment's own numbers (start, per cell...)
    settings: dict = dataclasses.field(default_factory=dict)
    # conditions of the claim besides the effect (effort-budget: the cut is >= 30 %, no accuracy loss):
    # {name: {"holds": bool, "detail": str}}; "supported" needs every one
    requirements: dict = dataclasses.field(default_factory=dict)
    # the effect's "no effect" value: 0 for differences, 1 for ratios (the scaling lab's compute multipliers,
    # where treatment and control are each arm's fitted loss and only the effect is judged)
    null: float = 0.0
    extra: dict = dataclasses.field(default_factory=dict)  # experiment-specific top-level keys of result.json
    plot: Any = dataclasses.field(default=None, repr=False)  # plot(result, path) instead of the bar chart

    @property
    def verdict(self) -> str:
        if self.reason:
            return "inconclusive"
        if not all(r["holds"] for r in self.requirements.values()):
            return "not supported"
        return verdict_of(self.effect["ci95"], self.null)

    def to_dict(self) -> dict:
        plot, self.plot = self.plot, None  # (a function is not JSON)
        try:
            d = dataclasses.asdict(self)
        finally:
            self.plot = plot
        del d["plot"]
        extra = d.pop("extra")
        # a difference's control is judged by the same rule (a working control is "not supported"); a ratio
        # experiment's control is the baseline arm's own fit, which has no verdict
        d["control"] = {**self.control, "verdict": verdict_of(self.control["ci95"]) if self.null == 0 else None}
        d["verdict"] = self.verdict
        if self.reason is None:
            del d["reason"]
        if self.null == 0:
            del d["null"]
        d.update(extra)
        order = ["experiment", "claim", "metric", "profile", "seeds", "treatment", "control", "effect", "verdict",
                 "seconds"]
        return {k: d[k] for k in order} | {k: v for k, v in d.items() if k not in order}


def plot_result(result: Result, path: str | os.PathLike) -> None:
    """Bars: the treatment's and the control's change from the start (and any baselines'), then the effect;
    each with its 95 % interval, zero marked."""
    from openk3.chart import new_figure, save_png

    rows = [("treatment", result.treatment), (f"control: {result.control.get('name', 'control')}", result.control),
            *[(name, b) for name, b in result.baselines.items()], ("effect = treatment - control", result.effect)]
    fig = new_figure(max(5.0, 1.1 * len(rows) + 2.5), 4.0, 110)
    ax = fig.subplots()
    xs = list(range(len(rows)))
    est = [r["estimate"] for _, r in rows]
    lo = [max(0.0, r["estimate"] - r["ci95"][0]) for _, r in rows]
    hi = [max(0.0, r["ci95"][1] - r["estimate"]) for _, r in rows]
    colors = ["C0", "C7", *["C1"] * len(result.baselines), "C2" if result.verdict == "supported" else "C3"]
    ax.bar(xs, est, color=colors, yerr=[lo, hi], capsize=4)
    for x, (_, r) in zip(xs, rows, strict=True):  # the numbers, so a zero bar still says something
        ax.annotate(f"{r['estimate']:+.3f}\n[{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]", (x, r["ci95"][1]),
                    textcoords="offset points", xytext=(0, 4), ha="center", fontsize=7)
    ax.axhline(0.0, color="black", linewidth=1)
    ax.set_xticks(xs, [name for name, _ in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("change from the start")
    ax.margins(y=0.25)
    fig.suptitle(result.metric, fontsize=9)
    ax.set_title(f"{result.experiment} ({result.profile}, seeds {result.seeds}): {result.verdict}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    save_png(fig, str(path))


def write_result(result: Result, out: str | os.PathLike) -> dict:
    """out/result.json (atomic) and out/result.png; returns the JSON form."""
    from openk3.fsutil import write_atomic

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    d = result.to_dict()
    (result.plot or plot_result)(result, folder / "result.png")
    write_atomic(folder / "result.json", (json.dumps(d, indent=1) + "\n").encode())
    return d
