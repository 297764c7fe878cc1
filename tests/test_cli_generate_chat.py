"""`openk3 generate` and `openk3 chat`, in process (`openk3.__main__.main`), on a random nano checkpoint.

Only mechanics are checked (streaming, batching, flags, the chat loop, tool-call printing, errors),
never what the random model says.
"""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

import openk3
from openk3.__main__ import main
from openk3.commands.chat import DIM, RESET, Printer, format_call
from openk3.infer.engine import Engine, RequestOutput
from openk3.infer.llm import LLM
from openk3.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    model = openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0)
    openk3.save(model, path, dtype=torch.float32)
    Tokenizer({bytes([b]): b for b in range(256)}).save(str(path))  # 256 bytes + 256 specials = 512
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--threads", "1"])
    out = capsys.readouterr()
    return code, out.out, out.err


def chat_session(monkeypatch, capsys, ckpt, lines: str, *flags: str):
    """Run `openk3 chat` on piped stdin; returns (exit code, stdout, stderr, the message lists chat saw)."""
    seen: list[list[dict]] = []
    original = LLM.chat

    def spy(self, messages, *a, **kw):
        seen.append([dict(m) for m in messages])
        return original(self, messages, *a, **kw)

    monkeypatch.setattr(LLM, "chat", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    code, out, err = run(capsys, "chat", "--model", str(ckpt), *flags)
    return code, out, err, seen


# ---- generate ------------------------------------------------------------------------------------

def test_generate_streams_one_prompt(capsys, ckpt, llm):
    ref = llm.generate("Hello", max_tokens=8, temperature=0, ignore_eos=True)[0]
    code, out, err = run(capsys, "generate", "--model", str(ckpt), "--prompt", "Hello", "--max-tokens", "8",
                         "--temperature", "0", "--ignore-eos")
    assert code == 0
    assert out == ref.text + "\n"
    assert "[generate] 1 prompt(s), 8 tokens" in err and "finish: length" in err


def test_generate_keep_packed(capsys, tmp_path):
    """`--keep-packed` on an MXFP4 checkpoint: the experts stay packed and generation runs."""
    path = tmp_path / "mx"
    openk3.save(openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0), path, experts_format="mxfp4",
                dtype=torch.float32)
    Tokenizer({bytes([b]): b for b in range(256)}).save(str(path))
    outs = [run(capsys, "generate", "--model", str(path), "--prompt", "Hi", "--max-tokens", "4", "--temperature",
                "0", "--ignore-eos", *flag) for flag in ([], ["--keep-packed"])]
    assert [code for code, _, _ in outs] == [0, 0]
    assert outs[0][1] == outs[1][1]  # the same greedy text, packed or unpacked


def test_generate_batch_json_and_prompts_file(capsys, tmp_path, ckpt, llm):
    prompts = ["Hello", "abc", "xyz"]
    file = tmp_path / "prompts.txt"
    file.write_text("abc\n\nxyz\n")
    code, out, _ = run(capsys, "generate", "-m", str(ckpt), "-p", "Hello", "--prompts-file", str(file),
                       "--max-tokens", "5", "--temperature", "0.7", "--top-k", "40", "--top-p", "0.9",
                       "--min-p", "0.01", "--repetition-penalty", "1.1", "--seed", "7", "--ignore-eos", "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    ref = llm.generate(prompts, temperature=0.7, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                       seed=7, max_tokens=5, ignore_eos=True)
    assert [r["prompt"] for r in rows] == prompts
    assert [r["token_ids"] for r in rows] == [o.token_ids for o in ref]
    assert [r["text"] for r in rows] == [o.text for o in ref]
    assert {r["finish_reason"] for r in rows} == {"length"}


def test_generate_batch_text_and_stop(capsys, ckpt, llm):
    ref = llm.generate("abc", max_tokens=24, temperature=0, ignore_eos=True)[0]
    stop = next(ch for i, ch in enumerate(ref.text) if i > 0 and ch.isascii() and ch.isprintable())
    code, out, _ = run(capsys, "generate", "-m", str(ckpt), "-p", "abc", "-p", "abc", "--max-tokens", "24",
                       "-t", "0", "--ignore-eos", "--stop", stop, "--echo")
    assert code == 0
    cut = ref.text[:ref.text.index(stop)]
    lines = out.split("\n")
    assert lines[0].startswith("--- 1/2 (stop, ") and lines[0].endswith(" tokens) ---")
    assert out.count("abc" + cut + "\n") == 2


def test_generate_errors_are_one_line(capsys, tmp_path, ckpt):
    cases = [
        (["--model", str(tmp_path / "missing"), "--prompt", "x"], "missing: no such checkpoint"),
        (["--model", str(tmp_path), "--prompt", "x"], "not a checkpoint folder"),
        (["--model", str(ckpt)], "no prompt"),
        (["--model", str(ckpt), "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["--model", str(ckpt), "--prompts-file", str(tmp_path / "none.txt")], "cannot read"),
    ]
    for argv, needle in cases:
        code, out, err = run(capsys, "generate", *argv)
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("openk3 generate: error: ") and needle in lines[0], err


def test_generate_dtype_auto_computes_bf16_in_float32_and_says_so(capsys, tmp_path, llm):
    """F18/D14: on CPU `--dtype auto` (the default) computes a bf16 checkpoint in float32 and says so on
    stderr; `--dtype bfloat16` keeps bf16 (every resolve_dtype spelling is accepted)."""
    path = tmp_path / "bf16"
    openk3.save(llm.model, path, dtype=torch.bfloat16)
    llm.tokenizer.save(str(path))
    argv = ["generate", "--model", str(path), "--prompt", "Hi", "--max-tokens", "2", "--temperature", "0"]
    code, _, err = run(capsys, *argv)
    assert code == 0 and "[openk3] " in err
    assert "compute dtype float32 on CPU, where it decodes 1.5-2x faster than the stored bfloat16" in err
    code, _, err = run(capsys, *argv, "--dtype", "bfloat16")
    assert code == 0 and "compute dtype bfloat16, as asked" in err


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_compile_help_states_the_compile_time_of_the_code(capsys, command):
    """G19: `--compile` promises the compile time infer/graph.py documents (40-90 s per graph), not ~30 s."""
    import openk3.infer.graph as graph

    assert "40-90 s each" in graph.__doc__
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "about 40-90 s per graph" in help_text and "~30 s" not in help_text


def test_demo_help_does_not_claim_to_be_the_main_job(capsys):
    """G19: pretraining (`openk3 train`) exists; `demo` is described as the quick smoke test it is."""
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "demo quick smoke test" in help_text and "until pretraining lands" not in help_text


# ---- chat ----------------------------------------------------------------------------------------

def test_chat_piped_multi_turn_reset_and_exit(monkeypatch, capsys, ckpt):
    lines = "Hello there\nAnd then?\n/reset\n//slash message\n/bogus\n/exit\nnever read\n"
    code, out, err, seen = chat_session(monkeypatch, capsys, ckpt, lines, "--system", "Be brief.",
                                        "--max-tokens", "6", "-t", "0", "--effort", "low")
    assert code == 0
    assert len(seen) == 3
    assert [m["role"] for m in seen[0]] == ["system", "user"]
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]
    assert seen[1][2]["role"] == "assistant" and "reasoning_content" in seen[1][2]  # reasoning kept
    assert seen[2] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "/slash message"}]
    assert "[history cleared]" in err and "unknown command /bogus" in err
    assert "\x1b[" not in out  # not a terminal: no ANSI codes


def test_chat_no_thinking_and_eof(monkeypatch, capsys, ckpt):
    code, out, _, seen = chat_session(monkeypatch, capsys, ckpt, "Hi\n", "--no-thinking", "--max-tokens", "4",
                                      "-t", "0")
    assert code == 0 and len(seen) == 1  # end of input quits
    assert "[thinking]" not in out


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "number"}}}}}]
CALL = ("Need the weather.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
        "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
        "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>"
        "<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>"
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>")
ANSWER = ("Easy.<|close|>think<|sep|><|open|>response<|sep|>Sunny, 18°C.<|close|>response<|sep|>"
          "<|close|>message<|sep|><|end_of_msg|>")


def test_chat_tool_call_printed_and_answered(monkeypatch, capsys, tmp_path, ckpt, llm):
    tok = llm.tokenizer
    queue = [tok.encode(CALL, allow_special=True), tok.encode(ANSWER, allow_special=True)]

    def scripted(self, prompt, params=None, **kw):  # the model's completions, token by token
        ids = queue.pop(0)
        for k, tid in enumerate(ids):
            last = k == len(ids) - 1
            yield RequestOutput("fake", list(prompt), ids[:k + 1], "", [tid], "", last, "stop" if last else None)

    monkeypatch.setattr(Engine, "stream", scripted)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    code, out, err, seen = chat_session(monkeypatch, capsys, ckpt, "Weather in Paris?\n/tool call_0 18C, sunny\n",
                                        "--tools", str(tools))
    assert code == 0 and queue == []
    assert out == ("[thinking] Need the weather.\nChecking.\n[tool call call_0] get_weather\n"
                   '{\n  "city": "Paris",\n  "days": 3\n}\n'
                   "[thinking] Easy.\nSunny, 18°C.\n")
    assert "/tool call_0 RESULT" in err
    assert seen[1][-2]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                        "arguments": '{"city": "Paris", "days": 3}'}
    assert seen[1][-1] == {"role": "tool", "tool_call_id": "call_0", "name": "get_weather",
                           "content": "18C, sunny"}


def test_chat_tool_answer_without_pending_call_and_bad_tools_file(monkeypatch, capsys, tmp_path, ckpt):
    code, _, err, seen = chat_session(monkeypatch, capsys, ckpt, "/tool call_0 x\n")
    assert code == 0 and seen == [] and "no tool call is waiting" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"tools": 3}')
    code, out, err = run(capsys, "chat", "--model", str(ckpt), "--tools", str(bad))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "list of tools" in err
    code, _, err = run(capsys, "chat", "--model", str(tmp_path / "missing"))
    missing = tmp_path / "missing"
    assert code == 2 and err.strip() == f"openk3 chat: error: {missing}: no such checkpoint or training run folder"


def test_printer_dims_thinking_on_a_terminal():
    buf = io.StringIO()
    p = Printer(buf, tty=True)
    p({"reasoning_content": "hmm"})
    p({"content": "Hi"})
    p({"tool_call": {"id": "call_0", "function": {"name": "f", "arguments": "not json"}}})
    p.end()
    assert buf.getvalue() == f"{DIM}hmm{RESET}\nHi\n[tool call call_0] f\nnot json\n"
    assert format_call({"id": "c", "function": {"name": "g", "arguments": ""}}) == "[tool call c] g\n{}\n"


def test_chat_turn_the_renderer_refuses_is_dropped(monkeypatch, capsys, ckpt, llm):
    """A call whose raw JSON body is not an object parses, but cannot be rendered back: the next turn is
    refused with a note (no traceback, the session goes on)."""
    bad = ("<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>"
           "<|open|>json type=\"object\"<|sep|>[1]<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
           "<|close|>message<|sep|><|end_of_msg|>")
    ids = llm.tokenizer.encode(bad, allow_special=True)

    def scripted(self, prompt, params=None, **kw):
        yield RequestOutput("fake", list(prompt), ids, "", ids, "", True, "stop")

    monkeypatch.setattr(Engine, "stream", scripted)
    code, out, err, seen = chat_session(monkeypatch, capsys, ckpt, "go\n/tool [1] result\n/history\n")
    assert code == 0 and len(seen) == 2
    assert "[tool call call_0] f\n[\n  1\n]\n" in out
    assert "[error: " in err and "must be a JSON object" in err
    assert [m["role"] for m in json.loads(out[out.index("[\n  {"):])] == ["user", "assistant"]
