"""The `agent` and `coding` domains' SFT trajectories (openk3/posttrain/domains/agentic.py, traces.py).

The experts act in the real sandbox, so these tests need one; they skip with the reason where
`openk3.agent.unavailable_reason()` names a missing piece. The datasets are built once per module, small
(one problem per family), with a high recovery rate so that recovery episodes are present.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest

from openk3.agent import unavailable_reason
from openk3.agent.tasks import FAMILIES, Call, generate
from openk3.agent.tools import declare
from openk3.posttrain.domains import agentic
from openk3.posttrain.domains.agentic import agentic_dataset, problem_signature, verify_record
from openk3.posttrain.domains.records import byte_tokenizer, read_jsonl, roundtrip_problems, think_tokens, write_jsonl

WHY = unavailable_reason()
needs_sandbox = pytest.mark.skipif(WHY is not None, reason=f"no sandbox on this host: {WHY}")
TOK = byte_tokenizer()


@pytest.fixture(scope="module")
def agent_train():
    return agentic_dataset("agent", 1, seed=0, split="train", recovery_rate=0.5, replay_episodes=False)


@pytest.fixture(scope="module")
def coding():
    """The coding domain at every split. Replay is off while building (it doubles the cost); the first test
    replays the max records of train, and the mutation test replays more."""
    return {split: agentic_dataset("coding", 1, seed=0, split=split, recovery_rate=0.5, replay_episodes=False)
            for split in ("train", "test", "heldout")}


def _calls(record: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for m in record["messages"] if m["role"] == "assistant" for c in m.get("tool_calls") or []]


@needs_sandbox
def test_every_record_passes_its_verifier_round_trip_and_budget(agent_train, coding, tmp_path):
    records = agent_train + coding["train"] + coding["test"] + coding["heldout"]
    cells = defaultdict(int)
    for r in records:
        cells[r["domain"], r["family"], r["split"], r["effort"]] += 1
        assert r["verifier"]["reward"] == 1.0
        assert roundtrip_problems(r, TOK) == []
        assert verify_record(r, TOK, replay_episode=r["effort"] == "max" and r["split"] == "train") == []
        assert r["stats"]["think_tokens"] == think_tokens(r, TOK) <= r["budget_think_tokens"]
        task = generate(r["family"], r["seed"], r["difficulty"], r["split"])
        assert r["tools"] == declare(task.tools)
        assert r["messages"][0] == {"role": "user", "content": task.instruction}
        # genuine tool traffic: every call is answered by one tool message, in order, and the episode ends in Submit
        ids = [c["id"] for m in r["messages"] if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        assert [m["tool_call_id"] for m in r["messages"] if m["role"] == "tool"] == ids
        assert _calls(r)[-1][0] == "Submit" and r["messages"][-1]["content"] == "Submitted."
    assert set(cells.values()) == {1}
    assert {(d, f) for d, f, _, _ in cells} == {("agent", "tool_arith"), ("agent", "data_wrangle"),
                                                ("agent", "multi_hop"), ("coding", "fix_test"),
                                                ("coding", "implement_spec")}
    # heldout problems come from the held-out templates only
    for r in coding["heldout"]:
        assert r["stats"]["template"] in FAMILIES[r["family"]].heldout_templates
    path = tmp_path / "agentic.jsonl"
    assert write_jsonl(path, records) == len(records)
    assert read_jsonl(path) == json.loads(json.dumps(records))


@needs_sandbox
def test_think_tokens_grow_low_high_max_and_max_verifies(agent_train, coding):
    by_problem = defaultdict(dict)
    for r in agent_train + coding["train"]:
        by_problem[r["signature"]][r["effort"]] = r
    assert len(by_problem) == 5
    for efforts in by_problem.values():
        low, high, top = (efforts[e] for e in ("low", "high", "max"))
        assert low["stats"]["think_tokens"] < high["stats"]["think_tokens"] < top["stats"]["think_tokens"]
        assert low["budget_think_tokens"] < high["budget_think_tokens"] < top["budget_think_tokens"]
        # max re-checks its work after acting: the stored key, the written output, the fixed module
        names = [name for name, _ in _calls(top)]
        if top["family"] == "tool_arith":
            assert ("KVGet", {"key": "result"}) in _calls(top)
            assert ("KVGet", {"key": "result"}) not in _calls(high)
        elif top["family"] == "data_wrangle":
            assert names[-2] in ("ReadFile", "SQL") and names[-3] == "Shell"
        elif top["family"] == "multi_hop":
            assert names[-3:] == ["KVGet", "Grep", "Submit"] and "Grep" not in [n for n, _ in _calls(high)]
        else:  # fix_test, implement_spec
            last_edit = max(k for k, n in enumerate(names) if n == "StrReplaceFile")
            assert "ReadFile" in names[last_edit:]


@needs_sandbox
def test_deterministic_per_seed_and_splits_disjoint(coding):
    again = agentic_dataset("coding", 1, seed=0, split="train", recovery_rate=0.5, replay_episodes=False)
    assert json.dumps(again) == json.dumps(coding["train"])
    signatures = {split: {r["signature"] for r in rs} for split, rs in coding.items()}
    assert all(len(s) == 2 for s in signatures.values())
    assert not (signatures["train"] & signatures["test"] or signatures["train"] & signatures["heldout"]
                or signatures["test"] & signatures["heldout"])
    for split, rs in coding.items():
        for r in rs:
            task = generate(r["family"], r["seed"], r["difficulty"], r["split"])
            assert r["split"] == split and r["signature"] == problem_signature(task)


@needs_sandbox
def test_recovery_episodes_are_present_observed_and_still_rewarded(agent_train, coding):
    records = agent_train + coding["train"] + coding["test"] + coding["heldout"]
    recovered = [r for r in records if r["stats"]["recovery"]]
    clean = [r for r in records if not r["stats"]["recovery"]]
    assert recovered and clean
    assert {r["family"] for r in recovered} == {"tool_arith", "data_wrangle", "multi_hop", "fix_test",
                                                "implement_spec"}
    # each family's scripted mistake shows in a tool message of a recovery episode, and never in a clean one
    mistakes = {"tool_arith": ("(not found)", "no keys with prefix"), "data_wrangle": ("FileNotFoundError",),
                "multi_hop": ("No such file",), "fix_test": ("No such file",), "implement_spec": ("FAILED",)}
    for r in records:
        tool_text = "\n".join(m["content"] for m in r["messages"] if m["role"] == "tool")
        assert any(m in tool_text for m in mistakes[r["family"]]) == r["stats"]["recovery"], tool_text
        assert r["verifier"]["reward"] == 1.0
    assert all(r["stats"]["tool_errors"] == 0 for r in clean if r["family"] != "tool_arith")
    assert all(r["stats"]["tool_errors"] == 1 for r in recovered if r["family"] in ("fix_test", "multi_hop"))


@needs_sandbox
def test_a_mutated_trajectory_fails_verification(agent_train):
    record = next(r for r in agent_train if r["family"] == "tool_arith" and r["effort"] == "high")
    assert verify_record(record, TOK) == []
    bad = json.loads(json.dumps(record))
    for m in bad["messages"]:
        for c in m.get("tool_calls") or []:
            args = json.loads(c["function"]["arguments"])
            if c["function"]["name"] == "KVSet":
                args["value"] += 1
            elif c["function"]["name"] == "Submit":
                args["answer"] = str(int(args["answer"]) + 1)
            c["function"]["arguments"] = json.dumps(args)
    problems = verify_record(bad, TOK)
    assert any("verifier gives 0.0" in p for p in problems), problems
    # over its budget, or with a tool message the sandbox would not give, a record is refused too
    tight = dict(record, budget_think_tokens=record["stats"]["think_tokens"] - 1)
    assert any("over the high budget" in p for p in verify_record(tight, TOK, replay_episode=False))
    forged = json.loads(json.dumps(record))
    next(m for m in forged["messages"] if m["role"] == "tool")["content"] = "forged"
    assert any("differ from the record's" in p for p in verify_record(forged, TOK))


@needs_sandbox
def test_a_problem_whose_trace_fails_is_dropped_whole(monkeypatch):
    """An expert that submits a wrong number: its problem never enters the dataset."""
    real = agentic.EXPERTS["tool_arith"]

    def off_by_one(task, effort, recovery, rng):
        expert = real(task, effort, recovery, rng)
        sent = None
        while True:
            try:
                msg = expert.send(sent)
            except StopIteration:
                return
            for c in msg.get("tool_calls") or []:
                if c["function"]["name"] == "Submit":
                    c["function"]["arguments"] = json.dumps({"answer": "-1"})
            sent = yield msg

    monkeypatch.setattr(agentic, "EXPERTS", {**agentic.EXPERTS, "tool_arith": off_by_one})
    monkeypatch.setattr(agentic, "MAX_TRIES", 1)
    with pytest.raises(RuntimeError, match="only 0 of 1 tool_arith problems passed verification"):
        agentic_dataset("agent", 1, seed=0, split="train", difficulties=(1,), replay_episodes=False)


@needs_sandbox
def test_a_problem_seen_before_is_not_used_twice(monkeypatch):
    """Dedupe by problem signature: a generator that keeps giving the same task yields one problem only."""
    same = generate("tool_arith", 0, 1, "train")
    monkeypatch.setattr(agentic, "generate", lambda *args: same)
    monkeypatch.setattr(agentic, "MAX_TRIES", 2)
    with pytest.raises(RuntimeError, match="only 1 of 2 tool_arith problems"):
        agentic_dataset("agent", 2, seed=0, split="train", replay_episodes=False)


@needs_sandbox
@pytest.mark.parametrize("difficulty", [1, 3])
def test_multi_hop_family_rewards_only_the_owners_value(difficulty):
    """A3: the reference scores 1; a decoy's value (a rival owner's key, really in the store) and no-op score 0."""
    from openk3.agent import Sandbox
    from openk3.agent.tasks import run_calls

    split = {1: "train", 3: "heldout"}[difficulty]
    task = generate("multi_hop", 5, difficulty, split)
    assert task.template in (("incident",) if split == "heldout" else ("supplier", "door"))
    assert generate("multi_hop", 5, difficulty, split).content_hash() == task.content_hash()
    owner = task.instruction.split(" of ", 1)[1].split(".", 1)[0]
    chain = [c.args["path"] for c in task.solution if c.name == "ReadFile"]
    assert len(chain) == difficulty and all(task.files[p].count(f"For {owner}:") == 1 for p in chain)
    notes = "".join(v for k, v in task.files.items() if k.startswith("notes/"))
    decoys = sorted(set(re.findall(r"key `([^`]+)`", notes)) - {task.solution[-2].args["key"]})
    assert len(decoys) == 2
    with Sandbox(files=task.files, env=task.env) as sb:
        assert task.score(sb, None) == 0.0
        for key in decoys:
            value = json.loads(sb.tool("KVGet", {"key": key})["output"].split(" = ")[1].split(" (")[0])
            assert task.score(sb, str(value)) == 0.0
        assert task.score(sb, run_calls(sb, FAMILIES["multi_hop"].wrong(task))) == 0.0
        assert task.score(sb, run_calls(sb, task.solution)) == 1.0


@needs_sandbox
@pytest.mark.parametrize("difficulty", [1, 3])
def test_implement_spec_family_grades_the_spec_not_the_visible_tests(difficulty):
    """C1: the reference scores 1; a body without the final step, the stub and a body that only passes the
    visible cases score 0."""
    from openk3.agent import Sandbox
    from openk3.agent.tasks import run_calls

    split = {1: "test", 3: "heldout"}[difficulty]
    task = generate("implement_spec", 7, difficulty, split)
    assert task.template in FAMILIES["implement_spec"].heldout_templates if split == "heldout" else \
        task.template in FAMILIES["implement_spec"].templates
    module = task.solution[0].args["path"]
    assert task.files[module].count(", then ") == difficulty - 1 and "raise NotImplementedError" in task.files[module]
    # a lookup table of the visible cases: passes the visible tests, not the hidden ones
    visible = re.findall(r"assertEqual\(\w+\((.*)\), (.*)\)$", task.files[f"tests/test_{module}"], re.M)
    table = "{" + ", ".join(f"repr({a}): {v}" for a, v in visible) + "}"
    name = re.search(r"Implement `(\w+)`", task.instruction)[1]
    cheat = Call("WriteFile", {"path": module, "content": f"def {name}(xs):\n    return {table}.get(repr(xs))\n"})
    tests = "python3 -m unittest discover -s tests -t . 2>&1 | tail -n 1"
    with Sandbox(files=task.files, env=task.env) as sb:
        assert task.score(sb, None) == 0.0
        run_calls(sb, [cheat])
        assert sb.run(tests).stdout.strip() == "OK"
        assert task.score(sb, "done") == 0.0
    with Sandbox(files=task.files, env=task.env) as sb:
        assert task.score(sb, run_calls(sb, FAMILIES["implement_spec"].wrong(task))) == 0.0
        assert sb.run(tests).stdout.strip().startswith("FAILED")
    with Sandbox(files=task.files, env=task.env) as sb:
        assert task.score(sb, run_calls(sb, task.solution)) == 1.0


def test_recovery_share_is_the_rate_at_any_length():
    for rate in (0.0, 0.15, 0.5, 1.0):
        for offset in (0.0, 0.3, 0.99):
            slots = agentic._recovery_slots(rate, offset)
            flags = [next(slots) for _ in range(200)]
            for n in (7, 20, 200):
                assert abs(sum(flags[:n]) - rate * n) <= 1


def test_bad_arguments_are_value_errors_naming_the_field():
    for kwargs, field in (({"domain": "general"}, "domain"), ({"n_per_cell": -1}, "n_per_cell"),
                          ({"seed": 1.5}, "seed"), ({"split": "dev"}, "split"),
                          ({"difficulties": (4,)}, "difficulties"), ({"recovery_rate": 2.0}, "recovery_rate")):
        args = {"domain": "agent", "n_per_cell": 1, "seed": 0, "split": "train", **kwargs}
        with pytest.raises(ValueError, match=field):
            agentic_dataset(args.pop("domain"), args.pop("n_per_cell"), args.pop("seed"), args.pop("split"), **args)


def test_implement_spec_draws_again_when_the_final_step_changes_nothing():
    """A seed whose first draw had no input telling the final step apart raised an AssertionError in eval."""
    from openk3.agent.tasks import generate

    task = generate("implement_spec", 1445126694, 3, "test")
    assert task.solution and "cases.json" in task.grader_files
