"""Post-training records, effort budgets and the `general` domain (issue 18 items 1 and 9)."""

from __future__ import annotations

import copy
import json
import os
import re

import pytest

from openk3.chat import END_OF_MSG, THINKING_EFFORTS, encode_segments, marker_ids_of, parse_tokens, render
from openk3.posttrain.domains import budget as B
from openk3.posttrain.domains.general import FAMILIES, KNOWN_WORDS, generate, score, sft_dataset, split_of, to_records
from openk3.posttrain.domains.records import (
    byte_tokenizer,
    fill_budgets,
    read_jsonl,
    reference_problems,
    render_record,
    render_sha256,
    roundtrip_problems,
    think_tokens,
    validate_record,
    write_jsonl,
)

TOK = byte_tokenizer()  # one token per UTF-8 byte, K3's specials after them


def agent_record(**over) -> dict:
    """A two-turn tool-using trajectory in the shared format (non-ASCII on purpose: bytes split characters)."""
    call = {"id": "c1", "type": "function", "function": {"name": "kv_get", "arguments": '{"key": "order:17"}'}}
    record = {
        "id": "agent/test/1", "domain": "agent", "effort": "high", "family": "lookup", "difficulty": 2, "seed": 7,
        "split": "train", "budget_think_tokens": 64, "stats": {}, "verifier": {"reward": 1.0},
        "tools": [{"type": "function", "function": {"name": "kv_get", "parameters": {"type": "object"}}}],
        "messages": [
            {"role": "system", "content": "SYSTEM-TEXT"},
            {"role": "user", "content": "USER-TEXT: store 3 × the price"},
            {"role": "assistant", "reasoning_content": "need the quantity é", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "TOOL-TEXT qty=3"},
            {"role": "assistant", "reasoning_content": "3 x 1.25 = 3.75", "content": "Stored 3.75."},
        ],
    }
    record.update(over)
    return record


def general_records(n_per_family: int = 2, split: str = "train") -> list[dict]:
    return [r for family in FAMILIES for seed in range(n_per_family)
            for r in to_records(generate(family, seed, split))]


def masked_runs(ids: list[int], mask: list[bool]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


# ---------------------------------------------------------------------------------------------- records


@pytest.mark.parametrize("field, value, says", [
    ("domain", "math", "domain"), ("effort", "medium", "effort"), ("split", "dev", "split"),
    ("difficulty", -1, "difficulty"), ("seed", "7", "seed"), ("budget_think_tokens", True, "budget_think_tokens"),
    ("tools", {"a": 1}, "tools"), ("stats", [], "stats"), ("messages", [], "messages"),
    ("messages", [{"role": "user", "content": "q"}], "no assistant"),
    ("messages", [{"role": "robot", "content": "q"}], "messages[0].role"),
    ("messages", [{"role": "assistant", "content": 3}], "messages[0].content"),
    ("messages", [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ("messages", [{"role": "assistant", "content": "a"}, {"role": "tool", "tool_call_id": "zz", "content": "r"}],
     "messages[1].tool_call_id"),
])
def test_validate_record_names_the_bad_field(field, value, says):
    validate_record(agent_record())
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        validate_record(agent_record(**{field: value}))
    assert "agent/test/1" in str(e.value)
    broken = agent_record()
    del broken["verifier"]
    with pytest.raises(ValueError, match="missing: verifier"):
        validate_record(broken)


def test_jsonl_round_trip_is_atomic_and_errors_name_file_and_line(tmp_path):
    path = tmp_path / "sft.jsonl"
    records = [agent_record(), *general_records(1)]
    assert write_jsonl(path, records) == len(records)
    assert read_jsonl(path) == records
    before = path.read_bytes()
    with pytest.raises(ValueError, match="effort"):  # an invalid record: the old file stays whole
        write_jsonl(path, [agent_record(), agent_record(effort="turbo")])
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["sft.jsonl"]
    path.write_text(before.decode() + "\n" + json.dumps(agent_record(split="dev")) + "\n")
    with pytest.raises(ValueError, match=rf"sft.jsonl:{len(records) + 2}: .*split"):
        read_jsonl(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="sft.jsonl:1: not valid JSON"):
        read_jsonl(path)


@pytest.mark.parametrize("record", [agent_record(), *general_records(1)], ids=lambda r: r["id"])
def test_loss_mask_covers_exactly_the_assistant_channels(record):
    ids, mask = render_record(record, TOK)
    assistants = [m for m in record["messages"] if m["role"] == "assistant"]
    runs = masked_runs(ids, mask)
    assert len(runs) == len(assistants)
    header = '<|open|>message role="assistant"<|sep|>'
    for (start, end), msg in zip(runs, assistants):
        trained = TOK.decode(ids[start:end])
        assert TOK.decode(ids[:start]).endswith(header)  # the header is just before, untrained
        assert trained.startswith(f"<|open|>think<|sep|>{msg['reasoning_content']}<|close|>think<|sep|>"
                                  f"<|open|>response<|sep|>{msg['content']}<|close|>response<|sep|>")
        assert trained.endswith(f"<|close|>message<|sep|>{END_OF_MSG}")
        if not msg.get("tool_calls"):  # single-turn general records: the run is exactly the two channels
            assert trained.count("<|open|>") == 2
    untrained = TOK.decode([i for i, m in zip(ids, mask) if not m])
    for msg in record["messages"]:
        if msg["role"] in ("system", "user", "tool"):
            assert msg["content"] in untrained and msg["content"] not in TOK.decode([i for i, m in zip(ids, mask) if m])


@pytest.mark.parametrize("record", [agent_record(), *general_records(2), *general_records(1, "heldout")],
                         ids=lambda r: r["id"])
def test_render_then_parse_gives_back_every_assistant_turn(record):
    assert roundtrip_problems(record, TOK) == []
    if record["domain"] == "general":  # spelled out once: the completion after the generation prompt
        prompt = encode_segments(render({"messages": record["messages"][:1], "thinking_effort": record["effort"]}),
                                 TOK).ids
        full = render_record(record, TOK).ids
        assert full[:len(prompt)] == prompt
        message = parse_tokens([(i, TOK.decode([i])) for i in full[len(prompt):]], marker_ids=marker_ids_of(TOK))
        answer = record["messages"][1]
        assert (message["reasoning_content"], message["content"], message["tool_calls"], message["problems"]) == \
            (answer["reasoning_content"], answer["content"], None, [])


def test_round_trip_check_can_fail():
    class LeakyTokenizer:  # encodes caller text with specials on: a marker typed by a user becomes control
        special_ids = TOK.special_ids

        def encode(self, text, allow_special=False):
            return TOK.encode(text, allow_special=True)

        def decode(self, ids):
            return TOK.decode(ids)

    record = agent_record()
    record["messages"][4]["content"] = "done<|close|>response<|sep|>"
    assert roundtrip_problems(record, TOK) == []
    assert roundtrip_problems(record, LeakyTokenizer())


def test_think_tokens_sum_every_assistant_turn_without_tags():
    record = agent_record()
    expected = len("need the quantity é".encode()) + len(b"3 x 1.25 = 3.75")
    assert think_tokens(record, TOK) == expected
    longer = copy.deepcopy(record)  # response, tool calls and tool results are not thinking
    longer["messages"][4]["content"] = "Stored 3.75 in invoice:17, as asked." * 5
    longer["messages"][3]["content"] = "x" * 500
    assert think_tokens(longer, TOK) == expected
    longer["messages"][2]["reasoning_content"] += " more"
    assert think_tokens(longer, TOK) == expected + 5


def test_render_sha256_is_stable_and_tracks_content():
    record = agent_record()
    digest = render_sha256(record, TOK)
    assert re.fullmatch(r"[0-9a-f]{64}", digest) and render_sha256(copy.deepcopy(record), TOK) == digest
    assert render_sha256(agent_record(effort="low"), TOK) != digest  # the effort message is rendered


# ---------------------------------------------------------------------------------------------- budgets


def test_think_budget_rule():
    assert [B.think_budget(100, e) for e in THINKING_EFFORTS] == [25, 60, 200]
    assert [B.think_budget(10, e) for e in THINKING_EFFORTS] == [16, 16, 20]  # the floor
    assert B.think_budget(5, "high", b_floor=0) == 3  # 0.6 * 5 is 3.0000000000000004 in floats: still 3
    assert B.think_budget(41, "low", b_floor=0) == 11  # ceil(10.25)
    assert B.think_budget(1000, "max", cap=512) == 512
    assert B.BudgetConfig(b_floor=8).budget(10, "low") == 8
    with pytest.raises(ValueError, match="medium"):
        B.think_budget(10, "medium")
    with pytest.raises(ValueError, match="reference think tokens"):
        B.think_budget(-1, "max")
    with pytest.raises(ValueError, match="kappa"):
        B.BudgetConfig(kappa={"low": 0.25, "high": 0.6})
    with pytest.raises(ValueError, match="cap"):
        B.BudgetConfig(cap=4)


def test_budget_reward_and_stop_rule():
    assert B.budget_reward(1.0, 60, 60) == 1.0 and B.budget_reward(0.0, 60, 60) == 0.0
    assert B.budget_reward(0.5, 0, 60) == 0.5
    assert B.budget_reward(1.0, 61, 60) == -1.0 and B.budget_reward(0.0, 61, 60) == -1.0
    assert B.budget_reward(1.0, 61, 60, over_budget_reward=-0.5) == -0.5
    assert B.BudgetConfig(over_budget_reward=0.0).reward(1.0, 99, 60) == 0.0
    assert not B.should_stop(60, 60) and B.should_stop(61, 60)  # sampling stops at B + 1, not before
    stops = next(t for t in range(1000) if B.should_stop(t, 37))
    assert stops == 38


def test_budget_counts_thinking_across_turns():
    record = agent_record()
    per_turn = [len(m["reasoning_content"].encode()) for m in record["messages"] if m["role"] == "assistant"]
    budget = max(per_turn) + 1  # every turn alone fits; the trajectory does not
    assert sum(per_turn) > budget
    assert B.budget_reward(1.0, think_tokens(record, TOK), budget) == -1.0
    assert B.budget_reward(1.0, think_tokens(record, TOK), sum(per_turn)) == 1.0


def test_annealed_budget_schedule():
    schedule = [B.annealed_budget(s, 10, 200, 61) for s in range(12)]
    assert schedule[0] == 200 and schedule[5:] == [61] * 7  # reaches B_to at half the run, then stays
    assert schedule[1] == 173 and schedule[4] == 89  # 200 - 139 * s / 5 = 172.2, 88.8: rounded up
    assert all(a >= b for a, b in zip(schedule, schedule[1:]))
    assert B.annealed_budget(3, 10, 200, 61, fraction=1.0) == 159
    assert B.annealed_budget(2, 4, 20, 100) == 100 and B.annealed_budget(1, 4, 20, 100) == 60  # upwards too
    assert B.annealed_budget(0, 1, 50, 20) == 50 and B.annealed_budget(1, 1, 50, 20) == 20
    with pytest.raises(ValueError, match="fraction"):
        B.annealed_budget(0, 10, 200, 60, fraction=0)
    with pytest.raises(ValueError, match="total_steps"):
        B.annealed_budget(0, 0, 200, 60)


# ---------------------------------------------------------------------------------------------- general


MUTATIONS = {  # template -> mutate(answer) -> the reward must drop below 1 (0 where the hack check fires)
    "words": [lambda a: "\n".join(a.split("\n")[:-1]), lambda a: a.replace(a.split("\n")[0], "zzzz"),
              lambda a: "\n".join([a.split("\n")[0]] * len(a.split("\n"))), lambda a: "Here are the words."],
    "json": [lambda a: a[:-1], lambda a: a.replace("}", ', "extra": 1}'),
             lambda a: json.dumps({k: v + 1 for k, v in json.loads(a).items()}),
             lambda a: json.dumps({k: True for k in json.loads(a)})],
    "sentences": [lambda a: a.rsplit(" ", 3)[0], lambda a: a.replace(" ", ", ", 1),
                  lambda a: "Here are the sentences. " + a, lambda a: a.split(". ")[0] + "."],
}
ZEROED = {"words": [1], "json": [0], "sentences": [2]}  # indices of MUTATIONS that must score exactly 0


def test_references_score_one_and_mutations_do_not():
    seen = set()
    for family in FAMILIES:
        for split in ("train", "heldout"):
            for seed in range(12):
                p = generate(family, seed, split)
                seen.add(p.template)
                assert score(p.verifier, p.answer) == 1.0
                assert score(p.verifier, {"role": "assistant", "content": f"  {p.answer}\n"}) == 1.0
                assert score(p.verifier, "") == 0.0 and score(p.verifier, None) == 0.0
                if p.verifier["kind"] == "exact":
                    for bad in (p.answer + "0", "The answer is " + p.answer, p.answer.replace(" ", ", ")
                                if " " in p.answer else p.answer + ".", "1" + p.answer):
                        assert score(p.verifier, bad) == 0.0, (p.prompt, bad)
                    continue
                for k, mutate in enumerate(MUTATIONS[p.template]):
                    got = score(p.verifier, mutate(p.answer))
                    assert got < 1.0 and (got == 0.0 or k not in ZEROED[p.template]), (p.prompt, k, got)
    assert seen == {t for _, templates in FAMILIES.values() for t in templates}


def test_hack_checks():
    words = next(p for s in range(50) if (p := generate("instruct", s, "train")).template == "words")
    letter = words.verifier["rules"][1]["letter"]
    n = words.verifier["rules"][0]["n"]
    fake = "\n".join(letter * (k + 1) for k in range(n))  # n distinct lines starting with the letter
    assert all(r for r in fake.split("\n")) and not set(fake.split("\n")) & KNOWN_WORDS
    assert score(words.verifier, fake) == 0.0
    claim = generate("instruct", 0, "heldout")
    topic = claim.verifier["rules"][1]["word"]
    assert score(claim.verifier, f"I wrote about {topic} as requested.") == 0.0


def test_arithmetic_in_every_trace_is_right():
    expr = r"-?\d+(?:\s*[-+*%]\s*\d+)*"
    equation = re.compile(rf"{expr}(?:\s*=\s*{expr})+")
    checked = 0
    for family in ("arith", "word", "puzzle", "instruct"):
        for split in ("train", "test", "heldout"):
            for seed in range(25):
                p = generate(family, seed, split)
                for think in p.traces.values():
                    for line in think.split("\n"):
                        for m in equation.finditer(line):
                            sides = [side.strip() for side in m.group().split("=")]
                            if not any(op in side[1:] for side in sides for op in "+-*%"):
                                continue  # "step 1 = 5675": a label, not arithmetic
                            values = {eval(side) for side in sides if side}  # digits and + - * % only
                            assert len(values) == 1, (p.prompt, line)
                            checked += 1
                if family in ("arith", "word"):
                    assert p.traces["low"].rsplit("=", 1)[1] == p.answer
                    assert p.traces["max"].count("check") >= p.traces["high"].count("\n") + 1
    assert checked > 3000


def test_generation_is_deterministic_per_seed():
    for family in FAMILIES:
        assert generate(family, 11, "train") == generate(family, 11, "train")
        assert generate(family, 11, "train", level=3) == generate(family, 11, "train", level=3)
        assert len({generate(family, s, "train").prompt for s in range(10)}) > 5
    a, b = sft_dataset(4, seed=3, split="test"), sft_dataset(4, seed=3, split="test", tokenizer=TOK)
    assert a == b and [r["render_sha256"] for r in a] == [r["render_sha256"] for r in b]
    assert [r["id"] for r in sft_dataset(4, seed=4, split="test")] != [r["id"] for r in a]


def test_splits_are_disjoint_and_heldout_templates_are_held_out():
    for family, (_, templates) in FAMILIES.items():
        prompts = {split: {generate(family, s, split).prompt for s in range(60)} for split in ("train", "test")}
        assert prompts["train"] and prompts["test"] and not prompts["train"] & prompts["test"]
        assert all(split_of(p) == split for split, ps in prompts.items() for p in ps)
        ordinary = {generate(family, s, split).template for s in range(60) for split in ("train", "test")}
        held = {generate(family, s, "heldout").template for s in range(20)}
        assert held == {templates[-1]} and ordinary == set(templates[:-1])
    with pytest.raises(ValueError, match="general split"):
        generate("arith", 0, "dev")
    with pytest.raises(ValueError, match="general family"):
        generate("poetry", 0)
    with pytest.raises(ValueError, match="general level"):
        generate("arith", 0, level=9)


def test_sft_dataset_traces_fit_budgets_and_order_low_high_max():
    records = sft_dataset(12, seed=0, split="train")
    assert len(records) == 36 and {r["effort"]: 0 for r in records}.keys() == set(THINKING_EFFORTS)
    assert [sum(r["effort"] == e for r in records) for e in THINKING_EFFORTS] == [12, 12, 12]
    assert {r["family"] for r in records} == set(FAMILIES)
    for k in range(0, len(records), 3):
        low, high, top = records[k:k + 3]
        assert [r["effort"] for r in (low, high, top)] == list(THINKING_EFFORTS)
        assert low["messages"][0] == high["messages"][0] == top["messages"][0]  # one problem, three traces
        assert low["stats"]["think_tokens"] < high["stats"]["think_tokens"] < top["stats"]["think_tokens"]
        reference = top["stats"]["think_tokens"]
        for r in (low, high, top):
            validate_record(r)
            assert r["verifier"]["reward"] == 1.0 and r["stats"]["reference_think_tokens"] == reference
            assert r["budget_think_tokens"] == B.think_budget(reference, r["effort"])
            assert r["stats"]["think_tokens"] == think_tokens(r, TOK) <= r["budget_think_tokens"]
            assert r["render_sha256"] == render_sha256(r, TOK)
    assert sft_dataset(0, seed=0, split="train") == []
    with pytest.raises(ValueError, match="n_per_cell"):
        sft_dataset(-1, seed=0, split="train")


def test_sft_dataset_options():
    small = sft_dataset(8, seed=0, split="test", levels=(1,), families=["arith", "puzzle"])
    assert {r["level"] for r in small} == {1} and {r["family"] for r in small} == {"arith", "puzzle"}
    big = sft_dataset(8, seed=0, split="test", levels=(3,), families=["arith", "puzzle"])
    assert {r["level"] for r in big} == {3}
    assert sum(r["stats"]["think_tokens"] for r in small) < sum(r["stats"]["think_tokens"] for r in big)
    floor = sft_dataset(4, seed=0, split="test", budget=B.BudgetConfig(b_floor=400))
    assert all(r["budget_think_tokens"] >= 400 for r in floor)


def test_sft_dataset_says_when_a_split_runs_out(monkeypatch):
    import openk3.posttrain.domains.general as G

    def tiny(rng, level, template):  # three distinct prompts in all
        return {"prompt": f"What is {rng.randint(1, 3)} + 1?", "answer": "x", "difficulty": 1,
                "think": {"low": "a", "high": "ab", "max": "abc" * 10}}

    monkeypatch.setitem(G.FAMILIES, "arith", (tiny, ("pair", "nested")))
    assert len(G.sft_dataset(3, seed=0, split="heldout", families=["arith"])) == 9
    with pytest.raises(ValueError, match="only 3 of 4 fit, distinct heldout problems"):
        G.sft_dataset(4, seed=0, split="heldout", families=["arith"])


def test_reference_checks_reject_unfit_problems():
    records = to_records(generate("arith", 5, "train"))
    assert reference_problems(records, TOK) == []
    over = copy.deepcopy(records)  # a low trace padded past its budget
    over[0]["messages"][1]["reasoning_content"] += " and so on" * 30
    assert any("> budget" in p for p in reference_problems(fill_budgets(over, TOK), TOK))
    swapped = copy.deepcopy(records)  # high thinks as much as max: not strictly ordered
    swapped[1]["messages"][1]["reasoning_content"] = swapped[2]["messages"][1]["reasoning_content"]
    assert any("strictly" in p for p in reference_problems(fill_budgets(swapped, TOK), TOK))
    wrong = copy.deepcopy(records)
    wrong[2]["verifier"]["reward"] = 0.0
    assert any("verifier reward" in p for p in reference_problems(wrong, TOK))
    with pytest.raises(ValueError, match="one record per effort"):
        fill_budgets(records[:2], TOK)
