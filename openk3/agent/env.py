"""`SandboxEnv`: an agent episode in a sandbox, Gymnasium-style, on token ids in K3's XTML format.

    env = SandboxEnv(generate("fix_test", seed=3), tokenizer, effort="high")
    obs = env.reset()                                  # obs.prompt_ids end in the generation prompt
    while True:
        ids = model(obs.prompt_ids)                    # one assistant turn, ending in <|end_of_msg|>
        obs, reward, terminated, truncated, info = env.step(ids)
        if terminated or truncated:
            break                                      # else: obs.append_ids follow the turn's ids
    env.close()

`step` takes the model's turn as (a) its generated ids (parsed on ids with openk3.chat's parser; kept
verbatim in the conversation), (b) a parsed assistant message {reasoning_content, content, tool_calls}, or
(c) raw completion text (parsed, then kept as (b): its canonical ids). It runs the tool calls in order, each
through the policy (allow-list, argument schema, path rules, approval) and then the sandbox (`Shell` via
`Sandbox.run`, every other tool via `Sandbox.tool`, i.e. inside the sandbox), writes one audit line per call,
and returns in `obs.append_ids` the ids to append after the turn: one tool message per call (spec §7.2,
`tool` and 1-based `index`) and the next generation prompt, all with loss mask 0. So the conversation's ids
stay exactly those of a from-scratch render (env_render.Transcript), which is what RL trains on.

Reward: the task's verifier (`task.score`: a fork of the sandbox with the grader files bound read-only at
/grader; the episode's own sandbox never sees them) on `Submit` or a natural stop (a turn without tool calls),
0 otherwise. Budgets end the episode with truncated=True and no reward: `max_steps` assistant turns,
`max_tool_seconds` of tool wall time (a Shell call's timeout is cut to what is left, so nothing hangs), a turn
that does not end (max_tokens hit), and a sandbox failure (its agent died; P5). A bad call is the model's
error, never the env's: arguments that do not decode (not JSON, or nested past the decoder's recursion
limit) and a Shell command the sandbox refuses to send (a NUL byte) each get a tool error observation.

State: `reset` records its snapshot like `snapshot()` does, so `restore(obs.info["snapshot"])` goes back
to the episode's start; a new `reset` forgets the snapshots of the episode before.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from openk3.chat import THINKING_EFFORTS

from .audit import AuditLog
from .env_render import Transcript, notice_text, shell_text
from .policy import Policy
from .sandbox import Sandbox
from .tools import SCHEMAS, declare

CHAT_TOOLS = tuple(name for name in SCHEMAS if name != "Submit")  # a chat session has no episode to end
TOOL_TIMEOUT = 60.0  # seconds: a non-Shell tool call's wall clock (as a Shell call's default)


@dataclass
class Obs:
    """What the agent sees after `reset` or `step`.

    messages: the conversation so far (OpenAI form; tool calls with ids `call_<k>`).
    prompt_ids: the conversation's ids so far; while the episode runs they end in the generation prompt.
    append_ids: the ids this step appended after the turn's own ids (tool messages + generation prompt);
        empty after `reset`. append_mask: their loss mask (all 0).
    tools: the declared tools (OpenAI format). info: episode id, task, snapshot id (reset).
    """

    messages: list[dict]
    prompt_ids: list[int]
    append_ids: list[int] = field(default_factory=list)
    append_mask: list[int] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)


class SandboxEnv:
    """One agent episode at a time in a fresh sandbox (see the module docstring).

    Args:
        task_or_spec: an `openk3.agent.tasks.Task` (instruction, files, grader_files, tools, sql_mode,
            score); a spec {"family", "difficulty", "split"} whose task `reset(seed)` generates; or None for
            a chat session (empty workspace, no instruction, no verifier: reward 0).
        tokenizer: an openk3 Tokenizer with the XTML markers (the model's).
        policy: the permission layers; default `Policy(tools=task.tools)` with RL's `ask` -> deny. Its
            `tools` are what is declared to the model.
        effort: thinking effort "low" | "high" | "max", or "none" (thinking off).
        max_steps: assistant turns before the episode is truncated.
        max_tool_seconds: tool wall time (all calls) before it is truncated.
        audit_path: a JSONL audit log (one line per call) or None.
        system: an optional system message before the instruction.
        sandbox_options: keyword arguments for `Sandbox` (limits, store_dir, ...).
    """

    def __init__(self, task_or_spec: Any, tokenizer: Any, *, policy: Policy | None = None, effort: str = "high",
                 max_steps: int = 64, max_tool_seconds: float = 1200.0, audit_path: str | None = None,
                 system: str | None = None, sandbox_options: dict | None = None) -> None:
        if effort not in (*THINKING_EFFORTS, "none"):
            raise ValueError(f"SandboxEnv: effort must be one of {', '.join(THINKING_EFFORTS)} or none, got {effort!r}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"SandboxEnv: max_steps must be a positive int, got {max_steps!r}")
        seconds = max_tool_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise ValueError(f"SandboxEnv: max_tool_seconds must be a positive number, got {max_tool_seconds!r}")
        if isinstance(task_or_spec, dict):
            unknown = sorted(set(task_or_spec) - {"family", "difficulty", "split"})
            if unknown or "family" not in task_or_spec:
                raise ValueError("SandboxEnv: a task spec is {family, difficulty, split}; "
                                 f"got the keys {sorted(task_or_spec)}")
        self.spec = task_or_spec
        self.task = None if isinstance(task_or_spec, dict) else task_or_spec
        self.tokenizer = tokenizer
        self._policy = policy
        self.effort, self.max_steps, self.max_tool_seconds = effort, max_steps, float(max_tool_seconds)
        self.system = system
        self.sandbox_options = dict(sandbox_options or {})
        self.audit_path = audit_path
        self.audit = AuditLog(audit_path) if audit_path else None
        self.sandbox: Sandbox | None = None
        self.policy: Policy | None = policy
        self.transcript: Transcript | None = None
        self._saved: dict[str, dict] = {}
        self._clear()

    def _clear(self) -> None:
        self.episode_id = uuid.uuid4().hex[:12]
        self.steps, self.tool_seconds, self.done = 0, 0.0, False

    # ---- Gymnasium-style API ----------------------------------------------------------------------

    def reset(self, seed: int | None = None) -> Obs:
        """Start an episode: a fresh sandbox with the task's files, the system and user messages."""
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
        if isinstance(self.spec, dict):
            from .tasks import generate

            self.task = generate(self.spec["family"], 0 if seed is None else seed,
                                 self.spec.get("difficulty", 1), self.spec.get("split", "train"))
        task = self.task
        names = tuple(task.tools) if task is not None else CHAT_TOOLS
        self.policy = self._policy or Policy(tools=names, protected=tuple(getattr(task, "protected", ())))
        self.tools = declare(self.policy.tools)
        thinking = self.effort != "none"
        self.transcript = Transcript(self.tokenizer, self.tools, thinking=thinking,
                                     effort=self.effort if thinking else None)
        self._clear()
        options = dict(self.sandbox_options)
        if task is not None and task.env:  # e.g. fix_test's PYTHONDONTWRITEBYTECODE (no stale bytecode)
            options["env"] = {**task.env, **options.get("env", {})}
        self.sandbox = Sandbox(files=dict(task.files) if task is not None else None, **options)
        messages = [{"role": "system", "content": self.system}] if self.system else []
        if task is not None:
            messages.append({"role": "user", "content": task.instruction})
        # A chat session waits for its first user message: the prompt has no generation prompt yet.
        ids = self.transcript.start(messages, prompt=task is not None)
        self.done = task is None
        # Recorded like env.snapshot(), so `restore(obs.info["snapshot"])` goes back to the episode's start;
        # the ids of an earlier episode's sandbox (closed above) are forgotten.
        self._saved = {}
        snap = self.snapshot()
        return Obs(list(self.transcript.messages), ids, tools=self.tools,
                   info={"episode": self.episode_id, "task": getattr(task, "id", None), "seed": seed,
                         "snapshot": snap, "max_steps": self.max_steps, "max_tool_seconds": self.max_tool_seconds})

    def add_user_message(self, content: str) -> Obs:
        """Continue the conversation with a user turn (chat): its ids and the generation prompt are appended
        (after dropping a generation prompt no turn answered, so the ids stay a from-scratch render)."""
        self._check_open()
        new = self.transcript.add_messages([{"role": "user", "content": content}], prompt=True)
        self.done = False
        return self._obs(new, {"episode": self.episode_id})

    def step(self, action: Any) -> tuple[Obs, float, bool, bool, dict]:
        """One assistant turn: run its tool calls; returns (obs, reward, terminated, truncated, info).

        info: `calls` (per call: id, name, arguments, allowed, rule_id, ok, duration_s, output), `problems`
        (parser findings), `step`, `tool_seconds`, and `reason` when the episode ended (submit, stop,
        max_steps, max_tool_seconds, turn_not_ended, sandbox_error)."""
        self._check_open()
        if self.done:
            raise ValueError("SandboxEnv.step: the episode is over; call reset() (or add_user_message in chat)")
        self.steps += 1
        message, ended = self._take_turn(action)
        info: dict[str, Any] = {"episode": self.episode_id, "step": self.steps, "calls": [],
                                "problems": message.get("problems", [])}
        if not ended:
            self.done = True
            info.update(reason="turn_not_ended", tool_seconds=self.tool_seconds)
            return self._obs([], info), 0.0, False, True, info
        calls = message.get("tool_calls") or []
        reward, terminated, truncated, answer, results = 0.0, False, False, None, []
        for call in calls:
            if terminated or truncated:  # after Submit or a spent budget nothing more runs
                text = "not run: the episode ended before this call"
                results.append(self._tool_message(call, text))
                info["calls"].append(self._record(call, None, False, None, text, 0.0, ran=False))
                continue
            rec, text = self._run_call(call)
            info["calls"].append(rec)
            results.append(self._tool_message(call, text))
            if rec.get("sandbox_error"):
                truncated, info["reason"], info["error"] = True, "sandbox_error", rec["sandbox_error"]
            elif rec["name"] == "Submit" and rec["ok"]:
                terminated, answer, info["reason"] = True, rec["arguments"].get("answer"), "submit"
            elif self.tool_seconds >= self.max_tool_seconds:
                truncated, info["reason"] = True, "max_tool_seconds"
        if not calls:
            terminated, answer, info["reason"] = True, message.get("content"), "stop"
        if not (terminated or truncated) and self.steps >= self.max_steps:
            truncated, info["reason"] = True, "max_steps"
        self.done = terminated or truncated
        new = self.transcript.add_messages(results, prompt=not self.done)
        if terminated:
            reward = self._reward(answer)
        info["tool_seconds"] = self.tool_seconds
        return self._obs(new, info), reward, terminated, truncated, info

    # ---- state ---------------------------------------------------------------------------------------

    def snapshot(self) -> str:
        """Seal the sandbox's state and remember the conversation with it; returns the id for `restore`."""
        self._check_open()
        sid = self.sandbox.snapshot()
        self._saved[sid] = self._state()
        return sid

    def restore(self, snapshot_id: str) -> Obs:
        """Back to a snapshot: files, shell state and the conversation (ids, messages, counters)."""
        self._check_open()
        if snapshot_id not in self._saved:
            raise ValueError(f"SandboxEnv.restore: unknown snapshot {snapshot_id!r} (not taken by this env)")
        self.sandbox.restore(snapshot_id)
        self._load(self._saved[snapshot_id])
        return self._obs([], {"episode": self.episode_id, "snapshot": snapshot_id})

    def fork(self, n: int) -> list[SandboxEnv]:
        """`n` environments continuing from this one's current state (sandbox and conversation), independently."""
        self._check_open()
        state = self._state()
        kids = []
        for sandbox in self.sandbox.fork(n):
            kid = SandboxEnv.__new__(SandboxEnv)
            kid.__dict__.update({k: v for k, v in self.__dict__.items()
                                 if k not in ("sandbox", "transcript", "_saved", "audit")})
            kid.audit = AuditLog(self.audit_path) if self.audit_path else None
            kid.sandbox, kid._saved = sandbox, {}
            # Each child approves "for the session" on its own (the compiled schemas are shared).
            kid.policy = copy.copy(self.policy)
            kid.policy.approved_for_session = set(self.policy.approved_for_session)
            kid.transcript = Transcript(self.tokenizer, self.tools, thinking=self.transcript.thinking,
                                        effort=self.transcript.effort)
            kid._load(state)
            kid.episode_id = uuid.uuid4().hex[:12]
            kids.append(kid)
        return kids

    def mark(self) -> dict:
        """The conversation's state (ids, messages, counters), for `rewind`; the sandbox is not involved."""
        self._check_open()
        return self._state()

    def rewind(self, mark: dict) -> None:
        """Back to a `mark` in the conversation only (files stay as they are: use snapshot/restore for both).
        A chat drops an exchange with it, e.g. one whose answer was cut at max_tokens."""
        self._check_open()
        self._load(mark)

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
        if self.audit is not None:
            self.audit.close()
            self.audit = None

    def __enter__(self) -> SandboxEnv:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def ids(self) -> list[int]:
        """The conversation's ids so far."""
        return list(self.transcript.ids) if self.transcript is not None else []

    @property
    def loss_mask(self) -> list[int]:
        """1 for the ids the model generated, 0 for everything the env rendered."""
        return list(self.transcript.mask) if self.transcript is not None else []

    # ---- internals -----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.sandbox is None or self.transcript is None:
            raise ValueError("SandboxEnv: no episode is running; call reset() first")

    def _state(self) -> dict:
        return {"transcript": self.transcript.state(), "steps": self.steps, "tool_seconds": self.tool_seconds,
                "done": self.done}

    def _load(self, state: dict) -> None:
        self.transcript.load(state["transcript"])
        self.steps, self.tool_seconds, self.done = state["steps"], state["tool_seconds"], state["done"]

    def _obs(self, new: list[int], info: dict) -> Obs:
        return Obs(list(self.transcript.messages), list(self.transcript.ids), list(new), [0] * len(new), self.tools,
                   info)

    def _take_turn(self, action: Any) -> tuple[dict, bool]:
        if hasattr(action, "tolist"):  # a tensor or array of ids
            action = action.tolist()
        if isinstance(action, str):
            from openk3.chat import parse_completion

            parsed = parse_completion(action, self.transcript.thinking)
            msg = self.transcript.add_message(parsed)
            return dict(msg, problems=parsed["problems"]), True
        if isinstance(action, dict):
            return self.transcript.add_message(action), True
        if isinstance(action, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in action):
            return self.transcript.add_completion(list(action))
        raise ValueError("SandboxEnv.step: the action must be completion token ids, an assistant message dict "
                         f"or completion text, not {type(action).__name__}")

    def _tool_message(self, call: dict, text: str) -> dict:
        return {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"], "content": text}

    def _run_call(self, call: dict) -> tuple[dict, str]:
        name, raw = call["function"]["name"], call["function"].get("arguments")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except (ValueError, RecursionError):  # not JSON, or nested past the decoder's recursion limit
            args = None  # the policy's schema layer names the problem
        decision = self.policy.check(name, args)
        if not decision.allowed:
            text = f"error: {decision.observation}"
            return self._record(call, args, False, decision.rule_id, text, 0.0), text
        left = self.max_tool_seconds - self.tool_seconds
        t0 = time.monotonic()
        if name == "Shell":
            timeout = min(float(args.get("timeout", TOOL_TIMEOUT)), left)
            try:
                r = self.sandbox.run(args["command"], timeout=timeout)
            except ValueError as e:  # a command the sandbox refuses to send (a NUL byte): this call's error
                text = f"error: {str(e).removeprefix('Sandbox.run: ')}"
                return self._record(call, args, True, decision.rule_id, text, 0.0), text
            text, ok = shell_text(r), r.error is None and not r.timed_out and r.exit_code == 0
            extra = {"exit_status": r.exit_code, "truncated": r.truncated, "sandbox_error": r.error,
                     "timed_out": r.timed_out}
        else:
            options = {"sql_mode": getattr(self.task, "sql_mode", "read_write")}
            reply = self.sandbox.tool(name, args, timeout=min(TOOL_TIMEOUT, left) + 5.0, **options)
            failed = "output" not in reply  # the sandbox's agent failed (died, bad reply): not the tool's answer
            text = reply.get("output") if not failed else f"[sandbox error: {reply.get('error')}]"
            if isinstance(reply.get("notice"), str):  # what a snapshot before this call could not keep
                text = f"{text}\n{notice_text(reply['notice'])}" if text else notice_text(reply["notice"])
            ok = bool(reply.get("ok")) and not failed
            extra = {"truncated": bool((reply.get("data") or {}).get("truncated")),
                     "sandbox_error": reply.get("error") if failed else None, "data": reply.get("data")}
        duration = time.monotonic() - t0
        self.tool_seconds += duration
        return self._record(call, args, True, decision.rule_id, text, duration, ok=ok, **extra), text

    def _record(self, call: dict, args: Any, allowed: bool, rule_id: str | None, text: str, duration: float, *,
                ok: bool = False, ran: bool = True, exit_status: int | None = None, truncated: bool = False,
                sandbox_error: str | None = None, timed_out: bool = False, data: dict | None = None) -> dict:
        name = call["function"]["name"]
        rec = {"id": call["id"], "name": name, "arguments": args if isinstance(args, dict) else {},
               "allowed": allowed, "rule_id": rule_id, "ran": ran and allowed, "ok": ok, "duration_s": duration,
               "output": text, "data": data or {}}
        if exit_status is not None:
            rec["exit_status"] = exit_status
        if timed_out:
            rec["timed_out"] = True
        if sandbox_error:
            rec["sandbox_error"] = sandbox_error
        if self.audit is not None:
            self.audit.record(episode=self.episode_id, step=self.steps, tool=name,
                              args=args if args is not None else call["function"].get("arguments"),
                              allowed=allowed, rule_id=rule_id, duration_s=round(duration, 6),
                              exit_status=exit_status, ok=ok, bytes_out=len(text.encode("utf-8", "replace")),
                              truncated=truncated, extra=None if ran else {"skipped": True})
        return rec

    def _reward(self, answer: Any) -> float:
        if self.task is None or not hasattr(self.task, "score"):
            return 0.0
        answer = answer if isinstance(answer, str) or answer is None else str(answer)
        return float(self.task.score(self.sandbox, answer))
