"""`openk3 chat --model DIR [--system TEXT] [--effort low|high|max|none] [--tools FILE.json] ...`

An interactive chat in K3's XTML format (`openk3.LLM.chat`). Reads one user message a line from stdin
(a terminal or a pipe), streams the answer to stdout: the thinking channel dimmed on a terminal
(prefixed `[thinking] ` otherwise), then the response, then any tool calls the model makes as
`[tool call ID] NAME` + pretty-printed JSON arguments. The conversation is multi-turn: each answer goes
back into the history with its reasoning (as K3 is trained).

Lines starting with `/` are commands:

    /tool ID RESULT   answer tool call ID with RESULT (the rest of the line); with one call pending the
                      ID may be left out. Once every pending call has an answer, the model continues.
    /reset            clear the history (the --system message stays)
    /history          print the conversation so far as JSON
    /exit, /quit      quit (so does end of input)
    /help             this list
    //TEXT            send the message "/TEXT"

A plain message while tool calls are pending leaves them unanswered. Notes (errors, hints, --verbose
figures) go to stderr, so stdout carries only the conversation.

With `--sandbox` the model gets the agent's tools (Shell, ReadFile, WriteFile, StrReplaceFile, Glob, Grep,
the key-value store, SQL) in a fresh sandbox (`openk3.agent.env.SandboxEnv`: an empty /workspace, no network)
and runs them itself: each call is printed, checked by the default policy (allow-list, schemas, path
rules, approval rules), run, and its result printed as `[result ID] ...`; the model continues until it
answers without calling a tool. A call an approval rule marks "ask" (rm -r, curl, git push, DROP TABLE,
...) waits for a line `y` (run it), `a` (always, for that rule, this session) or anything else (refuse;
the model sees the refusal); `--approve auto` answers y. /reset starts a fresh sandbox. What the sandbox
chat prints of the model and the tools shows control characters other than newline and tab escaped (ESC as
`\x1b`), so tool output cannot move the cursor, retitle the terminal or hide the next call before an
approval prompt. `--audit FILE` appends one JSON line per tool call (openk3.agent.audit) to FILE; without it
no audit log is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from openk3.commands.generate import add_checkpoint_arguments, add_sampling_arguments

HELP = """commands:
  /tool ID RESULT   answer tool call ID (ID optional when one call is pending)
  /reset            clear the history (keeps --system)
  /history          print the conversation as JSON
  /exit, /quit      quit (or end of input)
  //TEXT            send a message that starts with /"""

DIM, RESET = "\x1b[2m", "\x1b[0m"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "input: one user message a line on stdin (a terminal or a pipe); answers stream to stdout.\n" + HELP
    add_checkpoint_arguments(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message at the start of the conversation")
    p.add_argument("--effort", default="max", choices=["low", "high", "max", "none"],
                   help="thinking effort (default max, as K3's template); none = thinking off")
    p.add_argument("--no-thinking", action="store_true", help="answer directly, without the thinking channel")
    p.add_argument("--tools", default=None, metavar="FILE.json",
                   help="OpenAI tools list (JSON list, or an object with a 'tools' list) the model may call")
    p.add_argument("--sandbox", action="store_true",
                   help="give the model the agent tools in a sandbox (Shell, files, KV, SQL); it runs them itself")
    p.add_argument("--approve", default="ask", choices=["ask", "auto"],
                   help="with --sandbox: ask before calls an approval rule marks risky (default), or run them")
    p.add_argument("--audit", default=None, metavar="FILE.jsonl",
                   help="with --sandbox: append an audit line per tool call (tool, arguments, decision, rule, "
                        "exit status, ...) to this file; default: no audit log")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="after each answer, print tokens, speed, finish reason and parser problems to stderr")
    add_sampling_arguments(p, max_tokens=1024)


def load_tools(path: str) -> list[dict]:
    """An OpenAI tools list from a JSON file; bare function specs ({"name", "parameters"}) are wrapped."""
    from openk3.fsutil import read_json

    data = read_json(path)  # ValueError or FileNotFoundError naming the file
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of tools (or an object with a 'tools' list)")
    tools = []
    for k, tool in enumerate(data):
        if isinstance(tool, dict) and "function" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{path}: tools[{k}] needs function.name")
        tools.append(tool)
    return tools


# C0 controls but newline and tab, DEL, C1 controls (8-bit CSI and OSC) and the bidi overrides: what can
# move the cursor, recolour, retitle or reorder a terminal's text.
_HIDDEN = [c for c in range(0x20) if c not in (0x09, 0x0A)] + list(range(0x7F, 0xA0))
_VISIBLE = {c: f"\\x{c:02x}" for c in _HIDDEN}
_VISIBLE.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def visible(text: str) -> str:
    """`text` with terminal control characters shown as escapes (ESC as `\x1b`); newline and tab kept."""
    return text.translate(_VISIBLE)


def format_call(call: dict) -> str:
    """`[tool call ID] NAME` and the arguments as indented JSON (raw text if they are not JSON)."""
    fn = call.get("function", {})
    args = fn.get("arguments") or "{}"
    try:
        pretty = json.dumps(json.loads(args), indent=2, ensure_ascii=False)
    except (ValueError, RecursionError):  # not JSON, or nested past the decoder's recursion limit
        pretty = args
    return f"[tool call {call.get('id')}] {fn.get('name')}\n{pretty}\n"


class Printer:
    """`on_delta` for LLM.chat: reasoning dimmed (terminal) or after `[thinking] `, content plain, calls whole."""

    def __init__(self, out, tty: bool, escape: bool = False) -> None:
        self.out, self.tty, self.escape = out, tty, escape  # escape: show control characters (`visible`)
        self.mode: str | None = None
        self.at_line_start = True

    def _write(self, text: str, dim: bool = False) -> None:
        if not text:
            return
        if self.escape:
            text = visible(text)
        self.out.write(f"{DIM}{text}{RESET}" if dim and self.tty else text)
        self.out.flush()
        self.at_line_start = text.endswith("\n")

    def _switch(self, mode: str) -> None:
        if self.mode == mode:
            return
        if not self.at_line_start:
            self._write("\n")
        self.mode = mode
        if mode == "think" and not self.tty:
            self._write("[thinking] ")

    def __call__(self, delta: dict) -> None:
        if "reasoning_content" in delta:
            self._switch("think")
            self._write(delta["reasoning_content"], dim=True)
        elif "content" in delta:
            self._switch("content")
            self._write(delta["content"])
        elif "tool_call" in delta:
            self._switch("tool")
            self._write(format_call(delta["tool_call"]))

    def end(self) -> None:
        if not self.at_line_start:
            self._write("\n")
        self.mode = None


def _read_line(tty: bool, prompt: str = "you> ") -> str | None:
    if tty:
        try:
            return input(prompt)
        except EOFError:
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\r\n")


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    import time

    from openk3.commands.generate import build_llm, print_stream_stats, sampling_params

    if args.sandbox and args.tools:
        raise ValueError("--tools and --sandbox do not mix: --sandbox declares the agent's own tools")
    if args.audit and not args.sandbox:
        raise ValueError("--audit logs the tool calls of --sandbox; without --sandbox nothing runs to log")
    if args.sandbox:  # before the (slower) model load
        from openk3 import agent

        why = agent.unavailable_reason()
        if why is not None:
            raise ValueError(f"--sandbox: cannot start a sandbox on this host: {why}")
    tools = load_tools(args.tools) if args.tools else None
    params = sampling_params(args)
    thinking = not (args.no_thinking or args.effort == "none")
    effort = args.effort if thinking else None
    llm = build_llm(args)
    if llm.tokenizer is None:  # pragma: no cover - a path always comes with a tokenizer
        raise ValueError("chat needs a tokenizer")
    if args.sandbox:
        return sandbox_chat(llm, params, effort=effort or "none", system=args.system, approve=args.approve,
                            verbose=args.verbose, audit=args.audit)
    base = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(base)
    pending: dict[str, str] = {}  # tool call id -> tool name, awaiting a /tool answer
    tty_in = sys.stdin.isatty()
    printer = Printer(sys.stdout, sys.stdout.isatty())
    if tty_in:
        _note(f"openk3 chat: {llm.path}; /help for commands, /exit or Ctrl-D to quit")
    while True:
        try:
            line = _read_line(tty_in)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        if line is None:
            break
        if not line.strip():
            continue
        saved = (list(history), dict(pending))
        if line.startswith("/") and not line.startswith("//"):
            cmd, _, rest = line.strip().partition(" ")
            rest = rest.strip()
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/help":
                _note(HELP)
                continue
            if cmd == "/reset":
                history, pending = list(base), {}
                _note("[history cleared]")
                continue
            if cmd == "/history":
                print(json.dumps(history, indent=2, ensure_ascii=False), flush=True)
                continue
            if cmd != "/tool":
                _note(f"unknown command {cmd}; /help lists them (//TEXT sends a message starting with /)")
                continue
            if not pending:
                _note("no tool call is waiting for an answer")
                continue
            call_id, _, result = rest.partition(" ")
            if call_id not in pending:
                if len(pending) > 1:
                    _note(f"/tool needs a call id: one of {', '.join(pending)}")
                    continue
                call_id, result = next(iter(pending)), rest
            history.append({"role": "tool", "tool_call_id": call_id, "name": pending.pop(call_id),
                            "content": result.strip()})
            if pending:
                _note(f"[waiting for the results of {', '.join(pending)}]")
                continue
        else:
            if pending:
                _note(f"[tool calls left unanswered: {', '.join(pending)}]")
                pending = {}
            history.append({"role": "user", "content": line[1:] if line.startswith("//") else line})
        t0 = time.perf_counter()
        try:
            result = llm.chat(history, params, tools=tools, thinking=thinking, effort=effort, on_delta=printer)
        except KeyboardInterrupt:
            printer.end()
            _note("[interrupted; the turn is dropped]")
            history, pending = saved
            continue
        except ValueError as e:  # e.g. a conversation the renderer refuses, or one too long for the model
            printer.end()
            _note(f"[error: {e}; the turn is dropped (/reset starts over)]")
            history, pending = saved
            continue
        finally:
            printer.end()
        history.append(result.message)
        pending = {c["id"]: c["function"]["name"] for c in result.tool_calls}
        if pending:
            _note("[answer with: " + "; ".join(f"/tool {i} RESULT" for i in pending) + "]")
        if result.finish_reason == "length":
            _note(f"[stopped after --max-tokens {params.max_tokens} tokens]")
        if args.verbose:
            dt = time.perf_counter() - t0
            n = len(result.token_ids)
            codes = ", ".join(sorted({p["code"] for p in result.problems})) or "none"
            _note(f"[{len(result.prompt_token_ids)} prompt + {n} generated tokens in {dt:.2f} s "
                  f"({n / max(dt, 1e-9):.1f} tok/s); finish: {result.finish_reason}; parser problems: {codes}]")
        print_stream_stats(args, llm)
    return 0


def approval_prompt(read: Callable[[], str | None]) -> Callable:
    """The policy's approval hook for a terminal: one line, y / a (always) / anything else = refuse."""
    answers = {"y": "approve", "yes": "approve", "a": "approve_for_session", "always": "approve_for_session"}

    def hook(call) -> str:
        _note(f"[approve {call.name} (rule {call.rule_id})? y = run it, a = always for this rule, n = refuse]")
        line = read()
        return answers.get((line or "").strip().lower(), "reject")

    return hook


def format_result(rec: dict) -> str:
    """`[result ID] OUTPUT` for a call's record (env.step's info["calls"]), control characters escaped."""
    return f"[result {rec['id']}] {visible(rec['output'])}\n"


def sandbox_chat(llm, params, *, effort: str, system: str | None, approve: str, verbose: bool = False,
                 max_turns: int = 32, audit: str | None = None) -> int:
    """The `--sandbox` REPL: each user line starts an agent loop (`run_episode` on the env's conversation)
    that ends when the model answers without a tool call, or after `max_turns` tool turns. `audit`: a JSONL
    file that gets one line per tool call."""
    import dataclasses

    from openk3.agent import SandboxUnavailable
    from openk3.agent.env import CHAT_TOOLS, SandboxEnv
    from openk3.agent.episode import run_episode
    from openk3.agent.policy import Policy

    tty_in = sys.stdin.isatty()
    read = (lambda: _read_line(False)) if not tty_in else (lambda: _read_line(True, "approve> "))
    hook = approval_prompt(read) if approve == "ask" else (lambda call: "approve")
    env = SandboxEnv(None, llm.tokenizer, policy=Policy(tools=CHAT_TOOLS, approval_hook=hook), effort=effort,
                     system=system, max_steps=1 << 30, max_tool_seconds=float(1 << 30), audit_path=audit)
    printer = Printer(sys.stdout, sys.stdout.isatty(), escape=True)
    sampling = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}

    def show(rec: dict) -> None:
        printer.end()
        sys.stdout.write(format_result(rec))
        sys.stdout.flush()

    with env:
        try:
            env.reset()
        except SandboxUnavailable as e:  # a host without user namespaces, bwrap, ...: one line, exit 2
            raise ValueError(f"--sandbox: {e}") from None
        if tty_in:
            _note(f"openk3 chat --sandbox: {llm.path}; tools run in a fresh sandbox; /reset, /history, /exit")
        while True:
            try:
                line = _read_line(tty_in)
            except KeyboardInterrupt:
                print(file=sys.stderr)
                break
            if line is None or line.strip() in ("/exit", "/quit"):
                break
            if not line.strip():
                continue
            if line.strip() == "/reset":
                env.reset()
                _note("[history cleared; a fresh sandbox]")
                continue
            if line.strip() == "/history":
                print(json.dumps(env.transcript.messages, indent=2, ensure_ascii=False), flush=True)
                continue
            if line.startswith("/") and not line.startswith("//"):
                _note(f"unknown command {line.split()[0]} (with --sandbox: /reset, /history, /exit)")
                continue
            mark = env.mark()
            env.add_user_message(line[1:] if line.startswith("//") else line)
            try:
                traj = run_episode(llm, env, reset=False, max_turns=max_turns, on_delta=printer, on_call=show,
                                   **sampling)
            except KeyboardInterrupt:
                printer.end()
                env.rewind(mark)
                _note("[interrupted; the exchange is dropped]")
                continue
            printer.end()
            if traj.reason == "turn_not_ended":
                env.rewind(mark)
                _note(f"[the answer was cut at --max-tokens {params.max_tokens} or the context limit; "
                      "the exchange is dropped]")
            elif traj.reason == "max_turns":
                _note(f"[stopped after {max_turns} tool turns; say how to go on]")
            elif traj.reason == "context":
                env.rewind(mark)
                _note("[the conversation no longer fits the model's context; /reset starts over]")
            if verbose:
                _note(f"[{len(env.ids)} tokens in the conversation; {traj.turns} turns, {len(traj.calls)} calls]")
    return 0
