"""`openk3 rl` (issue 18 item 3): rollouts through the engine, the think budget, the RL step and the run.

What RL relies on: a rollout record's ids are prompt + generated + env ids with gen_mask 1 exactly on the
sampled ones, and its behaviour log-probs equal a float32 trainer forward of the same ids; the budget stops
generation at B + 1 think tokens with reward -1; after an optimizer step the engine samples from the new
weights; a tiny run learns; a killed run resumes to the uninterrupted run's numbers; the command runs end to
end. One thread; a 4-layer cut of nano (1 MLA + 3 KDA layers) with the byte tokenizer (256 bytes + 256
specials). Scripted turns (`ScriptedEngine`) where the exact ids matter more than a model's choice.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math

import pytest
import torch
from helpers import Killed, ScriptedEngine, assistant_ids, nano_cut, torn_write_at

import openk3
from openk3.chat import CLOSE, END_OF_MSG, OPEN, SEP, encode_segments, render
from openk3.checkpoint import runs
from openk3.infer.engine import Engine
from openk3.posttrain.domains.budget import annealed_budget, think_budget
from openk3.posttrain.domains.records import byte_tokenizer, think_tokens
from openk3.posttrain.trainers import problems as rl_problems
from openk3.posttrain.trainers.rl import RLConfig, make_batch, rl, rl_step, token_logprobs
from openk3.posttrain.trainers.rollout import Problem, RolloutConfig, rollout
from openk3.train.metrics import read_metrics
from openk3.train.optim import OptimConfig, build_optimizer

TOK = byte_tokenizer()
CLOSE_ID, OPEN_ID, SEP_ID, EOM_ID = (TOK.special_ids[m] for m in (CLOSE, OPEN, SEP, END_OF_MSG))
THINK_OPEN = [OPEN_ID, *TOK.encode("think"), SEP_ID]


def tiny_model(seed: int = 0) -> openk3.K3ForCausalLM:
    cfg = nano_cut()
    return openk3.K3ForCausalLM.build(cfg, seed=seed).eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny model saved with the byte tokenizer, as `openk3 rl --model` reads it."""
    path = tmp_path_factory.mktemp("rl") / "base"
    openk3.save(tiny_model(), path, dtype=torch.float32)
    TOK.save(str(path))
    return path


def short_prompt(text: str = "q") -> list[int]:
    """A short prompt ending in the think channel's opening, as every thinking generation prompt does."""
    return TOK.encode(text) + THINK_OPEN


def chat_prompt(content: str = "What is 2+3?", effort: str = "low") -> list[int]:
    request = {"messages": [{"role": "user", "content": content}], "tools": [], "thinking_effort": effort,
               "add_generation_prompt": True}
    return encode_segments(render(request), TOK).ids


def generated(record: dict) -> list[int]:
    return [t for t, m in zip(record["token_ids"], record["gen_mask"], strict=True) if m]


# ---- a scripted stand-in for the engine ---------------------------------------------------------------


# ---- rollout records ----------------------------------------------------------------------------------


def test_rollout_records_match_a_fp32_trainer_forward():
    model = tiny_model()
    engine = Engine(model, None, max_num_seqs=8)
    prompts = [chat_prompt("2+2?"), short_prompt("hello")]
    problems = [Problem(f"p{i}", ids, budget=40, score=lambda turn: 0.5) for i, ids in enumerate(prompts)]
    records = rollout(engine, problems, TOK, RolloutConfig(group_size=3, response_cap=6, seed=1))
    assert [r["id"] for r in records] == ["p0#0", "p0#1", "p0#2", "p1#0", "p1#1", "p1#2"]
    for r, prompt in zip(records, [prompts[0]] * 3 + [prompts[1]] * 3, strict=True):
        n = len(r["token_ids"]) - len(prompt)
        assert r["token_ids"][:len(prompt)] == prompt and r["prompt_len"] == len(prompt) and n > 0
        assert r["gen_mask"] == [0] * len(prompt) + [1] * n
        assert len(r["behaviour_logprobs"]) == n
        gen = generated(r)
        think = gen.index(CLOSE_ID) if CLOSE_ID in gen else len([t for t in gen if t not in TOK.stop_ids])
        assert r["think_tokens"] == min(think, 41)  # counted up to the first <|close|>, stopped at B + 1
        assert r["stopped_reason"] in ("eos", "budget", "response_cap", "context")
        expected = {"budget": -1.0, "eos": 0.5}.get(r["stopped_reason"], 0.0)
        assert r["reward"] == expected and r["reward_components"]["task"] == (0.5 if expected == 0.5 else 0.0)
    # the same samples in different groups differ (each sample has its own seed)
    assert len({tuple(generated(r)) for r in records[:3]}) == 3
    batch = make_batch(records)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch["ids_BT"])
    mask = batch["mask_BT"]
    assert int(mask.sum()) == sum(len(r["behaviour_logprobs"]) for r in records)
    torch.testing.assert_close(logp[mask], batch["behaviour_BT"][mask], atol=2e-4, rtol=0)


def test_rollout_at_another_temperature_records_the_tempered_logprobs():
    model = tiny_model()
    engine = Engine(model, None, max_num_seqs=4)
    problems = [Problem("p", short_prompt(), budget=8, score=lambda turn: 1.0)]
    records = rollout(engine, problems, TOK, RolloutConfig(group_size=2, temperature=0.7, response_cap=4))
    batch = make_batch(records)
    with torch.no_grad():
        tempered, _ = token_logprobs(model, batch["ids_BT"], temperature=0.7)
        raw, _ = token_logprobs(model, batch["ids_BT"])
    mask = batch["mask_BT"]
    torch.testing.assert_close(tempered[mask], batch["behaviour_BT"][mask], atol=2e-4, rtol=0)
    assert (raw[mask] - batch["behaviour_BT"][mask]).abs().max() > 1e-2  # not the raw ones
    # below the engine's greedy threshold there is no tempered behaviour policy to record; eval (no log-probs)
    # may use such a temperature to get the argmax
    for bad in (0.0, -1.0, 5e-6):
        with pytest.raises(ValueError, match="rollout temperature must be"):
            RolloutConfig(temperature=bad)
    assert RolloutConfig(temperature=5e-6, logprobs=False).temperature == 5e-6


def test_budget_stop_fires_at_b_plus_1_with_reward_minus_1():
    engine = Engine(tiny_model(), None, max_num_seqs=8)
    problems = [Problem("p", short_prompt(), budget=3, score=lambda turn: 1.0)]
    records = rollout(engine, problems, TOK, RolloutConfig(group_size=6, response_cap=50, seed=5))
    stopped = [r for r in records if r["stopped_reason"] == "budget"]
    assert len(stopped) >= 5  # a random model rarely closes its think channel within 3 tokens
    for r in stopped:
        assert generated(r) and len(generated(r)) == 4 and r["think_tokens"] == 4  # B + 1, then nothing
        assert r["reward"] == -1.0 and r["reward_components"]["budget"] == -1.0
    assert not engine.has_unfinished()  # the aborted requests are gone


def test_think_count_across_the_close_marker_and_the_response_cap():
    """Scripted turns: the online count equals records.think_tokens of the same message; the response cap
    is a format failure (reward 0) even when the think channel was within budget."""
    message = {"role": "assistant", "reasoning_content": "four", "content": "42"}
    turn = assistant_ids(TOK, [{"role": "user", "content": "q"}], message, "low")
    prompt = chat_prompt("q")
    engine = ScriptedEngine(lambda ids, rid: turn if rid.startswith("ok") else turn[:-1] + list(b"x" * 60))
    problems = [Problem("ok", prompt, budget=4, score=lambda t: float(t["message"]["content"] == "42")),
                Problem("over", prompt, budget=3, score=lambda t: 1.0),
                Problem("cap", prompt, budget=4, score=lambda t: 1.0)]
    # the byte tokenizer spells the tags after the think channel in ~35 ids: a cap of 45 fits the answer
    ok, over, cap = rollout(engine, problems, TOK, RolloutConfig(group_size=1, response_cap=45))
    assert len(turn) - 4 - 1 < 45
    record = {"messages": [{"role": "user", "content": "q"}, message], "tools": [], "effort": "low"}
    assert ok["think_tokens"] == think_tokens(record, TOK) == 4
    assert ok["stopped_reason"] == "eos" and ok["reward"] == 1.0 and generated(ok) == turn
    assert over["stopped_reason"] == "budget" and over["think_tokens"] == 4 and generated(over) == turn[:4]
    assert over["reward"] == -1.0 and "over#0/t0" in engine.aborted
    assert cap["stopped_reason"] == "response_cap" and cap["reward"] == 0.0
    assert cap["reward_components"]["format"] == 0.0 and cap["think_tokens"] == 4


# ---- multi-turn: agent episodes in the sandbox ------------------------------------------------------


def test_multi_turn_rollout_masks_env_tokens_and_forks_per_sample():
    from openk3.agent import SandboxEnv, unavailable_reason
    from openk3.agent.tasks import Task

    why = unavailable_reason()  # probed here, not at collection: it starts a throw-away sandbox
    if why is not None:
        pytest.skip(f"no sandbox on this host: {why}")

    grade = ("import json, os\nanswer = json.loads(os.environ['OPENK3_ANSWER'])\n"
             "print(json.dumps({'nonce': os.environ['OPENK3_NONCE'], 'reward': float(answer == 'seven'),"
             " 'answer': answer}))\n")
    task = Task(family="note", seed=0, difficulty=1, split="train", template="t", instruction="Read note.txt.",
                files={"note.txt": "seven\n"}, grader_files={"grade.py": grade}, tools=["ReadFile", "Submit"])
    env = SandboxEnv(task, TOK, effort="low", max_steps=4)
    obs = env.reset()
    call = {"id": "call_1", "type": "function", "function": {"name": "ReadFile",
                                                             "arguments": json.dumps({"path": "note.txt"})}}
    first = {"role": "assistant", "reasoning_content": "read it", "content": "", "tool_calls": [call]}

    def script(ids, rid):
        if rid.endswith("/t0"):
            return assistant_ids(TOK, obs.messages, first, "low", obs.tools)
        answer = "seven" if rid.startswith("p#0") else "six"  # sample 1 submits a wrong answer
        submit = {"id": "call_2", "type": "function",
                  "function": {"name": "Submit", "arguments": json.dumps({"answer": answer})}}
        msgs = [*obs.messages, first, {"role": "tool", "tool_call_id": "call_1", "content": "seven\n"}]
        return assistant_ids(TOK, msgs, {"role": "assistant", "reasoning_content": "ok", "content": "",
                                         "tool_calls": [submit]}, "low", obs.tools)

    try:
        before = env.ids
        records = rollout(ScriptedEngine(script), [Problem("p", obs.prompt_ids, budget=40, env=env)], TOK,
                          RolloutConfig(group_size=2))
        assert env.ids == before  # the samples ran in forks
    finally:
        env.close()
    assert [r["reward"] for r in records] == [1.0, 0.0]
    for r in records:
        assert r["turns"] == 2 and r["stopped_reason"] == "submit"
        # ids = a from-scratch render of the conversation; 1s exactly on the two scripted turns
        full = encode_segments(render({"messages": r["messages"], "tools": obs.tools, "thinking_effort": "low",
                                       "add_generation_prompt": False}), TOK).ids
        assert r["token_ids"] == full[:len(r["token_ids"])]
        assert r["token_ids"][:r["prompt_len"]] == obs.prompt_ids
        turn_ids = [assistant_ids(TOK, obs.messages, first, "low", obs.tools)]
        runs, k = [], 0
        while k < len(r["gen_mask"]):
            if r["gen_mask"][k]:
                j = k
                while j < len(r["gen_mask"]) and r["gen_mask"][j]:
                    j += 1
                runs.append(r["token_ids"][k:j])
                k = j
            k += 1
        assert len(runs) == 2 and runs[0] == turn_ids[0] and runs[1][-1] == EOM_ID
        assert len(r["behaviour_logprobs"]) == sum(r["gen_mask"])
        # tool output and the next generation prompt sit between the turns, unmasked
        between = r["token_ids"][r["prompt_len"] + len(runs[0]):len(r["token_ids"]) - len(runs[1])]
        assert TOK.decode(between).count("seven") == 1
        rec = {"messages": r["messages"], "tools": obs.tools, "effort": "low"}
        assert r["think_tokens"] == think_tokens(rec, TOK) == len("read it") + len("ok")


# ---- the RL step --------------------------------------------------------------------------------------


def test_after_an_optimizer_step_the_engine_samples_from_the_new_weights():
    model = tiny_model()
    old = copy.deepcopy(model)
    engine = Engine(model, None, max_num_seqs=8)
    cfg = RLConfig(model="x", group_size=8, loss="grpo", lr=1e-2, std="group")
    opt = build_optimizer(model, OptimConfig(lr=cfg.lr, weight_decay=0.0, qk_clip_tau=None))
    problems = [Problem("p", short_prompt(), budget=6, score=lambda t: float(t["ids"][0] % 2))]
    # one-token turns (every id ends one) rewarded by parity: a group whose rewards differ, so a gradient
    one_token = RolloutConfig(group_size=8, seed=3, extra_stop_ids=tuple(range(512)))
    _, metrics = rl_step(cfg, model, opt, engine, problems, TOK, one_token, 0)
    assert metrics["grad_norm"] > 0 and metrics["zero_variance_frac"] == 0 and metrics["skipped"] == 0
    records = rollout(engine, problems, TOK, RolloutConfig(group_size=4, response_cap=3, seed=4))
    batch, mask = make_batch(records), None
    mask = batch["mask_BT"]
    with torch.no_grad():
        new_lp, _ = token_logprobs(model, batch["ids_BT"])
        old_lp, _ = token_logprobs(old, batch["ids_BT"])
    torch.testing.assert_close(batch["behaviour_BT"][mask], new_lp[mask], atol=2e-4, rtol=0)
    assert (batch["behaviour_BT"][mask] - old_lp[mask]).abs().max() > 1e-2


@pytest.mark.parametrize("loss", ["kimi", "grpo"])
def test_a_batch_without_signal_takes_no_step(loss):
    """Every group's rewards equal (here: all 1), so every advantage is zero: no optimizer step, the weights and
    the optimizer state bit-identical, the step logged as skipped with the batch's entropy still measured."""
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = Engine(model, None, max_num_seqs=16)
    cfg = RLConfig(model="x", group_size=8, loss=loss, lr=1e-2)
    opt = build_optimizer(model, OptimConfig(lr=cfg.lr, weight_decay=0.0, qk_clip_tau=None))
    problems = [Problem(f"p{i}", short_prompt(f"q{i}"), budget=6, score=lambda t: 1.0) for i in range(2)]
    roll = RolloutConfig(group_size=8, seed=3, extra_stop_ids=tuple(range(512)))
    _, metrics = rl_step(cfg, model, opt, engine, problems, TOK, roll, 0)
    assert metrics["skipped"] == 1 and metrics["grad_norm"] == 0 and metrics["zero_variance_frac"] == 1
    assert metrics["entropy"] > 0 and all(not o.state for o in opt.optimizers)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("update_ref", [1.0, 1e3, None])
def test_a_half_strength_signal_moves_the_weights_half_as_far(update_ref):
    """One full-signal step, then the same samples (same seeds) rewarded {0, 1} or {0, 0.5}: K2's loss is linear
    in the advantage, so the second gradient halves. Scaled against the running mean of the gradient norms
    (the default 1.0: both norms are above that floor) or against a floor above both (1e3), every tensor's
    second step is half as long (Muon's matrices and AdamW's vectors alike); with fixed-size steps (None) it is
    as long: the defect the scaling removes."""
    moves = {}
    for strength in (1.0, 0.5):
        model = tiny_model()
        cfg = RLConfig(model="x", group_size=8, loss="kimi", lr=1e-3, update_ref=update_ref)
        opt = build_optimizer(model, OptimConfig(lr=cfg.lr, weight_decay=0.0, qk_clip_tau=None))
        engine = Engine(model, None, max_num_seqs=16)
        for step, scale in ((0, 1.0), (1, strength)):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            problems = [Problem(f"p{i}", short_prompt(f"q{i}"), budget=8,
                                score=lambda t, s=scale: s * float(t["ids"][0] % 2 == 0)) for i in range(2)]
            roll = RolloutConfig(group_size=8, seed=4 + step, extra_stop_ids=tuple(range(512)))
            _, metrics = rl_step(cfg, model, opt, engine, problems, TOK, roll, step)
            assert metrics["skipped"] == 0 and 1.0 < metrics["grad_norm"] < 1e3
        moves[strength] = {n: float((p.detach() - before[n]).norm()) for n, p in model.named_parameters()}
    ratios = [moves[0.5][n] / moves[1.0][n] for n in moves[1.0] if moves[1.0][n] > 0]
    assert len(ratios) > 20
    if update_ref is None:
        assert all(r > 0.95 for r in ratios), sorted(ratios)[:3]
    else:
        assert all(0.4 < r < 0.6 for r in ratios), (min(ratios), max(ratios))


def test_the_step_scale_follows_the_running_mean_and_its_floor():
    """`signal_step`: the first step is measured against the floor, later ones against the running mean of the
    norms before them (never below the floor); the mean is the optimizer's state, so a resumed run keeps it."""
    from openk3.posttrain.trainers.onpolicy import GRAD_NORM_EMA, signal_step

    model = torch.nn.Linear(3, 1, bias=False)
    opt = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.0, qk_clip_tau=None, grad_clip=None))
    seen = []
    for norm in (0.25, 4.0, 2.0, 1e-6):
        model.weight.grad = torch.tensor([[norm, 0.0, 0.0]])
        seen.append(signal_step(opt, 1.0))
    mean = GRAD_NORM_EMA * 0.25 + (1 - GRAD_NORM_EMA) * 4.0  # after the first two
    assert mean < 1.0 and [s for _, s in seen[:3]] == pytest.approx([0.25, 1.0, 1.0])  # the floor, twice
    assert seen[3][1] == pytest.approx(1e-6 / max(1.0, GRAD_NORM_EMA * mean + (1 - GRAD_NORM_EMA) * 2.0))
    saved = opt.state_dict()
    other = build_optimizer(torch.nn.Linear(3, 1, bias=False), OptimConfig(lr=0.1, weight_decay=0.0, qk_clip_tau=None))
    other.load_state_dict(saved)
    assert other.grad_norm_mean == opt.grad_norm_mean is not None


@pytest.mark.parametrize("loss", ["kimi", "grpo"])
def test_a_tiny_policy_learns_to_start_its_answer_with_an_even_byte(loss):
    """Reward 1 when the first sampled token is an even id below 256: about a quarter of a random model's
    mass; one-token episodes (every id ends the turn) keep it fast. Fixed seeds: the last three steps average
    0.85 (kimi). lr 2e-2: the first step's gradient is the largest, so the running mean the later steps are
    scaled against (`signal_step`) keeps them at 0.3-0.5 of a full step."""
    torch.manual_seed(0)
    model = tiny_model()
    engine = Engine(model, None, max_num_seqs=32)
    cfg = RLConfig(model="x", group_size=8, loss=loss, lr=2e-2, tau=0.5)
    opt = build_optimizer(model, OptimConfig(lr=cfg.lr, weight_decay=0.0, qk_clip_tau=None))
    problems = [Problem(f"p{i}", short_prompt(f"q{i}"), budget=8,
                        score=lambda t: float(t["ids"][0] < 256 and t["ids"][0] % 2 == 0)) for i in range(4)]
    rewards = []
    for step in range(10):
        roll = RolloutConfig(group_size=8, seed=step, extra_stop_ids=tuple(range(512)))
        _, metrics = rl_step(cfg, model, opt, engine, problems, TOK, roll, step)
        rewards.append(metrics["reward"])
    assert sum(rewards[:2]) / 2 < 0.45 and sum(rewards[-3:]) / 3 > 0.75, rewards


def test_make_batch_refuses_a_record_whose_logprobs_do_not_match_its_mask():
    record = {"id": "r", "token_ids": [1, 2, 3], "gen_mask": [0, 1, 1], "behaviour_logprobs": [-1.0], "reward": 0}
    with pytest.raises(ValueError, match="'r': 1 behaviour log-probs for 2 generated tokens"):
        make_batch([record])


def test_rl_config_names_bad_settings():
    with pytest.raises(ValueError, match="group_size must be an integer >= 2"):
        RLConfig(group_size=1)
    with pytest.raises(ValueError, match="loss must be one of"):
        RLConfig(loss="ppo")
    with pytest.raises(ValueError, match="budget_from_effort must be one of"):
        RLConfig(budget_from_effort="medium")
    for bad in (0, 3, 2.5, True):
        with pytest.raises(ValueError, match="budget_cap must be an integer >= max"):
            RLConfig(b_floor=4, budget_cap=bad)
    assert RLConfig(b_floor=4, budget_cap=4).budget_cap == 4
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="update_ref must be > 0 or None"):
            RLConfig(update_ref=bad)


def test_budget_annealing_moves_from_the_parent_effort_to_the_cell_budget():
    source = rl_problems.ProblemSource("general", "low", TOK, budget_from="max")
    first = source.draw(0, 2, total_steps=10)
    late = source.draw(5, 2, total_steps=10)
    for p in first:
        L = p.meta["reference_think_tokens"]
        assert p.budget == think_budget(L, "max") > think_budget(L, "low")
    for p in late:  # past anneal_fraction * steps: the cell's own budget
        assert p.budget == think_budget(p.meta["reference_think_tokens"], "low")
    mid = rl_problems.ProblemSource("general", "low", TOK, budget_from="max").draw(2, 2, total_steps=10)
    for p in mid:
        L = p.meta["reference_think_tokens"]
        assert p.budget == annealed_budget(2, 10, think_budget(L, "max"), think_budget(L, "low"))
    plain = rl_problems.ProblemSource("general", "low", TOK).draw(0, 2, total_steps=10)
    assert [p.budget for p in plain] == [think_budget(p.meta["reference_think_tokens"], "low") for p in plain]
    assert [p.prompt_ids for p in plain] == [p.prompt_ids for p in first]  # same problems, step by step


def test_levels_restrict_the_general_problems_drawn():
    """`levels` (RLConfig, MOPDConfig, eval, `--levels`): RL asks the general levels SFT taught, not harder
    ones it never saw (a pipeline whose SFT used levels 1-2 drew 5-digit level-3 sums in RL)."""
    from openk3.posttrain.domains.general import parse_levels
    from openk3.posttrain.trainers.mopd import MOPDConfig

    def levels(source):
        return {p.id.split("/")[-2] for p in source.draw(0, 24, total_steps=1)}

    assert levels(rl_problems.ProblemSource("general", "low", TOK)) == {"l1", "l2", "l3"}
    assert levels(rl_problems.ProblemSource("general", "low", TOK, levels=(1,))) == {"l1"}
    assert levels(rl_problems.ProblemSource("general", "low", TOK, levels=[2, 1])) == {"l1", "l2"}
    assert RLConfig(levels=[2, 1]).levels == (1, 2) and MOPDConfig(levels=(3,)).levels == (3,)
    assert parse_levels("1,2") == (1, 2) and parse_levels(None) is None and parse_levels("all") is None
    for bad in ((), (0,), (1, 1), ("1",), (True,)):
        with pytest.raises(ValueError, match="rl levels must be a non-empty subset of"):
            RLConfig(levels=bad)
    with pytest.raises(ValueError, match="--levels must be a non-empty subset of"):
        parse_levels("1,x")


# ---- the run and the command --------------------------------------------------------------------------


# budget_cap: the general budgets (~100-300 think tokens at high) would make every step sample ~100 tokens per
# trajectory; at 20 the first step's groups still differ in reward (a gradient), so the optimizer state matters
# on resume
RUN = dict(domain="general", effort="high", steps=3, prompts_per_step=2, group_size=2, response_cap=4, b_floor=4,
           budget_cap=20, save_every=1, lr=1e-3, loss="kimi", tau=0.5)
RUN_FLAGS = ["--domain", "general", "--effort", "high", "--steps", "3", "--prompts-per-step", "2", "--group-size", "2",
             "--response-cap", "4", "--b-floor", "4", "--budget-cap", "20", "--save-every", "1", "--lr", "1e-3",
             "--loss", "kimi", "--tau", "0.5", "--threads", "1"]
TIMINGS = ("rollout_s", "train_s")


@pytest.fixture(scope="module")
def command_run(base, tmp_path_factory):
    """`openk3 rl` through its main with RUN's settings, run once: the end-to-end test checks it, and it is the
    uninterrupted run the resume test compares with. Returns (parsed args, out folder, what it printed)."""
    from openk3.commands import rl as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = tmp_path_factory.mktemp("rl-command") / "run"
    args = parser.parse_args(["--model", str(base), "--out", str(out), *RUN_FLAGS])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert command.main(args) == 0
    return args, out, printed.getvalue()


def test_a_killed_run_resumes_to_the_uninterrupted_run(base, command_run, tmp_path, monkeypatch):
    _, whole, _ = command_run
    assert RLConfig.from_dict(json.loads((whole / "rl_config.json").read_text())) == \
        RLConfig(model=str(base.resolve()), **RUN)  # the command's flags are RUN
    seen = []
    with pytest.raises(Killed), torn_write_at(monkeypatch, 2):  # inside step 2's checkpoint: resume redoes step 2
        rl(RLConfig(model=str(base), **RUN), tmp_path / "killed", on_step=lambda step, m: seen.append(step))
    assert seen == [1, 2] and [s for s, _ in runs.list_checkpoints(tmp_path / "killed")] == [1]
    last = rl(RLConfig(model=str(base), **RUN), tmp_path / "killed")
    assert last["step"] == 3

    def strip(rows):
        return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]

    rows = read_metrics(str(whole / "metrics.jsonl"))
    assert strip(read_metrics(str(tmp_path / "killed" / "metrics.jsonl"))) == strip(rows)
    assert [r["step"] for r in rows] == [1, 2, 3] and any(r["grad_norm"] > 0 for r in rows)
    a = openk3.load(whole, dtype=torch.float32).state_dict()
    b = openk3.load(tmp_path / "killed", dtype=torch.float32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # finished: nothing left to do; the starting model may be named differently (the run's checkpoint is read)
    assert rl(RLConfig(model=str(tmp_path / "gone"), **RUN), tmp_path / "killed") == {}
    with pytest.raises(ValueError, match=r"changed settings \(lr: 0.001 -> 0.01\)"):
        rl(RLConfig(model=str(base), **{**RUN, "lr": 1e-2}), tmp_path / "killed")


def test_the_command_runs_end_to_end(base, command_run, capsys):
    from openk3.commands import rl as command

    args, out, printed = command_run
    assert "[rl] done: step 3" in printed
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward", "over_budget_rate", "think_mean", "think_p90", "entropy", "mismatch_kl",
                "zero_variance_frac", "loss"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert all(abs(r["mismatch_kl"]) < 1e-4 for r in rows)  # sampler and trainer share the code
    records = [json.loads(line) for line in (out / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["domain"] == "general" and r["effort"] == "high" for r in records)
    assert all(r["budget_think_tokens"] <= 20 for r in records)  # --budget-cap (high's own budgets are ~100-300)
    trained = openk3.load(out, dtype=torch.float32)
    start = openk3.load(base, dtype=torch.float32)
    moved = [n for n, p in trained.named_parameters() if not torch.equal(p, start.get_parameter(n))]
    assert moved
    for n, b in trained.named_buffers():  # Quantile Balancing's router bias stays frozen during RL
        if n.endswith("e_score_correction_bias"):
            assert torch.equal(b, start.get_buffer(n))
    assert command.main(args) == 0
    assert "nothing to do" in capsys.readouterr().out


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("which", ["kimi", "grpo", "mopd"])
def test_micro_batched_policy_backward_equals_the_whole_batch(which):
    """`policy_backward(micro_tokens=...)` (the full profile's memory bound) gives the whole-batch loss, stats,
    log-probs and parameter gradients, in float64, for the three losses that couple rows (group baselines,
    a batch-wide normaliser), with rows of odd, uneven lengths cut into chunks trimmed to their last target."""
    from openk3.posttrain.trainers import losses
    from openk3.posttrain.trainers.rl import compute_loss, policy_backward, row_chunks

    model = tiny_model(3).double().train()
    g = torch.Generator().manual_seed(5)
    B, T = 6, 37
    ids = torch.randint(0, 256, (B, T), generator=g)
    lengths = [37, 11, 23, 29, 5, 17]
    mask = torch.zeros(B, T - 1, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, 2:n - 1] = True
    behaviour = torch.where(mask, -torch.rand(B, T - 1, generator=g, dtype=torch.float64) * 3, 0).float()
    teacher = torch.where(mask, -torch.rand(B, T - 1, generator=g, dtype=torch.float64) * 3, 0).float()
    batch = {"ids_BT": ids, "mask_BT": mask, "behaviour_BT": behaviour,
             "rewards_B": torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])}
    if which == "mopd":
        def loss_fn(lp):
            return losses.mopd_loss(lp, behaviour, teacher, mask)
    else:
        cfg = RLConfig(loss=which, group_size=3)

        def loss_fn(lp):
            return compute_loss(cfg, lp, batch)
    whole = policy_backward(model, ids, mask, loss_fn)
    g_whole = _grads(model)
    model.zero_grad()
    chunks = row_chunks(mask, 60)
    assert len(chunks) >= 4 and [c[:2] for c in chunks][0][0] == 0 and chunks[-1][1] == B
    assert all((b - a) * n <= 60 or b - a == 1 for a, b, n in chunks) and any(n < T for _, _, n in chunks)
    micro = policy_backward(model, ids, mask, loss_fn, micro_tokens=60)
    g_micro = _grads(model)
    assert abs(float(whole[0]) - float(micro[0])) <= 1e-12 * max(1.0, abs(float(whole[0])))
    assert torch.allclose(torch.where(mask, whole[2], 0), torch.where(mask, micro[2], 0), atol=1e-6)  # fp32 logp
    assert torch.allclose(torch.where(mask, whole[3], 0), torch.where(mask, micro[3], 0), atol=1e-5)
    assert set(g_whole) == set(g_micro) and len(g_whole) > 10
    worst = max(((g_whole[k] - g_micro[k]).abs().max() / g_whole[k].abs().max().clamp(min=1e-30)).item()
                for k in g_whole)
    assert worst <= 1e-5, worst  # the log-probs pass through float32 (token_logprobs), as in the whole batch
    assert max(v.abs().max().item() for v in g_whole.values()) > 0
    with pytest.raises(ValueError, match="micro_tokens must be an integer >= 2 or None"):
        RLConfig(micro_tokens=1)
