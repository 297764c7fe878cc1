"""The evaluation report over several models (issue 18 item 6): report.json, report.md and the plots.

    report = evaluate_models({"sft": "runs/sft", "student": "runs/student", "general/low": "runs/t-gl", ...},
                             "runs/eval", cells="all", n_per_cell=64, samples=4)
    write_report({"sft": M0, "student": M, "teachers": {"general/low": Mt, ...}},
                 {"sft": "runs/sft", ...}, "runs/eval")              # from metrics already measured

A model name that is a cell ("general/low") is that cell's RL teacher and goes under "teachers"; any other
name (sft, student, merged, ...) is a model of its own. Each model is scored by `evaluate.evaluate` on every
chosen cell, and saved to <out>/models/<name>.json, so an interrupted evaluation restarts from the next model
(same settings only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from openk3.chat import THINKING_EFFORTS
from openk3.fsutil import read_json, write_atomic
from openk3.posttrain.domains.budget import B_FLOOR
from openk3.posttrain.domains.records import DOMAINS
from openk3.posttrain.evaluation.evaluate import (
    CELLS,
    MIN_N,
    MODEL_KEYS,
    evaluate,
    model_rows,
    parse_cells,
    per_problem_scores,
    share_of_gain,
)
from openk3.posttrain.trainers.rollout import RESPONSE_CAP
from openk3.stats import ALPHA, ordered, paired


def _cell(m: dict, domain: str, effort: str) -> dict | None:
    return m.get(domain, {}).get(effort)


def report_problems(report: dict, min_n: int = MIN_N) -> list[str]:
    """What keeps `report` from the issue 18 contract: every model (sft, student, merged, the nine
    teachers) with all nine cells, accuracy / thinking_tokens / n in each, n >= min_n, and a checkpoint
    for each. An empty list means it follows the contract."""
    problems: list[str] = []
    models, checkpoints = report.get("models", {}), report.get("checkpoints", {})
    keys = [(k,) for k in MODEL_KEYS] + [("teachers", c) for c in CELLS]
    for key in keys:
        name = "/".join(key)
        m, ckpt = models, checkpoints
        for part in key:
            m = m.get(part) if isinstance(m, dict) else None
            ckpt = ckpt.get(part) if isinstance(ckpt, dict) else None
        if not isinstance(ckpt, str) or not ckpt:
            problems.append(f"checkpoints: no folder for {name}")
        if not isinstance(m, dict):
            problems.append(f"models: no {name}")
            continue
        for cell in CELLS:
            c = _cell(m, *cell.split("/"))
            if c is None:
                problems.append(f"models.{name}: no cell {cell}")
            elif any(k not in c for k in ("accuracy", "thinking_tokens", "n")):
                problems.append(f"models.{name}.{cell}: missing accuracy, thinking_tokens or n")
            elif c["n"] < min_n:
                problems.append(f"models.{name}.{cell}: n = {c['n']} < {min_n}")
    return problems


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if value == value else "nan"
    return str(value)


def _with_ci(c: dict | None, key: str, digits: int) -> str:
    """'0.412 [0.35, 0.47]': the value and its 95 % interval when the cell has one."""
    if c is None:
        return "–"
    ci = (c.get("ci95") or {}).get(key)
    text = _fmt(c.get(key), digits)
    return f"{text} [{_fmt(float(ci[0]), digits)}, {_fmt(float(ci[1]), digits)}]" if ci else text


def _grid(rows: list[tuple[str, dict]], key: str, digits: int) -> list[str]:
    cells = [c for c in CELLS if any(_cell(m, *c.split("/")) for _, m in rows)]
    lines = ["| model | " + " | ".join(cells) + " |", "|---|" + "---:|" * len(cells)]
    for label, m in rows:
        lines.append(f"| {label} | " + " | ".join(_with_ci(_cell(m, *c.split("/")), key, digits) for c in cells)
                     + " |")
    return lines


def _without(text: str, suffix: str) -> str:
    return text[:-len(suffix)] if text.endswith(suffix) else text


def effort_ordering(m: dict) -> dict[str, bool | None]:
    """Per domain: are think tokens ordered low < high < max, each step up a one-sided paired test over the
    problems at 0.05 (`openk3.stats.ordered`; the efforts of a domain draw the same problems)? None: not all
    three efforts evaluated, or no per-problem samples to test."""
    out: dict[str, bool | None] = {}
    for domain in DOMAINS:
        cells = [_cell(m, domain, e) for e in THINKING_EFFORTS]
        if any(c is not None for c in cells):
            arms = None if None in cells else [per_problem_scores(c) for c in cells]
            if arms is None or None in arms:
                out[domain] = None
                continue
            # a problem's id ends in its cell's effort (".../l3/high"); the same problem under each effort pairs
            arms = [{_without(p, f"/{e}"): v for p, v in a.items()} for a, e in zip(arms, THINKING_EFFORTS)]
            try:
                out[domain] = ordered(arms)[0]
            except ValueError:  # no problem common to all three (a prompt effort that draws other problems)
                out[domain] = None
    return out


def beats(a: dict | None, b: dict | None, key: str = "accuracy") -> tuple[bool | None, str]:
    """Whether cell metrics `a` beat `b` on `key`, paired over their shared problems (one-sided, 0.05), and the
    difference with its interval as text; (None, why) when either lacks per-problem samples."""
    pa, pb = (per_problem_scores(x, key) if x else None for x in (a, b))
    if pa is None or pb is None:
        return None, "no per-problem samples"
    t = paired(pa, pb)
    return t.p_greater < ALPHA, f"{t.estimate:+.3f} [{t.ci95[0]:+.3f}, {t.ci95[1]:+.3f}], p {t.p_greater:.3f}"


def success_criteria(models: dict) -> list[tuple[str, bool | None, str]]:
    """Issue 18's success criteria for a full report, as (criterion, met (None: cannot be judged), detail):
    every teacher beats SFT on its own cell (a paired one-sided test, `beats`); think tokens ordered
    low < high < max in every domain (paired tests, `effort_ordering`),
    for the teachers (each on its own cell) and for the student; the student recovers >= 90 % of each
    teacher's accuracy gain over SFT on its cell (cells where the teacher gained nothing cannot be judged).
    The merged model's recovery is reported beside the student's, not judged."""
    sft, teachers = models.get("sft") or {}, models.get("teachers") or {}
    own = {c: _cell(m, *c.split("/")) for c, m in teachers.items()}
    base = {c: _cell(sft, *c.split("/")) for c in own}
    pairs = {c: (own[c]["accuracy"], base[c]["accuracy"]) for c in own if own[c] and base[c]}
    out: list[tuple[str, bool | None, str]] = []
    tests = {c: beats(own[c], base[c]) for c in pairs}
    won = [c for c, (v, _) in tests.items() if v]
    judged = all(v is not None for v, _ in tests.values())
    out.append(("each teacher beats SFT on its own cell (paired, one-sided 0.05)",
                (len(won) == len(pairs)) if pairs and judged else None,
                f"{len(won)} of {len(pairs)}: " + "; ".join(f"{c} {d}" for c, (_, d) in tests.items())))
    teachers_m: dict = {}  # an M of each teacher on its own cell, so `effort_ordering` reads it
    for c, cell in own.items():
        if cell is not None:
            d, e = c.split("/")
            teachers_m.setdefault(d, {})[e] = cell
    for who, m in (("teachers'", teachers_m), ("student's", models.get("student") or {})):
        ordered = {d: v for d, v in effort_ordering(m).items() if v is not None}
        out.append((f"{who} think tokens low < high < max in every domain", all(ordered.values()) if ordered else None,
                    ", ".join(f"{d} {'yes' if v else 'no'}" for d, v in ordered.items())))

    def recovered(m: dict) -> tuple[list[bool], str]:
        """Per cell with a teacher gain: is the share of it closed >= 90 % (its one-sided lower bound at 0.05,
        paired over the problems, `stats.gap_closed`; the point estimate where there are no per-problem
        samples), and the text."""
        judged, shares = [], []
        for c, (t, s) in pairs.items():
            got = _cell(m, *c.split("/"))
            if got is None:
                continue
            share = share_of_gain(got, base[c], own[c])
            if t > s and share is not None:
                judged.append(share.lower >= 0.9)
                lo, hi = share.ci95
                shares.append(f"{c} {100 * share.estimate:.0f} % [{100 * lo:.0f}, {100 * hi:.0f}]")
            elif t > s:
                share_point = (got["accuracy"] - s) / (t - s)
                judged.append(share_point >= 0.9)
                shares.append(f"{c} {100 * share_point:.0f} %")
            else:
                shares.append(f"{c} n/a")
        return judged, ", ".join(shares)

    judged, detail = recovered(models.get("student") or {})
    out.append(("student recovers >= 90 % of each teacher's gain over SFT (one-sided lower bound, 0.05)",
                all(judged) if judged else None, detail))
    out.append(("merged: share of each teacher's gain over SFT (reported)", None,
                recovered(models.get("merged") or {})[1]))
    return out


def report_markdown(models: dict, checkpoints: dict, settings: dict | None = None,
                    plots: Sequence[str] = ()) -> str:
    rows = model_rows(models)
    lines = ["# Post-training evaluation", ""]
    if settings:
        lines += ["Settings: " + ", ".join(f"{k} = {v}" for k, v in settings.items()), ""]
    lines += ["Accuracy is the mean task reward (pass@1 over all samples); think tokens count the think channel "
              "of every assistant turn; compliance is the share within the cell's budget B_e(x). Brackets: 95 % "
              "intervals (Wilson for a 0/1 rate with one sample per problem, else the bootstrap over problems). "
              "\"Ordered\" and \"beats\" are one-sided paired tests over the same problems at 0.05.", ""]
    for title, key, digits in (("Accuracy", "accuracy", 3), ("Mean think tokens", "thinking_tokens", 1),
                               ("p90 think tokens", "thinking_tokens_p90", 0),
                               ("Budget compliance", "budget_compliance", 3),
                               ("Invalid tool calls per trajectory", "invalid_tool_calls", 2)):
        lines += [f"## {title}", "", *_grid(rows, key, digits), ""]
    lines += ["## Effort ordering (think tokens low < high < max, each step a paired one-sided test at 0.05)", "",
              "| model | " + " | ".join(DOMAINS) + " |", "|---|" + "---|" * len(DOMAINS)]
    for label, m in rows:
        order = effort_ordering(m)
        lines.append(f"| {label} | " + " | ".join({True: "yes", False: "no", None: "–"}[order.get(d)]
                                                 for d in DOMAINS) + " |")
    lines.append("")
    if models.get("sft") and models.get("teachers"):
        lines += ["## Success criteria (issue 18)", "", "| criterion | met | detail |", "|---|---|---|"]
        for name, met, detail in success_criteria(models):
            lines.append(f"| {name} | {({True: 'yes', False: 'no', None: 'cannot judge'})[met]} | {detail} |")
        lines.append("")
    for label, m in rows:
        lines += [f"## {label}", ""]
        ckpt = _checkpoint_of(checkpoints, label)
        if ckpt:
            lines += [f"Checkpoint: `{ckpt}`", ""]
        lines += ["| cell | accuracy | think mean | think p90 | compliance | invalid calls | turns | generated | "
                  "format fail | n |", "|---|" + "---:|" * 9]
        for cell in CELLS:
            c = _cell(m, *cell.split("/"))
            if c is not None:
                lines.append(f"| {cell} | {_with_ci(c, 'accuracy', 3)} | {_with_ci(c, 'thinking_tokens', 1)} | "
                             f"{_fmt(c.get('thinking_tokens_p90'), 0)} | {_with_ci(c, 'budget_compliance', 3)} | "
                             f"{_fmt(c.get('invalid_tool_calls'), 2)} | {_fmt(c.get('turns'), 2)} | "
                             f"{_fmt(c.get('generated_tokens'), 1)} | {_fmt(c.get('format_failure_rate'))} | "
                             f"{c['n']} |")
        lines.append("")
    if plots:
        lines += ["## Plots", "", *[f"![{p}]({p})" for p in plots], ""]
    return "\n".join(lines)


def _checkpoint_of(checkpoints: dict, label: str) -> str | None:
    if label.startswith("teacher "):
        return checkpoints.get("teachers", {}).get(label[len("teacher "):])
    return checkpoints.get(label)


def write_report(models: dict, checkpoints: dict, out_dir: str | os.PathLike, *, settings: dict | None = None,
                 teacher_metrics: dict[str, str] | None = None, mopd_metrics: str | None = None,
                 plots: bool = True) -> dict:
    """Write out_dir/report.json ({"models", "checkpoints", "settings"}; atomic), report.md (tables) and
    the plots (`plots.write_plots`: from the models, and the training curves of `teacher_metrics`
    {name: metrics.jsonl} and `mopd_metrics`). Returns the report."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"models": models, "checkpoints": checkpoints, **({"settings": settings} if settings else {})}
    written: list[str] = []
    if plots:
        from openk3.posttrain.evaluation.plots import write_plots

        written = write_plots(models, out, teacher_metrics=teacher_metrics, mopd_metrics=mopd_metrics)
    write_atomic(out / "report.json", (json.dumps(report, indent=1) + "\n").encode())
    write_atomic(out / "report.md", report_markdown(models, checkpoints, settings, written).encode())
    return report


def evaluate_models(models: Mapping[str, str | os.PathLike], out_dir: str | os.PathLike, *,
                    cells: Iterable[tuple[str, str]] | str | None = None, n_per_cell: int = MIN_N,
                    samples: int = 1, split: str = "test", seed: int = 0, temperature: float = 1.0,
                    think_cap: int | None = None, response_cap: int = RESPONSE_CAP, max_turns: int = 8,
                    b_floor: int = B_FLOOR, levels: tuple[int, ...] | None = None,
                    prompt_effort: str | None = None, budget_forcing: bool = False, max_num_seqs: int = 32,
                    max_model_len: int | None = None, device: str | None = None,
                    teacher_metrics: Mapping[str, str] | None = None, mopd_metrics: str | None = None) -> dict:
    """Evaluate every model {name: checkpoint or run folder} on every cell and write the report into `out_dir`
    (module docstring); returns the report. `teacher_metrics` {name: metrics.jsonl} and `mopd_metrics` add
    the training curves. ValueError for a bad name or a missing metrics file, before anything is evaluated.
    Progress as "[eval] ..." lines."""
    from openk3.checkpoint.load import resolve_checkpoint
    from openk3.log import reporter
    from openk3.posttrain.domains.budget import BudgetConfig

    if "teachers" in models:
        raise ValueError("--models: 'teachers' is the report's group of the nine; name a teacher by its cell "
                         "(general/low=DIR)")
    for name in models:
        if "/" in name and name not in CELLS:
            raise ValueError(f"--models: {name!r} is not a cell (cells: {', '.join(CELLS)})")
    say = reporter("eval").info
    teacher_metrics = dict(teacher_metrics or {})
    for what, file in [*teacher_metrics.items(), ("--mopd-metrics", mopd_metrics)]:
        if file is not None and not os.path.isfile(file):  # checked now, not after hours of evaluation
            raise ValueError(f"{what}: no metrics file {file}")
    if cells is not None and not isinstance(cells, str):  # cells "D/E" or (D, E) pairs
        cells = [c if isinstance(c, str) else "/".join(c) for c in cells]
    cells = parse_cells(cells)
    settings = {"cells": [f"{d}/{e}" for d, e in cells], "n_per_cell": n_per_cell, "samples": samples,
                "split": split, "seed": seed, "temperature": temperature, "think_cap": think_cap,
                "response_cap": response_cap, "max_turns": max_turns, "b_floor": b_floor,
                "max_model_len": max_model_len, "prompt_effort": prompt_effort,
                "budget_forcing": budget_forcing, **({"levels": list(levels)} if levels else {})}
    done_dir = os.path.join(out_dir, "models")
    os.makedirs(done_dir, exist_ok=True)
    scored: dict = {}
    checkpoints: dict = {}
    for name, path in models.items():
        folder = str(resolve_checkpoint(path))
        done = os.path.join(done_dir, name.replace("/", "_") + ".json")
        saved = read_json(done) if os.path.isfile(done) else None
        if saved is not None and saved.get("settings") == settings and saved.get("checkpoint") == folder:
            say(f"{name}: reusing {done}")
            m = saved["metrics"]
        else:
            say(f"{name}: {folder} on {len(cells)} cells x {n_per_cell} problems x {samples}")
            m = evaluate(folder, cells, n_per_cell, split, seed, temperature, samples, think_cap=think_cap,
                         response_cap=response_cap, max_turns=max_turns, budget=BudgetConfig(b_floor=b_floor),
                         max_num_seqs=max_num_seqs, max_model_len=max_model_len, prompt_effort=prompt_effort,
                         budget_forcing=budget_forcing, device=device, levels=levels)
            write_atomic(done, (json.dumps({"settings": settings, "checkpoint": folder, "metrics": m}) + "\n").encode())
        for d, e in cells:
            c = m[d][e]
            say(f"{name} {d}/{e}: accuracy {_with_ci(c, 'accuracy', 3)}, think {_with_ci(c, 'thinking_tokens', 1)} "
                f"(p90 {c['thinking_tokens_p90']:.0f}), compliance {_with_ci(c, 'budget_compliance', 2)}, n {c['n']}")
        if name in CELLS:
            scored.setdefault("teachers", {})[name] = m
            checkpoints.setdefault("teachers", {})[name] = folder
        else:
            scored[name], checkpoints[name] = m, folder
    report = write_report(scored, checkpoints, out_dir, settings=settings, teacher_metrics=teacher_metrics,
                          mopd_metrics=mopd_metrics)
    missing = report_problems(report)
    if missing:  # partial evaluations are legitimate (one model, one domain); the pipeline's contract is not met
        say(f"note: not the full issue-18 report ({len(missing)} gaps, e.g. {missing[0]})")
    say(f"done: {os.path.join(out_dir, 'report.json')}, report.md and plots")
    return report
