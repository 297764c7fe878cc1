"""The evaluation's plots (background §3.9), PNG through `openk3.chart` (no display, atomic writes).

    write_plots(models, "runs/eval", teacher_metrics={"general/max": "runs/t-gm/metrics.jsonl"},
                mopd_metrics="runs/student/metrics.jsonl")     # -> the names of the files written

`models` is the report's {"sft": M, "student": M, "merged": M, ..., "teachers": {"general/low": M, ...}}:

* cells_acc_vs_tokens.png — one panel per domain: accuracy vs mean think tokens (symlog x), one line per
  model through its low -> high -> max cells (its effort frontier); the teachers as one series, each at its
  own cell.
* effort_separation.png — think-token distributions (violins; a bar where all samples are equal) per
  effort, per domain, one colour per model.
* recovery.png — per cell, the gap closed over SFT, (acc_model - acc_SFT) / (acc_teacher - acc_SFT), for
  every model but SFT (needs SFT and the cell's teacher; a cell where the teacher does not differ from SFT
  has no bar).
* teacher_rl.png, mopd_training.png — the training curves of metrics.jsonl files vs step, one panel per
  metric, one line per run (a metric named "key/domain/effort" is a per-cell line in key's panel).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from openk3.chart import new_figure, save_png
from openk3.chat import THINKING_EFFORTS
from openk3.posttrain.domains.records import DOMAINS

#: The metrics drawn from an RL teacher's metrics.jsonl (`posttrain.trainers.rl`), in panel order.
TEACHER_KEYS = ("reward", "over_budget_rate", "think_mean", "entropy", "zero_variance_frac", "mismatch_kl")
#: The metrics drawn from a MOPD run's metrics.jsonl (background §3.6 step 6), in panel order; per-cell
#: variants "key/domain/effort" go into key's panel.
MOPD_KEYS = ("reverse_kl", "task_reward", "clipped_frac", "entropy", "think_mean", "mismatch_kl")  # distill's names
_DPI = 110


def _series(models: dict) -> list[tuple[str, dict]]:
    """(label, M) per line: the single models, then "teachers" = each teacher's own cell only."""
    from openk3.posttrain.evaluation.evaluate import model_rows

    rows = [(label, m) for label, m in model_rows(models) if not label.startswith("teacher ")]
    teachers = models.get("teachers", {})
    own: dict = {}
    for cell, m in teachers.items():
        domain, _, effort = cell.partition("/")
        c = m.get(domain, {}).get(effort)
        if c is not None:
            own.setdefault(domain, {})[effort] = c
    if own:
        rows.append(("teachers (own cell)", own))
    return rows


def acc_vs_tokens(models: dict, path: str | os.PathLike) -> None:
    fig = new_figure(4.2 * len(DOMAINS), 4.0, _DPI)
    axes = fig.subplots(1, len(DOMAINS), sharey=True)
    markers = {"low": "v", "high": "o", "max": "^"}
    for ax, domain in zip(axes, DOMAINS, strict=True):
        for k, (label, m) in enumerate(_series(models)):
            pts = [(e, m.get(domain, {}).get(e)) for e in THINKING_EFFORTS]
            pts = [(e, c) for e, c in pts if c is not None]
            if not pts:
                continue
            color = f"C{k % 10}"
            ax.plot([c["thinking_tokens"] for _, c in pts], [c["accuracy"] for _, c in pts], "-", color=color,
                    label=label)
            for e, c in pts:
                ax.plot(c["thinking_tokens"], c["accuracy"], markers[e], color=color)
                ci = c.get("ci95") or {}
                if "accuracy" in ci and "thinking_tokens" in ci:  # 95 % intervals on both axes
                    (alo, ahi), (tlo, thi) = ci["accuracy"], ci["thinking_tokens"]
                    ax.errorbar(c["thinking_tokens"], c["accuracy"], fmt="none", ecolor=color, alpha=0.6,
                                elinewidth=1, capsize=2,
                                yerr=[[max(0.0, c["accuracy"] - alo)], [max(0.0, ahi - c["accuracy"])]],
                                xerr=[[max(0.0, c["thinking_tokens"] - tlo)], [max(0.0, thi - c["thinking_tokens"])]])
        ax.set_xscale("symlog", linthresh=1.0)  # a model that never thinks sits at 0, which log cannot show
        ax.set_title(f"{domain}: accuracy vs thinking")
        ax.set_xlabel("mean think tokens (symlog)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("accuracy (mean task reward)")
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        h, lab = ax.get_legend_handles_labels()
        handles += [x for x, y in zip(h, lab, strict=True) if y not in labels]
        labels += [y for y in lab if y not in labels]
    # the effort markers explained once, as proxy lines
    for e, mk in markers.items():
        handles.append(axes[0].plot([], [], mk, color="gray")[0])
        labels.append(e)
    axes[-1].legend(handles, labels, fontsize=7, loc="best")
    fig.suptitle("Accuracy vs mean think tokens per cell (low v, high o, max ^; bars: 95 % intervals)")
    save_png(fig, str(path))


def effort_separation(models: dict, path: str | os.PathLike) -> None:
    series = [(label, m) for label, m in _series(models)]
    fig = new_figure(4.2 * len(DOMAINS), 4.0, _DPI)
    axes = fig.subplots(1, len(DOMAINS))
    width = 0.8 / max(len(series), 1)
    for ax, domain in zip(axes, DOMAINS, strict=True):
        for k, (label, m) in enumerate(series):
            color = f"C{k % 10}"
            for i, effort in enumerate(THINKING_EFFORTS):
                c = m.get(domain, {}).get(effort)
                data = (c or {}).get("think_tokens_samples") or []
                if not data:
                    continue
                x = i + (k - (len(series) - 1) / 2) * width
                if min(data) == max(data):  # a density estimate of one value is singular: draw it as a bar
                    ax.hlines(data[0], x - width / 2, x + width / 2, color=color, linewidth=2)
                else:
                    parts = ax.violinplot([data], positions=[x], widths=width, showmedians=True)
                    for body in parts["bodies"]:
                        body.set_facecolor(color)
                        body.set_alpha(0.5)
                    for key in ("cmedians", "cbars", "cmins", "cmaxes"):  # else they cycle colours of their own
                        parts[key].set_color(color)
                ci = (c.get("ci95") or {}).get("thinking_tokens")
                if ci:  # the mean and its 95 % interval beside the distribution
                    mu = c["thinking_tokens"]
                    ax.errorbar([x], [mu], yerr=[[max(0.0, mu - ci[0])], [max(0.0, ci[1] - mu)]], fmt="D",
                                color="black", markersize=3, capsize=3, elinewidth=1)
            ax.plot([], [], "s", color=color, label=label)  # one legend entry per model
        ax.set_xticks(range(len(THINKING_EFFORTS)), THINKING_EFFORTS)
        ax.set_title(f"{domain}: think tokens per effort")
        ax.set_xlabel("thinking effort")
        ax.set_ylabel("think tokens per trajectory")
        ax.grid(True, axis="y", alpha=0.3)
    axes[-1].legend(fontsize=7, loc="best")
    fig.suptitle("Effort separation: think-token distributions (black: mean, 95 % interval)")
    save_png(fig, str(path))


def gap_closed(models: dict) -> dict[str, dict[str, float]]:
    """{model: {cell: (acc_model - acc_SFT) / (acc_teacher - acc_SFT)}} for every single model but SFT, on the
    cells where SFT, the cell's teacher and the model were evaluated (NaN where teacher == SFT)."""
    sft, teachers = models.get("sft"), models.get("teachers", {})
    if sft is None:
        return {}
    out: dict[str, dict[str, float]] = {}
    for label, m in _series(models):
        if label in ("sft", "teachers (own cell)"):
            continue
        for cell, tm in teachers.items():
            domain, _, effort = cell.partition("/")
            cells = [x.get(domain, {}).get(effort) for x in (m, sft, tm)]
            if None in cells:
                continue
            acc, acc_sft, acc_teacher = (c["accuracy"] for c in cells)
            gain = acc_teacher - acc_sft
            out.setdefault(label, {})[cell] = (acc - acc_sft) / gain if gain != 0 else math.nan
    return out


def gap_closed_ci(models: dict) -> dict[str, dict[str, tuple[float, float]]]:
    """The 95 % intervals of `gap_closed`'s shares, paired over the problems (`openk3.stats.gap_closed`), where
    the cells keep per-problem samples and the teacher's gain is not 0."""
    from openk3.posttrain.evaluation.evaluate import share_of_gain

    sft, teachers = models.get("sft"), models.get("teachers", {})
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for label, m in _series(models) if sft is not None else []:
        if label in ("sft", "teachers (own cell)"):
            continue
        for cell, tm in teachers.items():
            domain, _, effort = cell.partition("/")
            share = share_of_gain(*(x.get(domain, {}).get(effort) or {} for x in (m, sft, tm)))
            if share is not None:
                out.setdefault(label, {})[cell] = share.ci95
    return out


def recovery(models: dict, path: str | os.PathLike) -> bool:
    """The gap-closed bars ("n/a" where undefined); False (nothing written) when no model shares a cell with
    SFT and that cell's teacher."""
    from openk3.posttrain.evaluation.evaluate import CELLS

    gaps = gap_closed(models)
    cells = [c for c in CELLS if any(c in g for g in gaps.values())]
    if not cells:
        return False
    intervals = gap_closed_ci(models)
    fig = new_figure(max(6.0, 0.9 * len(cells) + 2), 4.0, _DPI)
    ax = fig.subplots()
    width = 0.8 / len(gaps)
    for k, (label, g) in enumerate(gaps.items()):
        xs = [i + (k - (len(gaps) - 1) / 2) * width for i in range(len(cells))]
        values = [g.get(c, math.nan) for c in cells]
        cis = intervals.get(label, {})
        err = [[max(0.0, v - cis[c][0]) if c in cis else 0.0 for c, v in zip(cells, values, strict=True)],
               [max(0.0, cis[c][1] - v) if c in cis else 0.0 for c, v in zip(cells, values, strict=True)]]
        ax.bar(xs, values, width, label=label, color=f"C{(k + 1) % 10}", yerr=err, capsize=2)
        for x, v in zip(xs, values, strict=True):
            if math.isnan(v):  # the teacher did not move from SFT here (or the model was not evaluated)
                ax.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="teacher")
    ax.axhline(0.0, color="gray", linewidth=1)
    ax.set_xticks(range(len(cells)), cells, rotation=30, ha="right")
    ax.set_xlabel("cell (domain/effort)")
    ax.set_ylabel("gap closed (acc - SFT) / (teacher - SFT)")
    ax.set_title("Recovery of each teacher's gain over SFT (bars: 95 % intervals, paired over problems)")
    ax.legend(fontsize=7, loc="best")
    save_png(fig, str(path))
    return True


def training_curves(runs: dict[str, Sequence[dict]], keys: Sequence[str], path: str | os.PathLike,
                    title: str) -> bool:
    """One panel per metric of `keys` found in the runs' rows ({name: metrics rows}), vs "step"; a metric
    "key/..." (per cell) is drawn in key's panel. False (nothing written) when no key has data."""
    panels: dict[str, list[tuple[str, list, list]]] = {}
    for name, rows in runs.items():
        for key in keys:
            found = sorted({k for r in rows for k in r if k == key or k.startswith(key + "/")})
            for k in found:
                pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float)) and "step" in r]
                if pts:
                    label = name if k == key else (f"{name} {k[len(key) + 1:]}" if len(runs) > 1
                                                   else k[len(key) + 1:])
                    panels.setdefault(key, []).append((label, [p[0] for p in pts], [p[1] for p in pts]))
    if not panels:
        return False
    cols = min(3, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    fig = new_figure(4.2 * cols, 3.2 * rows_n, _DPI)
    axes = fig.subplots(rows_n, cols, squeeze=False).ravel()
    for ax, (key, lines) in zip(axes, panels.items()):
        for label, xs, ys in lines:
            ax.plot(xs, ys, label=label)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="best")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    save_png(fig, str(path))
    return True


def _flat(row: dict) -> dict:
    """A metrics row with per-cell values nested as `distill` writes them ({"cells": {"general/low": {k: v}}})
    spread out as "k/general/low" keys, which `training_curves` draws in k's panel."""
    cells = row.get("cells")
    if not isinstance(cells, dict):
        return row
    flat = {k: v for k, v in row.items() if k != "cells"}
    for cell, values in cells.items():
        if isinstance(values, dict):
            flat.update({f"{k}/{cell}": v for k, v in values.items()})
    return flat


def write_plots(models: dict, out_dir: str | os.PathLike, *, teacher_metrics: dict[str, str] | None = None,
                mopd_metrics: str | None = None) -> list[str]:
    """Every plot the inputs allow, into out_dir; returns the file names written."""
    from openk3.train.metrics import read_metrics

    out = Path(out_dir)
    written = []
    acc_vs_tokens(models, out / "cells_acc_vs_tokens.png")
    written.append("cells_acc_vs_tokens.png")
    effort_separation(models, out / "effort_separation.png")
    written.append("effort_separation.png")
    if recovery(models, out / "recovery.png"):
        written.append("recovery.png")
    for name, runs, keys, title in (
            ("teacher_rl.png", teacher_metrics or {}, TEACHER_KEYS, "RL teachers: training curves"),
            ("mopd_training.png", {"student": mopd_metrics} if mopd_metrics else {}, MOPD_KEYS,
             "MOPD student: training curves")):
        for run, file in runs.items():
            if not os.path.isfile(file):
                raise ValueError(f"eval: no metrics file {file} for {run!r}")
        if runs and training_curves({k: [_flat(r) for r in read_metrics(v)] for k, v in runs.items()}, keys,
                                    out / name, title):
            written.append(name)
    return written
