"""`POST /v1/chat/completions`: render the messages in XTML, generate, parse the output on token ids.

The prompt is `openk3.chat.render` + `encode_segments` (as `LLM.chat_prompt`): roles system, developer
(rendered as system), user, assistant (its `reasoning_content` or `reasoning` goes back in the history),
tool; `tools`, `tool_choice`, `response_format` and thinking on/off are the renderer's; OpenAI's effort values
are mapped onto K3's low|high|max first (`effort.py`), message and tool shapes checked (`messages.py`) and
legacy `functions` translated (`legacy.py`). `response_format` json_object / json_schema, a named or
`required` `tool_choice` and strict tools are also decoded under a grammar (`openk3/serve/grammar.py`). Each
choice's completion is parsed token by token by `ChoiceParser` (a `StreamParser` fed ids, so only real control
tokens are markers) into `reasoning_content` (mirrored as `reasoning`), `content` and whole `tool_calls`.

Stop strings apply to the visible `content` only, never to the thinking channel (next-agents-serving.md
§3.3): the engine gets no stop strings; the parser's content is matched here, held back while its tail
could still begin a stop string, and the choice ends (its engine request aborted) at a match.
"""

from __future__ import annotations

import codecs
import json
import re
import secrets
import time
from dataclasses import replace
from typing import Any

from openk3.chat import StreamParser, encode_segments, marker_ids_of, render, resolve_thinking
from openk3.chat.xtml import CLOSE
from openk3.serve import effort, grammar, legacy, messages, protocol
from openk3.serve.errors import bad_request
from openk3.serve.outputs import KEEPALIVE, Collector, EngineFailed, chat_logprobs, error_frame, new_id, sse

FIELDS = protocol.SAMPLING_FIELDS + (
    "logprobs", "top_logprobs", "messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "reasoning_effort", "thinking_effort", "reasoning", "thinking", "enable_thinking",
    "chat_template_kwargs", "include_reasoning") + legacy.FIELDS


class StopMatcher:
    """Finds the first stop string in text that arrives in pieces; holds back a tail that could begin one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.buffer = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that is safe to show now (everything before a stop string, once found)."""
        if not self.stops:
            return text
        if self.stopped:
            return ""
        self.buffer += text
        hits = [i for i in (self.buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buffer, self.stopped = self.buffer[:min(hits)], "", True
            return out
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.buffer.endswith(s[:k])), default=0)
        out, self.buffer = self.buffer[:len(self.buffer) - hold], self.buffer[len(self.buffer) - hold:]
        return out

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out


class ChoiceParser:
    """One choice's completion, fed token ids -> OpenAI deltas (`reasoning_content`+`reasoning`, `content`,
    whole `tool_calls`)."""

    def __init__(self, tok, thinking: bool, *, stops: tuple[str, ...], tool_choice: Any, parallel: bool,
                 include_reasoning: bool, logprobs: bool = False) -> None:
        self.tok = tok
        self.markers = marker_ids_of(tok)
        self.close_id = next((i for i, m in self.markers.items() if m == CLOSE), None)
        # Tool call ids: "call_" + 24 random hex digits, unique per response (XTML carries no ids).
        self.parser = StreamParser(thinking, marker_ids=self.markers,
                                   call_id=lambda n, name: f"call_{secrets.token_hex(12)}")
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = StopMatcher(stops)
        self.drop_calls = tool_choice == "none"
        self.parallel = parallel
        self.include_reasoning = include_reasoning
        self.in_think = thinking
        self.reasoning_tokens = 0
        self.tokens = 0
        self.calls: list[dict] = []  # every call the parser started: id, name, arguments so far
        self.sent_calls = 0  # calls delivered (or passed over) so far
        self.delivered: list[dict] = []
        self.reasoning: list[str] = []
        self.content: list[str] = []
        # logprobs.content items, one per token counted in `tokens` (all channels); none without
        # include_reasoning, whose token texts would show the hidden reasoning (design §3.5, as vLLM).
        self.logprobs: list[dict] | None = [] if logprobs and include_reasoning else None
        self.sent_logprobs = 0

    # ---- feeding --------------------------------------------------------------------------------

    def feed(self, ids: list[int], logprobs: list | None = None) -> list[dict]:
        """Deltas for the new token ids; `logprobs` (the engine's entries for them) are kept for
        `logprobs_delta`."""
        deltas: list[dict] = []
        for j, tid in enumerate(ids):
            if self.stop.stopped:
                break
            self.tokens += 1
            if self.logprobs is not None and logprobs is not None:
                self.logprobs += chat_logprobs(self.tok, [tid], [logprobs[j]])
            if self.in_think:
                self.reasoning_tokens += 1
                if tid == self.close_id:  # the first <|close|> ends the thinking channel
                    self.in_think = False
            if tid in self.markers:
                rest = self.decoder.decode(b"", final=True)  # bytes of a character cut by the marker
                self.decoder.reset()
                if rest:
                    self._take(self.parser.feed_token(-1, rest), deltas)
                self._take(self.parser.feed_token(tid, ""), deltas)
            elif not self.tok.is_special(tid):  # other control ids ([BOS], reserved) carry no text
                self._take(self.parser.feed_token(tid, self.decoder.decode(self.tok.decode_bytes([tid]))), deltas)
        return deltas

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """Flush at the end of the output; returns the last deltas and the OpenAI finish_reason."""
        deltas: list[dict] = []
        if not self.stop.stopped:
            rest = self.decoder.decode(b"", final=True)
            if rest:
                self._take(self.parser.feed_token(-1, rest), deltas)
            if finish_reason == "length":
                # A call still open at the cap is not delivered (its arguments are not a whole JSON object
                # before the parser closes it for us).
                if self.calls and not _whole_json(self.calls[-1]["arguments"]):
                    self.calls[-1]["cut"] = True
            self._take(self.parser.finish(), deltas)
            text = self.stop.flush()
            if text:
                self._text("content", text, deltas)
        self._release_calls(len(self.calls), deltas)
        if self.stop.stopped:
            return deltas, "stop"
        if self.delivered:
            return deltas, "tool_calls"
        return deltas, "length" if finish_reason == "length" else "stop"

    def _take(self, parsed: list[dict], deltas: list[dict]) -> None:
        for d in parsed:
            if "reasoning_content" in d:
                self._text("reasoning", d["reasoning_content"], deltas)
            elif "content" in d:
                if not self.stop.stopped:
                    self._text("content", self.stop.feed(d["content"]), deltas)
            elif "tool_calls" in d:
                for part in d["tool_calls"]:
                    if "id" in part:  # a new call: every earlier one is complete
                        self._release_calls(part["index"], deltas)
                        self.calls.append({"id": part["id"], "name": part["function"]["name"], "arguments": ""})
                    self.calls[part["index"]]["arguments"] += part["function"].get("arguments", "")

    def _text(self, key: str, text: str, deltas: list[dict]) -> None:
        if not text:
            return
        if key == "reasoning":
            self.reasoning.append(text)
            if not self.include_reasoning:
                return
            delta = {"reasoning_content": text, "reasoning": text}
        else:
            self.content.append(text)
            delta = {"content": text}
        last = deltas[-1] if deltas else None
        if last is not None and last.keys() == delta.keys():
            for k in delta:
                last[k] += text
        else:
            deltas.append(delta)

    def _release_calls(self, upto: int, deltas: list[dict]) -> None:
        while self.sent_calls < upto:
            call = self.calls[self.sent_calls]
            self.sent_calls += 1
            if call.get("cut") or self.drop_calls or (self.delivered and not self.parallel):
                continue
            whole = {"index": len(self.delivered), "id": call["id"], "type": "function",
                     "function": {"name": call["name"], "arguments": _compact(call["arguments"])}}
            self.delivered.append(whole)
            deltas.append({"tool_calls": [whole]})

    def logprobs_delta(self) -> dict | None:
        """The logprobs of the tokens fed since the last call, for the next chunk of this choice (a token that
        produced no delta of its own, a marker or held-back text, rides on the next chunk)."""
        if not self.logprobs or self.sent_logprobs == len(self.logprobs):
            return None
        new, self.sent_logprobs = self.logprobs[self.sent_logprobs:], len(self.logprobs)
        return {"content": new}

    def message(self) -> dict:
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not self.delivered else None}
        reasoning = "".join(self.reasoning)
        if reasoning and self.include_reasoning:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if self.delivered:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.delivered]
        return msg


def _whole_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _compact(arguments: str) -> str:
    """Arguments as a compact JSON object string (the parser keeps non-string values' text as the model
    wrote it; only the separators change)."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        return arguments


# ---- the endpoint ---------------------------------------------------------------------------------


def prepare(state, body: dict) -> dict:
    """Check the request and build everything generation needs; every mistake is a 400 naming it."""
    protocol.check_fields(body, FIELDS)
    legacy_shape = legacy.translate(body)
    messages.check_messages(body.get("messages"))
    messages.check_tools(body.get("tools"))
    tool_choice = body.get("tool_choice")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") in ("text", "json_object", "json_schema")):
        raise bad_request(f"response_format must be {{\"type\": \"text\"|\"json_object\"|\"json_schema\"}}, got {rf!r}",
                          param="response_format")
    common = protocol.common(body, state.vocab_size, max_tokens_names=("max_completion_tokens", "max_tokens"),
                             default_max_tokens=state.default_max_tokens)
    protocol.check_capacity(common.n, state.loop.capacity, "n")
    thinking_keys = effort.render_keys(body, state.default_effort)
    request = {k: body[k] for k in ("messages", "tools", "tool_choice", "response_format") if body.get(k) is not None}
    if tool_choice is not None:
        request["tool_choice"] = grammar.shown_tool_choice(tool_choice)
    try:
        thinking, _ = resolve_thinking(request | thinking_keys)
        prompt = encode_segments(render(request | thinking_keys), state.tok).ids
    except ValueError as e:  # what the renderer cannot render: its message names the field
        raise bad_request(str(e), param=_field_path(str(e))) from None
    common.params = replace(common.params, logprobs=protocol.chat_logprobs(body), logprobs_mode=state.logprobs_mode)
    params = common.capped(len(prompt), state.max_model_len, "messages")
    parallel = protocol.boolean(body, "parallel_tool_calls", True)
    params = replace(params, structured=grammar.chat(state, body, thinking, parallel))
    return {"common": common, "prompt": prompt, "thinking": thinking, "params": params,
            "tool_choice": tool_choice, "parallel": parallel,
            "include_reasoning": protocol.boolean(body, "include_reasoning", True), "legacy": legacy_shape,
            "headers": {effort.HEADER: effort.used(thinking_keys)}}


def _field_path(message: str) -> str | None:
    """The field a renderer message starts with (`messages[1].tool_calls[0]`, `tools[2]`), as a `param`."""
    found = re.match(r"(messages|tools)(\[\d+\]|\.\w+)*", message)
    return found.group(0) if found else None


def start(state, job: dict) -> tuple[Collector, list[ChoiceParser]]:
    common = job["common"]
    plist = protocol.choice_params(job["params"], common.n)
    # The engine gets no stop strings: they apply to the content channel, matched by ChoiceParser.
    collector = Collector(state.loop, [(job["prompt"], replace(p, stop=())) for p in plist],
                          stop_token_ids=common.stop_token_ids, ignore_eos=common.ignore_eos)
    parsers = [ChoiceParser(state.tok, job["thinking"], stops=common.params.stop, tool_choice=job["tool_choice"],
                            parallel=job["parallel"], include_reasoning=job["include_reasoning"],
                            logprobs=common.params.logprobs is not None)
               for _ in range(common.n)]
    return collector, parsers


def _usage(job: dict, parsers: list[ChoiceParser]) -> dict:
    return protocol.usage(len(job["prompt"]), sum(p.tokens for p in parsers),
                          sum(p.reasoning_tokens for p in parsers))


async def complete(state, job: dict, model: str) -> dict:
    collector, parsers = start(state, job)
    reasons: dict[int, str] = {}
    try:
        async for k, out in collector.outputs():
            p = parsers[k]
            failed = grammar.failure(out, job["params"].structured)
            if failed is not None:
                raise failed
            p.feed(out.delta_token_ids, out.delta_logprobs)
            if p.stop.stopped:
                collector.finish_early(k)
            if out.finished or p.stop.stopped:
                reasons[k] = p.finish(out.finish_reason or "stop")[1]
    except EngineFailed as e:
        raise e.api_error() from None
    finally:
        collector.close()
    result = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
              "choices": [{"index": k, "message": p.message(),
                           "logprobs": None if p.logprobs is None else {"content": p.logprobs},
                           "finish_reason": reasons[k]} for k, p in enumerate(parsers)],
              "usage": _usage(job, parsers)}
    return legacy.answer(result) if job["legacy"] else result


async def stream(state, job: dict, model: str):
    """The SSE body: role chunk per choice, deltas, a finish chunk per choice, optional usage, [DONE]."""
    collector, parsers = start(state, job)  # before the first byte: a full queue is still a 429
    head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(k: int, delta: dict, finish: str | None = None) -> str:
        if job["legacy"]:
            delta, finish = legacy.delta(delta), legacy.finish_reason(finish)
        return sse({**head, "choices": [{"index": k, "delta": delta, "logprobs": parsers[k].logprobs_delta(),
                                         "finish_reason": finish}]})

    async def body():
        try:
            for k in range(len(parsers)):
                yield chunk(k, {"role": "assistant", "content": ""})
            try:
                async for k, out in collector.outputs(state.sse_keepalive_s):
                    if out is None:
                        yield KEEPALIVE
                        continue
                    p = parsers[k]
                    failed = grammar.failure(out, job["params"].structured)
                    if failed is not None:
                        yield grammar.error_event(failed)
                        break
                    for d in p.feed(out.delta_token_ids, out.delta_logprobs):
                        yield chunk(k, d)
                    if p.stop.stopped:
                        collector.finish_early(k)
                    if out.finished or p.stop.stopped:
                        deltas, reason = p.finish(out.finish_reason or "stop")
                        for d in deltas:
                            yield chunk(k, d)
                        yield chunk(k, {}, reason)
            except EngineFailed as e:
                yield error_frame(e)
            else:
                if job["common"].include_usage:
                    yield sse({**head, "choices": [], "usage": _usage(job, parsers)})
            yield sse("[DONE]")
        finally:  # also on a client disconnect (Starlette cancels this generator): free the slots now
            collector.close()

    return body()
