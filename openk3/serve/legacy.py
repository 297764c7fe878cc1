"""OpenAI's legacy function calling (`functions`, `function_call`, role `function`) as tools, both ways.

Before `tools` the API had `functions` (a list of function definitions), `function_call` ("none", "auto" or
{"name"}), assistant messages with one `function_call` {"name", "arguments"} and `function` messages with
its result. Clients still send them (older LangChain agents, some frameworks' fallbacks); the server never
drops them silently. A request is rewritten into the tools form the renderer knows:

    functions: [f, ...]           -> tools: [{"type": "function", "function": f}, ...]
    function_call: "auto"/"none"  -> tool_choice: "auto"/"none"
    function_call: {"name": N}    -> tool_choice: {"type": "function", "function": {"name": N}}
    assistant function_call: c    -> tool_calls: [{"id": "call_legacy_K", "type": "function", "function": c}]
    {"role": "function", ...}     -> {"role": "tool", "tool_call_id": the call before it, ...}

A request that declared `functions` is answered in the legacy shape too, as OpenAI does: one call at most
(`parallel_tool_calls` off), `message.function_call` / `delta.function_call` instead of `tool_calls`, and
finish_reason `function_call` instead of `tool_calls`. Mixing `functions` with `tools`, or `function_call`
with `tool_choice`, is a 400.
"""

from __future__ import annotations

from typing import Any

from openk3.serve.errors import bad_request
from openk3.serve.messages import check_name

FIELDS = ("functions", "function_call")


def _history(messages: list) -> list:
    """The messages with legacy calls and results rewritten (the others as they came)."""
    out, last_id = [], None
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("function_call") is not None:
            call = m["function_call"]
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                raise bad_request(f"{where}.function_call must be an object {{\"name\", \"arguments\"}}, got {call!r}",
                                  param=f"{where}.function_call")
            if m.get("tool_calls"):
                raise bad_request(f"{where} has both function_call and tool_calls: send one",
                                  param=f"{where}.function_call")
            last_id = f"call_legacy_{k}"
            m = {**{key: v for key, v in m.items() if key != "function_call"},
                 "tool_calls": [{"id": last_id, "type": "function", "function": call}]}
        elif isinstance(m, dict) and m.get("role") == "function":
            if last_id is None:
                raise bad_request(f"{where}: a function result needs an assistant message with a function_call "
                                  "before it", param=f"{where}.role")
            m = {"role": "tool", "tool_call_id": last_id, "content": m.get("content"),
                 **({"name": m["name"]} if m.get("name") is not None else {})}
            last_id = None
        out.append(m)
    return out


def translate(body: dict) -> bool:
    """Rewrite the legacy fields of a chat request into the tools form, in place. True when the answer
    must take the legacy shape (the request declared `functions` or set `function_call`)."""
    functions, choice = body.pop("functions", None), body.pop("function_call", None)
    if functions is not None:
        if body.get("tools") is not None:
            raise bad_request("functions and tools cannot be used together: send tools", param="functions")
        if not isinstance(functions, list):
            raise bad_request(f"functions must be a list of function definitions, got {functions!r}", param="functions")
        for i, f in enumerate(functions):
            if not isinstance(f, dict):
                raise bad_request(f"functions[{i}] must be a function definition object, got {f!r}",
                                  param=f"functions[{i}]")
            check_name(f.get("name"), f"functions[{i}].name")
        body["tools"] = [{"type": "function", "function": f} for f in functions]
    if choice is not None:
        if body.get("tool_choice") is not None:
            raise bad_request("function_call and tool_choice cannot be used together: send tool_choice",
                              param="function_call")
        if choice in ("auto", "none"):
            body["tool_choice"] = choice
        elif isinstance(choice, dict) and isinstance(choice.get("name"), str) and set(choice) == {"name"}:
            body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise bad_request(f"function_call must be \"auto\", \"none\" or {{\"name\": ...}}, got {choice!r}",
                              param="function_call")
    if isinstance(body.get("messages"), list):
        body["messages"] = _history(body["messages"])
    legacy = functions is not None or choice is not None
    if legacy:
        body["parallel_tool_calls"] = False  # the legacy shape carries one call
    return legacy


# ---- the answer in the legacy shape ------------------------------------------------------------------------


def finish_reason(reason: str | None) -> str | None:
    return "function_call" if reason == "tool_calls" else reason


def delta(d: dict) -> dict:
    """A stream delta: a whole tool call becomes `function_call` {"name", "arguments"}."""
    if "tool_calls" not in d:
        return d
    return {**{k: v for k, v in d.items() if k != "tool_calls"}, "function_call": d["tool_calls"][0]["function"]}


def answer(result: dict) -> dict:
    """A chat.completion with each choice's tool call as `message.function_call` (in place; returned)."""
    for choice in result["choices"]:
        msg: dict[str, Any] = choice["message"]
        calls = msg.pop("tool_calls", None)
        if calls:
            msg["function_call"] = calls[0]["function"]
        choice["finish_reason"] = finish_reason(choice["finish_reason"])
    return result
