"""`openk3 experiment` (issue 30 item 3): the result contract and verdict rule, the smoke tasks' splits, the
command's listing and errors, and the two post-training smoke experiments end to end with fixed seeds."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json

import pytest

from openk3.experiments import EXPERIMENTS, experiment, result, tasks

KEYS = ["experiment", "claim", "metric", "profile", "seeds", "treatment", "control", "effect", "verdict", "seconds"]


def command(argv: list[str]) -> tuple[int, str]:
    from openk3.commands import experiment as cmd

    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = cmd.main(parser.parse_args(argv))
    return rc, printed.getvalue()


def test_the_verdict_follows_the_effect_interval(tmp_path):
    up = {f"p{k}": 1.0 for k in range(30)}
    flat = {f"p{k}": float(k % 2) for k in range(30)}
    r = result.Result("x", "c", "m", "smoke", [0], treatment=result.arm(up, flat), control=result.arm(flat, flat,
                      name="ctl"), effect=result.arm(up, flat))
    d = result.write_result(r, tmp_path / "out")
    assert list(d)[:len(KEYS)] == KEYS and d["verdict"] == "supported" and d["control"]["verdict"] == "not supported"
    assert d["effect"]["estimate"] == pytest.approx(0.5) and d["effect"]["ci95"][0] > 0
    assert json.loads((tmp_path / "out" / "result.json").read_text()) == d
    assert (tmp_path / "out" / "result.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r.effect = result.arm(flat, up)
    assert r.to_dict()["verdict"] == "not supported"
    r.reason = "the start never reached 30 %"
    assert r.to_dict()["verdict"] == "inconclusive" and r.to_dict()["reason"].startswith("the start")


def test_splits_are_disjoint_and_deterministic():
    for make in (tasks.digit_items, tasks.tagged_items):
        train, test = make(300, "train"), make(100, "test")
        assert not {i.text for i in train} & {i.text for i in test}
        assert all(tasks.split_of(i.text) == "test" for i in test)
        assert [i.text for i in make(100, "test")] == [i.text for i in test]
        assert [i.text for i in make(100, "test", seed=1)] != [i.text for i in test]
    digits = tasks.digit_items(50, "val")
    for i in digits:
        d = next(c for c in i.text if c.isdigit())
        assert tasks.TOK.decode([i.answer]) == str((int(d) + 1) % 10) and i.prompt[-len(tasks.THINK_OPEN):] == \
            tasks.THINK_OPEN
    cells = [i.cell for i in tasks.tagged_items(200, "train")]
    assert 70 < cells.count("general/low") < 130 and set(cells) == set(tasks.TAGS)
    with pytest.raises(ValueError, match="split must be one of"):
        tasks.digit_items(1, "dev")


def test_the_command_lists_and_names_bad_input():
    rc, out = command(["--list"])
    assert rc == 0
    for name in EXPERIMENTS:
        assert name in out and experiment(name).CLAIM in out
    with pytest.raises(ValueError, match="unknown experiment 'nope'"):
        command(["nope"])
    with pytest.raises(ValueError, match="profile 'huge' is not available"):
        command(["rl-heldout", "--profile", "huge"])
    with pytest.raises(ValueError, match="name an experiment"):
        command([])


@pytest.mark.slow(seconds=65)  # 60-70 s on one thread: an SFT start, then two 40-step RL runs of a 2-layer K3
def test_rl_heldout_smoke_is_supported_and_its_control_is_not(tmp_path):
    rc, out = command(["rl-heldout", "--seed", "0", "--out", str(tmp_path), "--threads", "1"])
    d = json.loads((tmp_path / "result.json").read_text())
    assert rc == 0 and "rl-heldout: supported" in out and (tmp_path / "result.png").is_file()
    assert list(d)[:len(KEYS)] == KEYS and d["seeds"] == [0] and d["profile"] == "smoke"
    assert d["verdict"] == "supported" and d["control"]["verdict"] == "not supported"
    assert d["treatment"]["ci95"][0] > 0 and d["effect"]["estimate"] >= 0.15  # the smoke bar
    assert d["requirements"]["accuracy rises over the SFT start"]["holds"]
    assert 0.3 <= d["details"]["sft_val_accuracy"] and d["details"]["start_accuracy"] < 0.7


@pytest.mark.slow(seconds=60)  # 50-65 s on one thread: base, two teachers, two 40-step MOPD runs, 14 merges
def test_mopd_vs_merge_smoke_is_supported_and_merges_stay_near_chance(tmp_path):
    rc, out = command(["mopd-vs-merge", "--seed", "1", "--out", str(tmp_path), "--threads", "1"])
    d = json.loads((tmp_path / "result.json").read_text())
    assert rc == 0 and d["verdict"] == "supported" and d["control"]["verdict"] == "not supported"
    cells = d["details"]["per_cell"]
    assert min(cells["mopd"].values()) >= 0.8  # the student follows the tag in every cell
    for name, per in cells.items():
        if name.startswith("merge: "):  # no merge can follow a tag neither teacher reads: about chance
            assert abs(sum(per.values()) / len(per) - 0.5) < 0.15, (name, per)
    assert d["details"]["vs_best_merge"]["ci95"][0] > 0
    assert d["requirements"]["the student follows the tag more than the start"]["holds"]


@pytest.mark.slow(seconds=95)  # 95 s here with AVX-512, 3.3-4.2 min on the AVX2 host: SFT on whole turns, two RL runs
def test_effort_budget_smoke_is_supported_and_meets_both_requirements(tmp_path):
    rc, out = command(["effort-budget", "--seed", "0", "--out", str(tmp_path), "--threads", "1"])
    d = json.loads((tmp_path / "result.json").read_text())
    assert rc == 0 and d["verdict"] == "supported" and d["control"]["verdict"] == "not supported", out
    assert all(r["holds"] for r in d["requirements"].values()) and d["details"]["cut"] >= 0.3
    think = d["details"]["think_tokens"]
    assert think["budget"] < 0.7 * think["no budget"] and think["budget"] < think["start"]


def test_a_requirement_that_fails_makes_the_claim_not_supported():
    up = {f"p{k}": 1.0 for k in range(30)}
    flat = {f"p{k}": 0.0 for k in range(30)}
    r = result.Result("x", "c", "m", "smoke", [0], treatment=result.arm(up, flat), control=result.arm(flat, flat),
                      effect=result.arm(up, flat),
                      requirements={"cut >= 30 %": {"holds": False, "detail": "cut 0.1"}})
    assert r.effect["ci95"][0] > 0 and r.to_dict()["verdict"] == "not supported"
    r.requirements["cut >= 30 %"]["holds"] = True
    assert r.to_dict()["verdict"] == "supported"
    # rl-heldout's own requirement: the treatment must rise over the start, not only beat a collapsing control
    from openk3.experiments.rl_heldout import raised

    assert not raised(result.arm(flat, flat))["accuracy rises over the SFT start"]["holds"]
    assert raised(result.arm(up, flat))["accuracy rises over the SFT start"]["holds"]
    from openk3.experiments.mopd_vs_merge import follows

    assert not follows(result.arm(flat, flat))["the student follows the tag more than the start"]["holds"]


def test_turn_ids_are_what_the_parser_reads_back():
    from openk3.posttrain.trainers.rollout import parse_turn

    ids = tasks.turn_ids("....", "7")
    message = parse_turn(ids, tasks.TOK)
    assert message["reasoning_content"] == "...." and message["content"] == "7"


# ---- the full profiles' code at toy sizes (the runs themselves: docs/experiments.md) -------------------------

TOY_START = dict(start_profile="tiny", think_cap=16, response_cap=8)


@pytest.mark.slow(seconds=40)  # ~20 s: the tiny pipeline's SFT, sampled scores, two 2-step RL arms, evals
def test_rl_heldout_full_runs_its_arms_and_a_rerun_continues_from_them(tmp_path, monkeypatch):
    from openk3.experiments import full, rl_heldout, run_experiment

    toy = dict(TOY_START, candidates=6, pass_k=2, test=5, steps=2, prompts_per_step=2, group_size=2)
    lines: list[str] = []
    # the toy start scores 0 on every sample: no prompt has a signal, so the experiment cannot measure, and says so
    d0 = run_experiment("rl-heldout", "full", 0, tmp_path / "flat", say=lines.append, overrides=toy)
    assert d0["verdict"] == "inconclusive" and "only 0 training prompts have scores that differ" in d0["reason"]
    sampled = json.loads((tmp_path / "flat" / "arms" / "sample_scores.json").read_text())
    assert len(sampled) == 6 and all(len(v) == 2 for v in sampled.values())
    # samples that differ (as a start that sometimes solves them would give): both RL arms run
    monkeypatch.setattr(full, "sample_scores", lambda model, tok, pool, **kw: {p.id: [0.0, 1.0] for p in pool})
    d = run_experiment("rl-heldout", "full", 0, tmp_path, say=lines.append, overrides=toy)
    assert d["profile"] == "full" and d["settings"]["start_profile"] == "tiny" and d["verdict"] != "inconclusive"
    assert d["details"]["training_prompts"] == 6 and d["details"]["pass_histogram"]["1"] == 6
    assert d["treatment"]["n"] == d["control"]["n"] == d["effect"]["n"] == 5
    assert {p.name for p in (tmp_path / "arms").iterdir()} == {"sample_scores.json", "start.json", "treatment.json",
                                                                "control.json"}
    assert any("training prompts: 6 of 6 with scores that differ among 2 samples" in line for line in lines)

    # a rerun (as after a kill) reuses the start, the sampled scores and every finished arm: nothing trains again
    def no(*args, **kwargs):
        raise AssertionError("a finished arm ran again")

    for where, name in ((rl_heldout, "rl_arm"), (full, "sample_scores"), (full, "greedy")):
        monkeypatch.setattr(where, name, no)
    d2 = run_experiment("rl-heldout", "full", 0, tmp_path, say=lines.append, overrides=toy)
    assert {k: d2[k] for k in ("treatment", "control", "effect")} == {k: d[k] for k in ("treatment", "control",
                                                                                       "effect")}
    with pytest.raises(ValueError, match=r"unknown settings \['stepz'\]"):
        run_experiment("rl-heldout", "full", 0, tmp_path / "bad", overrides={"stepz": 1})


@pytest.mark.slow(seconds=40)  # ~30 s: the tiny pipeline's SFT with shuffled tags, three teachers, two MOPD arms
def test_mopd_vs_merge_full_builds_tag_blind_teachers_and_scores_every_arm(tmp_path):
    from openk3.experiments import mopd_vs_merge as mvm
    from openk3.experiments import run_experiment

    toy = dict(TOY_START, test=4, val=2, pool=6, teacher_epochs=1, steps=2, prompts_per_step=3)
    d = run_experiment("mopd-vs-merge", "full", 0, tmp_path, say=lambda line: None, overrides=toy)
    assert d["profile"] == "full" and set(d["details"]["per_cell"]) == {"start", "mopd", "control",
                                                                          *(f"merge: {f}" for f in mvm.MERGES)}
    for cells in d["details"]["per_cell"].values():
        assert set(cells) == {"general/low", "general/high", "general/max"}
        assert all(len(c["ci95"]) == 2 for c in cells.values())
    # the start's SFT saw every trace under a permuted tag; each teacher saw only its effort's traces
    data = tmp_path / "start" / "data"
    original = [json.loads(line) for line in (data / "original.jsonl").read_text().splitlines()]
    shuffled = [json.loads(line) for line in (data / "sft_train.jsonl").read_text().splitlines()]
    assert [r["id"] for r in original] == [r["id"] for r in shuffled]
    assert sorted(r["effort"] for r in original) == sorted(r["effort"] for r in shuffled)
    for effort in mvm.EFFORTS:
        mine = [json.loads(line) for line in (tmp_path / "teachers" / f"{effort}.jsonl").read_text().splitlines()]
        assert mine and all(r["id"].endswith(f"/{effort}") for r in mine)
    # the metric needs the routed teachers to separate the tags more than the start: otherwise, inconclusive
    gain = d["details"]["teacher_separation_gain"]
    assert (d["verdict"] == "inconclusive") == (gain["ci95"][0] <= 0)
    assert set(d["details"]["separation"]) == {"start", "mopd", "control", "teachers",
                                               *(f"merge: {f}" for f in mvm.MERGES)}


def test_separation_pairs_one_problem_under_two_tags_and_ignores_shifts():
    from openk3.experiments.mopd_vs_merge import separation, separation_scores

    low = {"general/arith/test/1/l1/low": 10.0, "general/word/test/2/l1/low": 30.0}
    top = {"general/arith/test/1/l1/max": 50.0, "general/word/test/2/l1/max": 30.0}
    assert separation(low, top) == {"general/arith/test/1/l1": 40.0, "general/word/test/2/l1": 0.0}
    shifted = separation({k: v + 25 for k, v in low.items()}, {k: v + 25 for k, v in top.items()})
    assert shifted == separation(low, top)  # thinking longer (or shorter) under every tag alike is no separation
    start = {"general/arith/test/1/l1": 0.0, "general/word/test/2/l1": 0.0}
    assert separation_scores(separation(low, top), start, 40.0) == {"general/arith/test/1/l1": 1.0,
                                                                     "general/word/test/2/l1": 0.0}


@pytest.mark.slow(seconds=30)  # ~15 s: the tiny pipeline's SFT, two 2-step RL arms, three evals
def test_effort_budget_full_anneals_the_budget_and_judges_both_requirements(tmp_path, monkeypatch):
    from openk3.experiments import effort_budget, run_experiment

    budgets: dict[str, list[int]] = {"budget": [], "no budget": []}
    real = effort_budget.rl_arm

    def spy(start, seed, train, s, *, problem, label, **kw):  # the budgets each arm's problems get, per step
        budgets[label] += [problem(train[0], step).budget for step in range(s["steps"])]
        # (then the arm itself, its think stop cut to the toy's cap: the toy model would think to B_max ~ 300)
        return real(start, seed, train, s, label=label, **kw,
                    problem=lambda p, step: dataclasses.replace(problem(p, step), budget=s["think_cap"]))

    monkeypatch.setattr(effort_budget, "rl_arm", spy)
    toy = dict(TOY_START, pool=4, test=4, steps=4, prompts_per_step=2, group_size=2)
    d = run_experiment("effort-budget", "full", 0, tmp_path, say=lambda line: None, overrides=toy)
    assert d["profile"] == "full" and set(d["details"]["think_tokens"]) == {"start", "budget", "no budget"}
    assert set(d["requirements"]) == {"thinks >= 30% less than the control",
                                      "no accuracy loss beyond the interval (budget - no budget)"}
    assert budgets["no budget"] == [16] * 4
    first, *rest = budgets["budget"]
    assert first > rest[-1] and rest == sorted(rest, reverse=True)  # annealed down from B_max toward B_high
    assert {p.name for p in (tmp_path / "arms").iterdir()} == {"start.json", "budget.json", "no_budget.json"}
