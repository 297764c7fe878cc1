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

Full profile (one CPU core, ~30 minutes a seed; `full.py`): three effort specialists on the `general` domain.
1. the start is the pipeline's smoke SFT of the general domain with every record's effort tag shuffled among
   the records (`openk3 posttrain --profile smoke --domains general`'s data and SFT, the tags permuted before
   SFT): a model that has seen all three verbosities (terse, the steps, the full scratchpad) and ties none of
   them to the tag, so every cell has a gap to its teacher that only routing can close;
2. three teachers fine-tuned from the start on one effort's traces only (low, high or max), each trace under a
   tag drawn at random: specialists that think their own way whatever the tag;
3. arms from the start as in smoke (MOPD with each sample scored by its cell's teacher, the control with the
   routing permuted, the tuned merges), on general problems of the three cells (train split, level 1, think
   cap 320, the student sampling at T = 1);
4. greedy think tokens per problem on 100 held-out test problems per cell (`openk3 eval`'s evaluation). Per
   cell, the gap is the teacher's mean minus the start's; an arm's score on problem x of cell c is
   (arm(x) - start(x)) / gap_c, whose mean over a cell is the share of that teacher's gap the arm closes
   (`stats.gap_closed` gives it per cell with its interval). The metric is the mean over the cells whose
   teacher differs from the start (paired interval of the gap excluding 0); per-cell think tokens, shares and
   the teachers on every cell (tag-blindness) are in `details`. Merges are tuned on 30 train-split problems
   per cell by the same metric.
"""

from __future__ import annotations

import copy
import functools
import json
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

SMOKE = dict(train=2000, val=200, test=400, teacher_lr=1e-3, teacher_max_steps=200, teacher_at=0.95,
             mopd_lr=1e-3, steps=40, prompts_per_step=16, group_size=2)
FULL = dict(start_profile="smoke", test=200, val=30, pool=150, teacher_lr=5e-4, teacher_epochs=6, think_cap=320,
            response_cap=64, mopd_lr=5e-4, steps=300, prompts_per_step=12, group_size=1, context=1024)
PROFILES = {"smoke": SMOKE, "full": FULL}
FULL_METRIC = ("share of the routed teachers' separation of the tags recovered (think tokens under the max tag "
               "minus under the low tag, the same held-out problem)")
EFFORTS = ("low", "high", "max")
ANSWER = {"general/low": "L", "general/high": "H"}
#: merge families and the settings each is tuned over (on the validation split)
MERGES = {
    "linear": [dict()],
    "task arithmetic": [dict(lam=0.5), dict(lam=1.0)],
    "TIES": [dict(density=d, lam=lam) for d in (0.3, 0.5, 0.8) for lam in (0.5, 1.0)],
    "DARE-TIES": [dict(density=d, lam=lam) for d in (0.3, 0.5) for lam in (0.5, 1.0)],
}
METHOD = {"linear": "linear", "task arithmetic": "task_arithmetic", "TIES": "ties", "DARE-TIES": "dare_ties"}


def follows(treatment: dict) -> dict:
    """The claim's own words: the student follows the tag more than the start did (its change, the interval above
    0), not only more than the control (a control can drift the other way)."""
    lo, hi = treatment["ci95"]
    return {"the student follows the tag more than the start": {
        "holds": lo > 0, "detail": f"{treatment['estimate']:+.3f} [{lo:+.3f}, {hi:+.3f}]"}}


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


def shuffled_routing(seed: int):
    """The control's `route_fn`: each step's cells permuted among its samples (seeded by the seed and the step)."""
    def permute(cells: list[str], step: int) -> list[str]:
        rng = random.Random(f"route|{seed}|{step}")
        out = list(cells)
        rng.shuffle(out)
        return out

    return permute


def mopd_arm(base: dict, seed: int, teachers: dict, train, s: dict, shuffle: bool, say) -> torch.nn.Module:
    """MOPD from the base (`arms.run_arm` with `mopd_step`); `shuffle`: the control's permuted routing."""
    from openk3.posttrain.trainers.mopd import MOPDConfig, mopd_step
    from openk3.posttrain.trainers.rollout import Problem

    cfg = MOPDConfig(lr=s["mopd_lr"], group_size=s["group_size"], prompts_per_step=s["prompts_per_step"],
                     steps=s["steps"], seed=seed, cells=tuple(ANSWER))

    def problem(it, step: int) -> Problem:
        domain, effort = it.cell.split("/")
        return Problem(f"{it.id}@{step}", it.prompt, budget=8, score=lambda turn: 0.0,
                       meta={"domain": domain, "effort": effort})

    def step(model, opt, engine, problems, config, i) -> dict:
        return mopd_step(cfg, model, opt, engine, problems, teachers, tasks.TOK, config, i,
                         route_fn=shuffled_routing(seed) if shuffle else None)[1]

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


def run(profile: str, s: dict, seed: int, say, out) -> Result:
    if profile == "full":
        return run_full(s, seed, say, out)
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
    treatment = arm(student, start, seed=seed)
    return Result(
        NAME, CLAIM, METRIC, profile, [seed], treatment=treatment, requirements=follows(treatment),
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


# ---- the full profile ------------------------------------------------------------------------------


def shuffle_tags(seed: int):
    """data_fn for `full.sft_start`: the records' effort tags permuted among them (each trace keeps its
    verbosity; the originals are kept beside as original.jsonl, where the teachers' traces come from)."""
    def rewrite(path) -> None:
        from openk3.fsutil import write_atomic

        lines = path.read_text().splitlines()
        write_atomic(path.with_name("original.jsonl"), ("\n".join(lines) + "\n").encode())
        records = [json.loads(line) for line in lines]
        tags = [r["effort"] for r in records]
        random.Random(f"tags|{seed}").shuffle(tags)
        for r, tag in zip(records, tags, strict=True):
            r["effort"] = tag
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in records).encode())

    return rewrite


def make_full_teacher(out, start_folder, seed: int, effort: str, s: dict, say):
    """The start fine-tuned on the `effort` traces only, each under a random tag (a checkpoint folder)."""
    from openk3.checkpoint.load import resolve_checkpoint
    from openk3.fsutil import write_atomic
    from openk3.posttrain.trainers.sft import SFTConfig, sft
    from openk3.train.optim import OptimConfig

    folder = out / "teachers" / effort
    if (folder / "done").is_file():
        return resolve_checkpoint(folder)
    rng = random.Random(f"teacher|{seed}|{effort}")
    records = [json.loads(line) for line in (out / "start" / "data" / "original.jsonl").read_text().splitlines()]
    mine = [dict(r, effort=rng.choice(EFFORTS)) for r in records if r["effort"] == effort]
    data = out / "teachers" / f"{effort}.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(data, "".join(json.dumps(r) + "\n" for r in mine).encode())
    cfg = SFTConfig(base=str(start_folder), data=(str(data),), optim=OptimConfig(lr=s["teacher_lr"]), batch_size=1,
                    seq_len=s["context"], epochs=s["teacher_epochs"], overflow="truncate", seed=seed, save_every=0,
                    threads=torch.get_num_threads())
    summary = sft(cfg, folder, progress=False)
    write_atomic(folder / "done", b"")
    say(f"teacher general/{effort}: {summary['steps']} SFT steps on {len(mine)} {effort} traces under random tags")
    return resolve_checkpoint(folder)


def separation(low: dict[str, float], high: dict[str, float]) -> dict[str, float]:
    """{problem: think tokens under the max tag minus under the low tag} of one problem asked with both tags
    (ids `.../low` and `.../max`: the effort suffix stripped to pair them). A model that thinks the same way
    whatever the tag has ~0; a shift of every cell alike cancels."""
    lo = {p.rsplit("/", 1)[0]: v for p, v in low.items()}
    hi = {p.rsplit("/", 1)[0]: v for p, v in high.items()}
    return {p: hi[p] - lo[p] for p in lo if p in hi}


def separation_scores(arm_sep: dict, start_sep: dict, teacher_gain: float) -> dict[str, float]:
    """{problem: (arm's separation - start's) / the teachers' mean separation gain over the start}: the share of
    the routed teachers' separation the arm recovers, per problem (mean over problems = `stats.gap_closed`'s
    estimate)."""
    return {p: (arm_sep[p] - start_sep[p]) / teacher_gain for p in arm_sep if p in start_sep}


def run_full(s: dict, seed: int, say, out) -> Result:
    """The full profile (module docstring): three tag-blind effort specialists on the general domain."""
    import dataclasses

    from openk3.experiments import full
    from openk3.posttrain.merge import merge
    from openk3.posttrain.trainers.mopd import MOPDConfig, mopd_step
    from openk3.stats import gap_closed, paired

    t0 = time.perf_counter()
    cells = [f"general/{e}" for e in EFFORTS]
    opened = full.open_start(out, seed, say, s["start_profile"], data_fn=shuffle_tags(seed))
    start_folder, start_model, tok, start = opened.folder, opened.model, opened.tok, opened.state
    teacher_folders = {f"general/{e}": make_full_teacher(out, start_folder, seed, e, s, say) for e in EFFORTS}
    teachers = {c: full.open_model(f)[0].requires_grad_(False) for c, f in teacher_folders.items()}
    lengths = dict(think_cap=s["think_cap"], response_cap=s["response_cap"])

    def think(model, n: int) -> dict:
        """{cell: {"think": {problem: greedy think tokens}, "accuracy": {...}, "mean", "ci95"}} on the test split
        (the same problems in every cell, each asked with that cell's tag)."""
        m = full.greedy(model, tok, [tuple(c.split("/")) for c in cells], n=n, seed=seed, **lengths)
        return {c: {"think": full.scores(m[c], "thinking_tokens"), "accuracy": full.scores(m[c], "accuracy"),
                    "mean": m[c]["thinking_tokens"], "ci95": m[c]["ci95"]["thinking_tokens"]} for c in cells}

    val_sets = {c: full.problems(tok, c.split("/")[1], "train", s["val"], seed + 7_777) for c in cells}

    def val_think(model, cell: str) -> dict:
        from openk3.posttrain.trainers.rollout import RolloutConfig, rollout

        engine = full.engine_for(model)
        records = rollout(engine, [dataclasses.replace(p, budget=s["think_cap"]) for p in val_sets[cell]], tok,
                          RolloutConfig(group_size=1, temperature=1e-6, logprobs=False,
                                        response_cap=s["response_cap"], over_budget_reward=0.0))
        return {r["problem_id"]: float(r["think_tokens"]) for r in records}

    start_test = full.arm_cache(out, "start", lambda: think(start_model, s["test"]))
    teacher_test = {c: full.arm_cache(out, f"teacher {c}", lambda t=t: think(t, s["test"]))
                    for c, t in teachers.items()}
    low, top = cells[0], cells[-1]

    def sep(arm_cells: dict, teachers_own: bool = False) -> dict[str, float]:
        """The separation of an arm's test think tokens (or of the routed teachers, each on its own cell)."""
        if teachers_own:
            return separation(teacher_test[low][low]["think"], teacher_test[top][top]["think"])
        return separation(arm_cells[low]["think"], arm_cells[top]["think"])

    start_sep, teacher_sep = sep(start_test), sep(None, teachers_own=True)
    gain = paired(teacher_sep, start_sep, seed=seed)  # the teachers' separation over the start's, per problem
    say(f"think tokens per cell: start { {c: round(start_test[c]['mean'], 1) for c in cells} }; teachers on their "
        f"own cells { {c: round(teacher_test[c][c]['mean'], 1) for c in cells} }; separation (max - low tag) "
        f"gain of the routed teachers over the start {gain.estimate:.1f} [{gain.ci95[0]:.1f}, {gain.ci95[1]:.1f}]")

    def score(arm_cells: dict) -> dict:
        return separation_scores(sep(arm_cells), start_sep, gain.estimate)

    pool = [p for c in cells for p in full.problems(tok, c.split("/")[1], "train", s["pool"], seed)]
    cfg = MOPDConfig(lr=s["mopd_lr"], group_size=s["group_size"], prompts_per_step=s["prompts_per_step"],
                     steps=s["steps"], seed=seed, cells=tuple(cells), max_model_len=s["context"])

    def mopd_full(shuffle: bool) -> torch.nn.Module:
        def problem(p, step: int):
            return dataclasses.replace(p, id=f"{p.id}@{step}", budget=s["think_cap"])

        def step(model, opt, engine, problems, config, i) -> dict:
            return mopd_step(cfg, model, opt, engine, problems, teachers, tok, config, i,
                             route_fn=shuffled_routing(seed) if shuffle else None)[1]

        return run_arm(start, seed, pool, cfg, name=NAME, problem=problem, step=step,
                       label="control" if shuffle else "MOPD", say=say,
                       roll=dict(response_cap=s["response_cap"], over_budget_reward=0.0),
                       line=lambda m: (f"reverse KL {m['reverse_kl']:.3f}, think {m['think_mean']:.1f}, "
                                       f"update scale {m['update_scale']:.2f}"),
                       build=opened.fresh)

    student = full.arm_cache(out, "mopd", lambda: think(mopd_full(False), s["test"]))
    control = full.arm_cache(out, "control", lambda: think(mopd_full(True), s["test"]))

    # merges: each family's setting chosen on the validation problems by the same metric
    sds = [teachers[c].state_dict() for c in cells]
    probe = opened.fresh()

    @functools.cache
    def val_reference() -> tuple[dict, float]:
        """(the start's separation on the validation problems, the teachers' gain over it): only a merge being
        tuned needs them, so a rerun whose merges are all finished does not evaluate them again."""
        start_sep = separation(val_think(start_model, low), val_think(start_model, top))
        return start_sep, mean(separation(val_think(teachers[low], low), val_think(teachers[top], top))) \
            - mean(start_sep)

    def tuned(family: str) -> dict:
        val_start_sep, val_gain = val_reference()
        best = None
        for setting in MERGES[family]:
            probe.load_state_dict(merge(start, sds, METHOD[family], seed=seed, **setting).state_dict)
            got = separation(val_think(probe, low), val_think(probe, top))
            value = mean(separation_scores(got, val_start_sep, val_gain)) if val_gain else 0.0
            if best is None or value > best[0]:
                best = (value, setting)
        say(f"merge {family}: best validation share {best[0]:.3f} at {best[1] or 'its only setting'}")
        probe.load_state_dict(merge(start, sds, METHOD[family], seed=seed, **best[1]).state_dict)
        return {"setting": best[1], "validation": best[0], "test": think(probe, s["test"])}

    merges = {f: full.arm_cache(out, f"merge {f}", lambda f=f: tuned(f)) for f in MERGES}
    measurable = gain.ci95[0] > 0  # the teachers separate the tags more than the start does
    reason = None if measurable else (
        f"the routed teachers' separation of the tags is not above the start's ({gain.estimate:.1f} "
        f"[{gain.ci95[0]:.1f}, {gain.ci95[1]:.1f}] think tokens): there is nothing to recover")
    zero = {p: 0.0 for p in start_sep} if measurable else {}
    arms = {"mopd": student, "control": control, **{f"merge: {f}": m["test"] for f, m in merges.items()}}
    scored = {name: score(a) if measurable else {} for name, a in arms.items()}
    best = max(merges, key=lambda f: mean(scored[f"merge: {f}"]) if zero else 0.0)

    def per_cell(a: dict) -> dict:
        return {c: {"think_tokens": a[c]["mean"], "ci95": a[c]["ci95"],
                    "accuracy": sum(a[c]["accuracy"].values()) / len(a[c]["accuracy"]),
                    "share_of_gap": (lambda g: None if g is None else g.to_dict())(
                        gap_closed(a[c]["think"], start_test[c]["think"], teacher_test[c][c]["think"], seed=seed))}
                for c in cells}

    if zero:
        say(f"share of the teachers' separation recovered: MOPD {mean(scored['mopd']):.3f}, control "
            f"{mean(scored['control']):.3f}, best merge ({best}) {mean(scored[f'merge: {best}']):.3f}")
        treatment, ctl, effect = (arm(scored["mopd"], zero, seed=seed),
                                  arm(scored["control"], zero, seed=seed, name="MOPD with shuffled routing"),
                                  arm(scored["mopd"], scored["control"], seed=seed))
        baselines = {f"merge: {f}": arm(scored[f"merge: {f}"], zero, seed=seed) for f in merges}
        vs_best = arm(scored["mopd"], scored[f"merge: {best}"], seed=seed)
    else:
        empty = {"estimate": 0.0, "ci95": [0.0, 0.0], "p_greater": 1.0, "n": 0}
        treatment, ctl, effect, baselines, vs_best = empty, {"name": "MOPD with shuffled routing", **empty}, \
            empty, {}, empty
    return Result(
        NAME, CLAIM, FULL_METRIC, "full", [seed],
        treatment=treatment, control=ctl, effect=effect, seconds=time.perf_counter() - t0, reason=reason,
        requirements=follows(treatment) if measurable else {},
        baselines=baselines,
        details={"teacher_separation_gain": gain.to_dict(),
                 "separation": {name: mean(sep(a)) for name, a in {"start": start_test, **arms}.items()}
                 | {"teachers": mean(teacher_sep)},
                 "best_merge": best, "vs_best_merge": vs_best,
                 "merge_settings": {f: m["setting"] for f, m in merges.items()},
                 "merge_validation_share": {f: m["validation"] for f, m in merges.items()},
                 "per_cell": {"start": per_cell(start_test), "mopd": per_cell(student), "control": per_cell(control),
                              **{f"merge: {f}": per_cell(m["test"]) for f, m in merges.items()}},
                 "teachers_on_every_cell": {c: {d: {"think_tokens": t[d]["mean"], "ci95": t[d]["ci95"]}
                                                for d in cells} for c, t in teacher_test.items()},
                 "start_checkpoint": str(start_folder)},
        settings=dict(s))
