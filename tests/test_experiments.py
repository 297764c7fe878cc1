"""`openk3 experiment` (issue 30 item 3): the result contract and verdict rule, the smoke tasks' splits, the
command's listing and errors, and the two post-training smoke experiments end to end with fixed seeds."""

from __future__ import annotations

import argparse
import contextlib
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


def test_a_requirement_that_fails_makes_the_claim_not_supported():
    up = {f"p{k}": 1.0 for k in range(30)}
    flat = {f"p{k}": 0.0 for k in range(30)}
    r = result.Result("x", "c", "m", "smoke", [0], treatment=result.arm(up, flat), control=result.arm(flat, flat),
                      effect=result.arm(up, flat),
                      requirements={"cut >= 30 %": {"holds": False, "detail": "cut 0.1"}})
    assert r.effect["ci95"][0] > 0 and r.to_dict()["verdict"] == "not supported"
    r.requirements["cut >= 30 %"]["holds"] = True
    assert r.to_dict()["verdict"] == "supported"


def test_turn_ids_are_what_the_parser_reads_back():
    from openk3.posttrain.trainers.rollout import parse_turn

    ids = tasks.turn_ids("....", "7")
    message = parse_turn(ids, tasks.TOK)
    assert message["reasoning_content"] == "...." and message["content"] == "7"
