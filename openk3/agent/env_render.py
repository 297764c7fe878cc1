"""The token ids of an agent episode's conversation, kept exactly as a from-scratch render would give them.

    t = Transcript(tokenizer, tools, thinking=True, effort="high")
    t.start([{"role": "user", "content": "..."}])     # ids: tool-declare, effort, user, generation prompt
    msg = t.add_completion(ids)                        # the model's turn, parsed on ids, kept verbatim
    new = t.add_messages([tool messages], prompt=True) # the ids to append (loss mask 0)

Invariant (tests/test_agent_env.py): for a turn whose completion ids are the canonical encoding of its
message, `t.ids` equals `encode_segments(render(whole conversation))`. Two facts of the XTML renderer
(spec §7.2) make that hold while only the new part is rendered: every segment is tokenised on its own, so
ids of a prefix never change when more is appended; and the prompt's tool-declare and thinking-effort
messages come first, so a fragment rendered with no tools and no effort is exactly its messages' segments.
A tool message's `index` counts tool messages since the last assistant message, which is also what a
fragment that starts right after that assistant message counts.

Tool output is never structure: it goes through the renderer as message content, which is encoded with
special-token recognition off, so `<|open|>` in a file stays ordinary text ids (spec §7.1; test X1).
"""

from __future__ import annotations

import codecs
import json
from typing import Any

from openk3.chat import END_OF_MSG, StreamParser, encode_segments, marker_ids_of, render


class Transcript:
    """The conversation of one episode as messages and as ids (plus a per-id mask: 1 = model-generated)."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None, *, thinking: bool, effort: str | None) -> None:
        self.tok = tokenizer
        self.tools = tools or None
        self.thinking = thinking
        self.effort = effort if thinking else None
        self.messages: list[dict] = []
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.num_calls = 0  # tool calls so far: call ids are `call_<k>` over the whole conversation
        self.prompt_tail = 0  # ids of a trailing generation prompt no turn has answered yet
        self._markers = marker_ids_of(tokenizer)
        self._ends = {i for i, m in self._markers.items() if m == END_OF_MSG}

    # ---- state (for snapshot / fork) ---------------------------------------------------------------

    def state(self) -> dict:
        return {"messages": [dict(m) for m in self.messages], "ids": list(self.ids), "mask": list(self.mask),
                "num_calls": self.num_calls, "prompt_tail": self.prompt_tail}

    def load(self, state: dict) -> None:
        self.messages = [dict(m) for m in state["messages"]]
        self.ids, self.mask = list(state["ids"]), list(state["mask"])
        self.num_calls, self.prompt_tail = state["num_calls"], state["prompt_tail"]

    # ---- rendering ---------------------------------------------------------------------------------

    def request(self, messages: list[dict], *, prompt: bool = True) -> dict:
        """The renderer request for `messages` with this episode's tools and thinking settings."""
        req: dict[str, Any] = {"messages": messages, "thinking": self.thinking, "thinking_effort": self.effort,
                               "add_generation_prompt": prompt}
        if self.tools:
            req["tools"] = self.tools
        return req

    def _encode_fragment(self, messages: list[dict], prompt: bool) -> list[int]:
        req = {"messages": messages, "thinking": self.thinking, "thinking_effort": None,
               "add_generation_prompt": prompt}
        return encode_segments(render(req), self.tok).ids

    def start(self, messages: list[dict], *, prompt: bool = True) -> list[int]:
        """Begin the conversation: the full prompt ids, ending in the generation prompt if `prompt`."""
        self.messages = [dict(m) for m in messages]
        self.ids = encode_segments(render(self.request(self.messages, prompt=prompt)), self.tok).ids
        self.mask = [0] * len(self.ids)
        self.num_calls = 0
        self.prompt_tail = len(self._prompt_ids()) if prompt else 0
        return list(self.ids)

    def _prompt_ids(self) -> list[int]:
        return encode_segments(render({"messages": [], "thinking": self.thinking, "thinking_effort": None}),
                               self.tok).ids

    def add_messages(self, messages: list[dict], *, prompt: bool) -> list[int]:
        """Append non-assistant messages (tool results, a user turn) and, if `prompt`, the next generation
        prompt; returns the appended ids (mask 0). A generation prompt left unanswered at the end (a chat
        whose agent loop stopped after a tool turn) is replaced: the render has none there."""
        if self.prompt_tail:
            del self.ids[-self.prompt_tail:], self.mask[-self.prompt_tail:]
        new = self._encode_fragment([dict(m) for m in messages], prompt) if messages or prompt else []
        self.messages.extend(dict(m) for m in messages)
        self.ids.extend(new)
        self.mask.extend([0] * len(new))
        self.prompt_tail = len(self._prompt_ids()) if prompt else 0
        return new

    # ---- the model's turn --------------------------------------------------------------------------

    def add_completion(self, ids: list[int]) -> tuple[dict, bool]:
        """Append the model's turn given as generated ids (verbatim, mask 1), parsed on ids: a marker counts
        only as its control id, so text that spells `<|open|>` is text (test X2). Ids after the first
        end-of-message id are not part of the turn and are dropped. Returns (message, ended): `ended` is
        False when the ids stop before the message's end (max_tokens); they are appended all the same (RL
        may still want them), but the conversation cannot go on from there."""
        ids = [int(i) for i in ids]
        end = next((k for k, i in enumerate(ids) if i in self._ends), None)
        if end is not None:
            ids = ids[:end + 1]
        message = self._parse(ids)
        self._append_assistant(message, ids)
        return message, end is not None

    def add_message(self, message: dict) -> dict:
        """Append the model's turn given as an assistant message: its canonical ids (what the renderer gives)."""
        msg = {"role": "assistant", "content": message.get("content"),
               "reasoning_content": message.get("reasoning_content") or message.get("reasoning")}
        calls = message.get("tool_calls") or []
        if calls:
            msg["tool_calls"] = [self._call(k, c) for k, c in enumerate(calls)]
        # The renderer's assistant message starts with the generation prompt's own segments (the prompt
        # ends inside the first channel), so the turn's ids are what follows them.
        head = self._prompt_ids()
        whole = self._encode_fragment([msg], prompt=False)
        assert whole[:len(head)] == head, "the rendered assistant message does not start with the generation prompt"
        self._append_assistant(msg, whole[len(head):])
        return msg

    def _call(self, k: int, call: dict) -> dict:
        if not isinstance(call, dict):
            raise ValueError(f"step(action): tool_calls[{k}] must be an object, got {type(call).__name__}")
        fn = call.get("function", call)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"step(action): tool_calls[{k}] needs function.name")
        out = {"id": call.get("id") or f"call_{self.num_calls + k}", "type": "function",
               "function": {"name": fn["name"], "arguments": fn.get("arguments")}}
        if out["function"]["arguments"] is None:
            out["function"]["arguments"] = "{}"
        elif isinstance(out["function"]["arguments"], dict):  # OpenAI messages carry arguments as JSON text
            out["function"]["arguments"] = json.dumps(out["function"]["arguments"], ensure_ascii=False)
        return out

    def _parse(self, ids: list[int]) -> dict:
        parser = IdParser(self.tok, self.thinking, first_call=self.num_calls, marker_ids=self._markers)
        for tid in ids:
            parser.feed(tid)
        parser.finish()
        return parser.message()

    def _append_assistant(self, message: dict, ids: list[int]) -> None:
        assert self.prompt_tail, "an assistant turn must follow a generation prompt"
        self.prompt_tail = 0
        stored = {k: v for k, v in message.items() if k != "problems"}
        self.messages.append(stored)
        self.num_calls += len(stored.get("tool_calls") or [])
        self.ids.extend(ids)
        self.mask.extend([1] * len(ids))


def shell_text(result: Any) -> str:
    """The tool message for a Shell call: stdout, stderr, what the sandbox could not keep (an oversized
    exported variable, ...), then what ended it (exit code, timeout)."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.notice:
        parts.append(notice_text(result.notice))
    if result.error:
        parts.append(f"[sandbox error: {result.error}]")
    elif result.timed_out:
        parts.append(f"[timed out after {result.duration:.1f} s; the command was killed]")
    elif result.exit_code != 0:
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) if parts else "(no output)"


def notice_text(notice: str) -> str:
    return f"[sandbox notice: {notice}]"


class IdParser:
    """openk3.chat's StreamParser fed one generated id at a time (what LLM.chat does): markers by id only,
    other control ids skipped, a character split across ids decoded once complete. `feed` returns deltas."""

    def __init__(self, tokenizer: Any, thinking: bool, *, first_call: int = 0,
                 marker_ids: dict[int, str] | None = None) -> None:
        self.tok = tokenizer
        self.markers = marker_ids_of(tokenizer) if marker_ids is None else marker_ids
        self.parser = StreamParser(thinking, call_id=lambda n, name: f"call_{first_call + n}",
                                   marker_ids=self.markers)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tid: int) -> list[dict]:
        if tid in self.markers:
            rest = self.decoder.decode(b"", final=True)  # the bytes of a character a marker cut in two
            self.decoder.reset()
            deltas = self.parser.feed_token(-1, rest) if rest else []
            return deltas + self.parser.feed_token(tid, "")
        if self.tok.is_special(tid):  # other control ids ([BOS], reserved) carry no text
            return []
        return self.parser.feed_token(tid, self.decoder.decode(self.tok.decode_bytes([tid])))

    def finish(self) -> list[dict]:
        rest = self.decoder.decode(b"", final=True)
        deltas = self.parser.feed_token(-1, rest) if rest else []
        return deltas + self.parser.finish()

    def message(self) -> dict:
        """The assistant message (with `problems`; `tool_calls` only when there are calls)."""
        message = self.parser.message()
        if message["tool_calls"] is None:
            del message["tool_calls"]
        return message
