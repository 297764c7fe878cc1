"""`openk3 experiment mopd-vs-merge`: teachers that each ignore the effort tag, combined by MOPD into one
student that follows the tag, where weight merging cannot; the control is MOPD with shuffled routing.

K3's post-training claim in miniature: each specialist knows one behaviour and nothing of the tag that should
select it (like K3's per-effort teachers, each trained on one effort's traces only). MOPD routes each sample
to the teacher of its own cell, so the student can learn "tag -> that teacher's behaviour"; a merge of the
teachers' weights has no such information (neither teacher's weights depend on the tag), and MOPD whose
routing ignores the tag (the control) has none either.

Smoke profile (one CPU core, ~1-2 minutes):
1. prompts are an effort tag ("lo:" / "hi:") and random letters (`tasks.tagged_items`); the base, the common
   start, is a tiny K3 (`tasks.tiny_k3`) fine-tuned to answer "L" or "H" at random whatever the tag (an SFT
   model with both behaviours, neither tied to the tag);
2. two teachers fine-tuned from the base to answer one first token on every prompt, whatever the tag ("L"
   for general/low's, "H" for general/high's), until >= 95 % of each cell's validation prompts do;
3. arms, all from the base: MOPD (`mopd_step`, 40 steps of 16 prompts x 2 samples, each cell's teacher
   scoring its samples); the control, the same with the routing permuted within each batch (`route_fn`);
   and merges of the two teachers onto the base — linear, task arithmetic (lambda 0.5 and 1), TIES and
   DARE-TIES over densities and lambdas — each merge family's setting chosen on the validation split;
4. metric: agreement of the arm's greedy first token with the routed teacher's on 400 held-out prompts (per
   prompt 1/0; per cell in `details`); every arm's change is paired with the base, the effect is MOPD -
   control, and "vs_best_merge" MOPD - the best tuned merge.
"""

from __future__ import annotations

import copy
import random
import time

import torch

from openk3.experiments import tasks
from openk3.experiments.arms import run_arm
from openk3.experiments.result import Result, arm
from openk3.experiments.tasks import mean

NAME = "mopd-vs-merge"
CLAIM = ("MOPD combines teachers that each ignore the effort tag into one student that follows it (each cell "
         "agrees with its routed teacher), against MOPD with shuffled routing; tuned weight merges are reported")
METRIC = "agreement with the routed teacher on held-out prompts"
PROFILES = ("smoke",)

SMOKE = dict(train=2000, val=200, test=400, teacher_lr=1e-3, teacher_max_steps=200, teacher_at=0.95,
             mopd_lr=1e-3, steps=40, prompts_per_step=16, group_size=2)
ANSWER = {"general/low": "L", "general/high": "H"}
#: merge families and the settings each is tuned over (on the validation split)
MERGES = {
    "linear": [dict()],
    "task arithmetic": [dict(lam=0.5), dict(lam=1.0)],
    "TIES": [dict(density=d, lam=lam) for d in (0.3, 0.5, 0.8) for lam in (0.5, 1.0)],
    "DARE-TIES": [dict(density=d, lam=lam) for d in (0.3, 0.5) for lam in (0.5, 1.0)],
}
METHOD = {"linear": "linear", "task arithmetic": "task_arithmetic", "TIES": "ties", "DARE-TIES": "dare_ties"}


def agreement(model, items, routed: dict[str, int]) -> dict[str, float]:
    """{item id: 1.0 if the model's greedy first token is the routed teacher's (`routed[id]`)}."""
    got = tasks.first_tokens(model, [i.prompt for i in items])
    return {i.id: float(t == routed[i.id]) for i, t in zip(items, got, strict=True)}


def by_cell(scores: dict[str, float], items) -> dict[str, float]:
    out: dict[str, list[float]] = {}
    for i in items:
        out.setdefault(i.cell, []).append(scores[i.id])
    return {c: sum(v) / len(v) for c, v in sorted(out.items())}


def make_base(seed: int, train, val, s: dict, say) -> torch.nn.Module:
    """The common start: a tiny K3 fine-tuned to answer "L" or "H" at random whatever the tag (as an SFT model
    that has both behaviours but does not tie them to the tag), until >= 90 % of its first-token mass is on
    them."""
    model = tasks.tiny_k3(seed)
    rng = random.Random(f"base|{seed}")
    ids = [tasks.TOK.encode(a)[0] for a in ANSWER.values()]
    answers = [ids[rng.randrange(len(ids))] for _ in train]

    def done(step: int) -> bool:
        return tasks.first_token_mass(model, [i.prompt for i in val], ids) >= 0.9

    steps = tasks.supervise(model, [i.prompt for i in train], answers, steps=s["teacher_max_steps"],
                            lr=s["teacher_lr"], seed=seed, every=2, stop=done)
    say(f"base: {steps} supervised steps (L or H at random, whatever the tag)")
    return model


def make_teacher(base: dict, seed: int, cell: str, train, val, s: dict, say) -> torch.nn.Module:
    """The base fine-tuned to answer ANSWER[cell] first on every prompt, whatever its tag (a specialist that
    knows one behaviour and ignores the tag), until >= 95 % of the validation prompts of each cell do."""
    model = tasks.tiny_k3(seed)
    model.load_state_dict(base)
    answer = tasks.TOK.encode(ANSWER[cell])[0]

    def done(step: int) -> bool:
        return all(sum(t == answer for t in got) / len(got) >= s["teacher_at"] for got in (
            tasks.first_tokens(model, [i.prompt for i in val if i.cell == c]) for c in ANSWER))

    steps = tasks.supervise(model, [i.prompt for i in train], [answer] * len(train), steps=s["teacher_max_steps"],
                            lr=s["teacher_lr"], seed=seed + 1 + list(ANSWER).index(cell), every=2, stop=done)
    say(f"teacher {cell}: {steps} supervised steps (answers {ANSWER[cell]!r} whatever the tag)")
    return model.eval().requires_grad_(False)


def mopd_arm(base: dict, seed: int, teachers: dict, train, s: dict, shuffle: bool, say) -> torch.nn.Module:
    """MOPD from the base (`arms.run_arm` with `mopd_step`); `shuffle`: the control's permuted routing."""
    from openk3.posttrain.trainers.mopd import MOPDConfig, mopd_step
    from openk3.posttrain.trainers.rollout import Problem

    cfg = MOPDConfig(lr=s["mopd_lr"], group_size=s["group_size"], prompts_per_step=s["prompts_per_step"],
                     steps=s["steps"], seed=seed, cells=tuple(ANSWER))

    def permute(cells: list[str], step: int) -> list[str]:
        rng = random.Random(f"route|{seed}|{step}")
        out = list(cells)
        rng.shuffle(out)
        return out

    def problem(it, step: int) -> Problem:
        domain, effort = it.cell.split("/")
        return Problem(f"{it.id}@{step}", it.prompt, budget=8, score=lambda turn: 0.0,
                       meta={"domain": domain, "effort": effort})

    def step(model, opt, engine, problems, config, i) -> dict:
        return mopd_step(cfg, model, opt, engine, problems, teachers, tasks.TOK, config, i,
                         route_fn=permute if shuffle else None)[1]

    return run_arm(base, seed, train, cfg, name=NAME, problem=problem, step=step,
                   label="control" if shuffle else "MOPD", say=say, roll=dict(extra_stop_ids=tasks.ONE_TOKEN),
                   line=lambda m: f"reverse KL {m['reverse_kl']:.3f}, update scale {m['update_scale']:.2f}")


def tuned_merges(base: dict, teachers: dict, seed: int, val, val_routed, say) -> dict[str, tuple[dict, dict]]:
    """{family: (its best setting on the validation split, the merged state dict)}."""
    from openk3.posttrain.merge import merge

    sds = [teachers[c].state_dict() for c in ANSWER]
    model = tasks.tiny_k3(seed)
    out = {}
    for family, grid in MERGES.items():
        best = None
        for setting in grid:
            merged = merge(base, sds, METHOD[family], seed=seed, **setting).state_dict
            model.load_state_dict(merged)
            score = mean(agreement(model, val, val_routed))
            if best is None or score > best[0]:
                best = (score, setting, merged)
        say(f"merge {family}: best validation agreement {best[0]:.3f} at {best[1] or 'its only setting'}")
        out[family] = (best[1], best[2])
    return out


def run(profile: str, seed: int, say) -> Result:
    s = SMOKE
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    train, val, test = tasks.splits(tasks.tagged_items, s, seed)
    base_model = make_base(seed, train, val, s, say)
    base = copy.deepcopy(base_model.state_dict())
    teachers = {c: make_teacher(base, seed, c, train, val, s, say) for c in ANSWER}

    def routed(items) -> dict[str, int]:  # the routed teacher's own greedy first token on each prompt
        out = {}
        for cell, teacher in teachers.items():
            mine = [i for i in items if i.cell == cell]
            out.update({i.id: t for i, t in zip(mine, tasks.first_tokens(teacher, [i.prompt for i in mine]),
                                                strict=True)})
        return out

    test_routed, val_routed = routed(test), routed(val)
    start = agreement(base_model, test, test_routed)
    student = agreement(mopd_arm(base, seed, teachers, train, s, False, say), test, test_routed)
    control = agreement(mopd_arm(base, seed, teachers, train, s, True, say), test, test_routed)
    merged_scores, merge_settings = {}, {}
    probe = tasks.tiny_k3(seed)
    for family, (setting, sd) in tuned_merges(base, teachers, seed, val, val_routed, say).items():
        probe.load_state_dict(sd)
        merged_scores[family], merge_settings[family] = agreement(probe, test, test_routed), setting
    best = max(merged_scores, key=lambda f: mean(merged_scores[f]))
    teacher_cross = {c: by_cell(agreement(t, test, test_routed), test) for c, t in teachers.items()}
    say(f"held-out agreement: start {mean(start):.3f}, MOPD {mean(student):.3f} {by_cell(student, test)}, "
        f"control {mean(control):.3f}, best merge ({best}) {mean(merged_scores[best]):.3f}")
    return Result(
        NAME, CLAIM, METRIC, profile, [seed], treatment=arm(student, start, seed=seed),
        control=arm(control, start, seed=seed, name="MOPD with shuffled routing"),
        effect=arm(student, control, seed=seed), seconds=time.perf_counter() - t0,
        baselines={f"merge: {f}": arm(sc, start, seed=seed) for f, sc in merged_scores.items()},
        details={"start_agreement": mean(start), "per_cell": {
            "start": by_cell(start, test), "mopd": by_cell(student, test), "control": by_cell(control, test),
            **{f"merge: {f}": by_cell(sc, test) for f, sc in merged_scores.items()},
            **{f"teacher {c} (on every cell)": v for c, v in teacher_cross.items()}},
            "merge_settings": merge_settings, "best_merge": best,
            "vs_best_merge": arm(student, merged_scores[best], seed=seed)},
        settings=dict(s))
