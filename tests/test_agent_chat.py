"""The agent loop (openk3/agent/episode.py `run_episode`) and `openk3 chat --sandbox [--approve ask|auto]`.

The model is scripted (its turns are the canonical ids of chosen messages) so whole episodes run
deterministically; one short run with a random nano model checks only that the loop ends and that the
trajectory's ids, mask and turns agree.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from types import SimpleNamespace

import pytest
import torch

import openk3
from openk3.__main__ import main
from openk3.agent import SandboxUnavailable, unavailable_reason
from openk3.agent import env as env_module
from openk3.agent.env import SandboxEnv
from openk3.agent.episode import run_episode
from openk3.agent.tasks import Task, families, generate
from openk3.chat import encode_segments, render
from openk3.infer.engine import Engine, RequestOutput
from openk3.infer.llm import LLM
from openk3.tokenizer import Tokenizer

WHY = unavailable_reason()
needs_sandbox = pytest.mark.skipif(WHY is not None, reason=f"no sandbox on this host: {WHY}")

TOK = Tokenizer({bytes([b]): b for b in range(256)})
EOM = TOK.special_ids["<|end_of_msg|>"]
GRADE = """import json, os
ok = os.path.exists("/workspace/out.txt") and open("/workspace/out.txt").read().strip() == "42"
answer = json.loads(os.environ["OPENK3_ANSWER"])
print(json.dumps({"nonce": os.environ["OPENK3_NONCE"], "reward": 1.0 if ok and answer == "42" else 0.0}))
"""


def task(tools=("Shell", "Submit")) -> Task:
    return Task(family="demo", seed=0, difficulty=1, split="train", template="t",
                instruction="Write 42 to out.txt, then submit 42.", files={"in.txt": "21\n"},
                grader_files={"grade.py": GRADE}, tools=list(tools))


def completion(message: dict, thinking: bool = True) -> list[int]:
    """The ids a model generates for `message` (what follows the generation prompt in a render)."""
    head = encode_segments(render({"messages": [], "thinking": thinking, "thinking_effort": None}), TOK).ids
    whole = encode_segments(render({"messages": [message], "thinking": thinking, "thinking_effort": None,
                                    "add_generation_prompt": False}), TOK).ids
    assert whole[:len(head)] == head
    return whole[len(head):]


def assistant(content: str = "", **calls) -> dict:
    msg = {"role": "assistant", "reasoning_content": "plan", "content": content}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                             for n, a in calls.items()]
    return msg


class ScriptedLLM:
    """`generate` on ids, as openk3.LLM's, replaying fixed turns; remembers the prompts it was given."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.prompts = list(turns), []
        self.engine = SimpleNamespace(max_model_len=1 << 20)

    def generate(self, prompt_ids, **sampling):
        self.prompts.append(list(prompt_ids))
        return [SimpleNamespace(token_ids=self.turns.pop(0), finish_reason="stop")]


def check_consistent(traj, env) -> None:
    assert traj.ids == env.ids and len(traj.loss_mask) == len(traj.ids)
    generated = [i for i, m in zip(traj.ids, traj.loss_mask, strict=True) if m == 1]
    assert generated == [i for c in traj.completions for i in c]
    assert traj.loss_mask[:traj.prompt_len] == [0] * traj.prompt_len


@needs_sandbox
def test_scripted_episode_with_tool_calls_and_submit():
    turns = [completion(assistant(Shell={"command": "echo $(( $(cat in.txt) * 2 )) > out.txt && cat out.txt"})),
             completion(assistant("", Submit={"answer": "42"}))]
    llm = ScriptedLLM(turns)
    with SandboxEnv(task(), TOK, effort="low") as env:
        traj = run_episode(llm, env, max_tokens=256, temperature=0.0)
        assert (traj.reward, traj.terminated, traj.truncated, traj.reason) == (1.0, True, False, "submit")
        assert traj.turns == 2
        assert [c["name"] for c in traj.calls] == ["Shell", "Submit"] and traj.calls[0]["output"] == "42"
        check_consistent(traj, env)
        # Each turn's prompt was the conversation so far: the previous prompt, the turn, the env's append.
        assert llm.prompts[1][:len(llm.prompts[0])] == llm.prompts[0]
        assert llm.prompts[1][len(llm.prompts[0]):len(llm.prompts[0]) + len(turns[0])] == turns[0]
        assert traj.ids[:traj.prompt_len] == llm.prompts[0]


@needs_sandbox
def test_run_episode_budgets_and_context_limit():
    shell = completion(assistant(Shell={"command": "true"}))
    with SandboxEnv(task(), TOK) as env:
        traj = run_episode(ScriptedLLM([shell] * 5), env, max_turns=2)
        assert (traj.truncated, traj.reason, traj.turns, traj.reward) == (True, "max_turns", 2, 0.0)
        check_consistent(traj, env)
        llm = ScriptedLLM([shell])
        llm.engine.max_model_len = traj.prompt_len - 5  # the reset prompt alone does not fit
        traj = run_episode(llm, env)
        assert (traj.truncated, traj.reason, traj.turns, llm.prompts) == (True, "context", 0, [])
        with pytest.raises(ValueError, match="max_turns"):
            run_episode(llm, env, max_turns=0)


@needs_sandbox
@pytest.mark.skipif("tool_arith" not in families(), reason="the tool_arith family is not registered")
@needs_sandbox
def test_a_task_familys_reference_solution_through_the_loop_earns_reward_1():
    t = generate("tool_arith", seed=1, difficulty=2)
    turns = [completion(assistant(**{c.name: c.args})) for c in t.solution]
    # A spec: each reset(seed) generates the family's task for that seed.
    with SandboxEnv({"family": "tool_arith", "difficulty": 2}, TOK) as env:
        traj = run_episode(ScriptedLLM(turns), env, seed=1)
        assert env.task.id == t.id and traj.messages[0]["content"] == t.instruction
        assert (traj.reward, traj.reason, traj.turns) == (1.0, "submit", len(t.solution))
        assert all(c["ok"] for c in traj.calls)
        check_consistent(traj, env)


@needs_sandbox
def test_a_random_tiny_model_runs_to_the_end_with_a_consistent_trajectory():
    model = openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0)
    llm = LLM(model, TOK)
    with SandboxEnv(task(tools=("Submit",)), TOK, effort="low", max_steps=3) as env:
        traj = run_episode(llm, env, max_tokens=16, temperature=1.0, seed=0)
        assert traj.terminated or traj.truncated
        assert traj.reason in ("stop", "submit", "max_steps", "turn_not_ended")
        assert 1 <= traj.turns <= 3 and all(0 < len(c) <= 16 for c in traj.completions)
        check_consistent(traj, env)
        assert all(c[-1] == EOM for c in traj.completions[:-1])  # only the last turn may be cut


# ---- openk3 chat --sandbox ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "ckpt"
    # Byte-level ids make the declared tools ~7.5k tokens: more context than nano's default 4096.
    config = dataclasses.replace(openk3.preset("nano"), max_position_embeddings=16384)
    openk3.save(openk3.K3ForCausalLM.build(config, seed=0), path, dtype=torch.float32)
    TOK.save(str(path))
    return path


def chat(monkeypatch, capsys, ckpt, turns: list[list[int]], lines: str, *flags: str):
    queue = list(turns)
    prompts = []

    def scripted(self, prompt, params=None, **kw):  # the model's turns, token by token
        prompts.append(list(prompt))
        ids = queue.pop(0)
        for k, tid in enumerate(ids):
            last = k == len(ids) - 1
            yield RequestOutput("fake", list(prompt), ids[:k + 1], "", [tid], "", last, "stop" if last else None)

    monkeypatch.setattr(Engine, "stream", scripted)
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    code = main(["chat", "--model", str(ckpt), "--sandbox", *flags, "--threads", "1"])
    out = capsys.readouterr()
    assert queue == []
    return code, out.out, out.err, prompts


@needs_sandbox
def test_chat_sandbox_runs_calls_and_asks_before_risky_ones(monkeypatch, capsys, ckpt):
    turns = [completion(assistant("Making it.", Shell={"command": "mkdir d && echo hi > d/a && cat d/a"})),
             completion(assistant("", Shell={"command": "rm -rf d; ls"})),
             completion(assistant("Kept d.")),
             completion(assistant("", Shell={"command": "rm -r d && ls -a"})),
             completion(assistant("Removed."))]
    code, out, err, prompts = chat(monkeypatch, capsys, ckpt, turns,
                                   "make d\nn\nnow remove it\ny\n/history\n")
    assert code == 0
    assert "Making it.\n[tool call call_0] Shell\n" in out and "[result call_0] hi\n" in out
    assert "[result call_1] error: rejected by the user: R-rm\n" in out
    assert "[approve Shell (rule R-rm)?" in err and err.count("[approve") == 2
    assert "[result call_2] .\n..\n" in out  # approved: d is gone
    history = json.loads(out[out.index("[\n  {"):])
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant", "tool", "assistant",
                                            "user", "assistant", "tool", "assistant"]
    # The second exchange's prompt continues the first one's ids (one conversation, one sandbox).
    assert prompts[3][:len(prompts[2])] == prompts[2]


@needs_sandbox
def test_chat_sandbox_auto_approve_and_a_cut_answer_is_dropped(monkeypatch, capsys, ckpt):
    turns = [completion(assistant("", Shell={"command": "touch f && rm -rf f && echo gone"})),
             completion(assistant("Done.")),
             [*b"an answer cut at max-tok"],
             completion(assistant("Hi."))]
    code, out, err, prompts = chat(monkeypatch, capsys, ckpt, turns, "go\nsay hi\nsay hi again\n",
                                   "--approve", "auto")
    assert code == 0 and "[approve" not in err and "[result call_0] gone\n" in out
    assert "the exchange is dropped" in err
    assert prompts[3][:len(prompts[2])] != prompts[2]  # the dropped exchange is not in the next prompt
    assert len(prompts[3]) == len(prompts[2]) + len(b"say hi again") - len(b"say hi")


def test_chat_sandbox_refuses_tools_file(capsys, ckpt, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text("[]")
    code = main(["chat", "--model", str(ckpt), "--sandbox", "--tools", str(tools), "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--tools and --sandbox do not mix" in err


def test_chat_sandbox_on_a_host_without_sandboxes_is_one_line(monkeypatch, capsys, ckpt):
    import openk3.agent

    monkeypatch.setattr(openk3.agent, "unavailable_reason", lambda: "`bwrap` is not installed")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    code = main(["chat", "--model", str(ckpt), "--sandbox", "--threads", "1"])
    err = capsys.readouterr().err
    # One line, and before the model was loaded (its load note would come first).
    assert code == 2 and err == ("openk3 chat: error: --sandbox: cannot start a sandbox on this host: "
                                 "`bwrap` is not installed\n")


@needs_sandbox
def test_chat_sandbox_when_the_sandbox_fails_to_start_is_one_line(monkeypatch, capsys, ckpt):
    def unavailable(**kwargs):
        raise SandboxUnavailable("cannot start a sandbox on this host: mount: overlay failed")

    monkeypatch.setattr(env_module, "Sandbox", unavailable)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    code = main(["chat", "--model", str(ckpt), "--sandbox", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines()[-1] == ("openk3 chat: error: --sandbox: cannot start a sandbox on this "
                                                  "host: mount: overlay failed")


# ---- review fixes: what the terminal shows, the audit log, arguments that break the JSON decoder -----------


def test_visible_escapes_terminal_controls_and_keeps_newlines_and_tabs():
    from openk3.commands.chat import format_call, format_result, visible

    assert visible("a\tb\nc") == "a\tb\nc"
    assert visible("\x1b]0;title\x07\x1b[2K\r\x9b1A\u202egnp.exe\x7f") == \
        "\\x1b]0;title\\x07\\x1b[2K\\x0d\\x9b1A\\u202egnp.exe\\x7f"
    assert format_result({"id": "call_0", "output": "ok\x1b[8m"}) == "[result call_0] ok\\x1b[8m\n"
    # Arguments nested past the JSON decoder's recursion limit are shown raw, not a crash.
    deep = {"id": "call_1", "function": {"name": "Shell", "arguments": "[" * 3000}}
    assert format_call(deep) == "[tool call call_1] Shell\n" + "[" * 3000 + "\n"


@needs_sandbox
def test_chat_sandbox_escapes_tool_output_and_writes_an_audit_log(monkeypatch, capsys, ckpt, tmp_path):
    from openk3.agent.audit import read_audit

    # The output erases its line, retitles the terminal and would hide whatever is printed next.
    command = r"printf 'a\033[2K\033]0;owned\007\033[8mhidden\n'"
    turns = [completion(assistant("", Shell={"command": command})), completion(assistant("Done."))]
    log = tmp_path / "audit.jsonl"
    code, out, err, _ = chat(monkeypatch, capsys, ckpt, turns, "go\n", "--audit", str(log))
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert "[result call_0] a\\x1b[2K\\x1b]0;owned\\x07\\x1b[8mhidden\n" in out
    records = list(read_audit(log))
    assert [(r["tool"], r["decision"], json.loads(r["args"])) for r in records] == [
        ("Shell", "allow", {"command": command})]


def test_chat_audit_needs_sandbox(capsys, ckpt, tmp_path):
    code = main(["chat", "--model", str(ckpt), "--audit", str(tmp_path / "a.jsonl"), "--threads", "1"])
    assert code == 2 and "--audit logs the tool calls of --sandbox" in capsys.readouterr().err
