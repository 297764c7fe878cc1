"""The shapes of a chat request's `messages` and `tools`, checked before rendering: a 400 naming the field path.

The renderer (`openk3.chat.render`) raises ValueError for what it cannot render; these checks come first so
that a wrong type anywhere in a message (`"tool_calls": 1`, a name that is a number, a content part that is
an image) is a 400 whose `param` is the path of the field, e.g. `messages[1].tool_calls`, and never reaches
code that would fail on it with a TypeError. They check types and the protocol's rules only; what a value
means (roles, tool results matching calls) is the renderer's.

Declared tool names follow OpenAI's rule (`^[a-zA-Z0-9_-]{1,64}$`) with `.` also allowed, as openk3's own
agent tools allow it (`openk3.agent.tools.TOOL_NAME`). The name of a past call in the history need only be a
non-blank string: it is what the model wrote (a name the model emits is not checked against the declared
tools; docs/serving.md), and clients send it back as it came.
"""

from __future__ import annotations

import re
from typing import Any

from openk3.serve.errors import bad_request

TOOL_NAME = re.compile(r"[a-zA-Z0-9_.-]{1,64}")
ROLES = ("system", "developer", "user", "assistant", "tool")


def _need(ok: bool, param: str, rule: str, value: Any) -> None:
    if not ok:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise bad_request(f"{param} must be {rule}, got {shown}", param=param)


def _optional_str(obj: dict, key: str, where: str) -> None:
    if obj.get(key) is not None:
        _need(isinstance(obj[key], str), f"{where}.{key}", "a string", obj[key])


def check_name(name: Any, param: str) -> None:
    _need(isinstance(name, str) and TOOL_NAME.fullmatch(name) is not None, param,
          "a string of 1-64 letters, digits, '_', '-' or '.'", name)


def _check_content(content: Any, where: str) -> None:
    _need(content is None or isinstance(content, (str, list)), where, "a string, null or a list of parts", content)
    for j, part in enumerate(content if isinstance(content, list) else ()):
        at = f"{where}[{j}]"
        if isinstance(part, str):
            continue
        _need(isinstance(part, dict), at, "a content part object", part)
        # The renderer can place image tokens, but this server has no vision input to fill them.
        if part.get("type", "text") != "text":
            raise bad_request(f"{at}: content part type {part.get('type')!r} is not supported (text only)",
                              param=f"{at}.type")
        _need(isinstance(part.get("text"), str), f"{at}.text", "a string", part.get("text"))


def _check_call(call: Any, where: str) -> None:
    _need(isinstance(call, dict), where, "an object {\"id\", \"type\": \"function\", \"function\"}", call)
    _optional_str(call, "id", where)
    if call.get("type") is not None:
        _need(call["type"] == "function", f"{where}.type", "\"function\"", call["type"])
    fn, at = (call["function"], f"{where}.function") if "function" in call else (call, where)
    _need(isinstance(fn, dict), at, "an object {\"name\", \"arguments\"}", fn)
    # Any non-blank string: a past call's name is what the model wrote, which the client sends back as it came.
    _need(isinstance(fn.get("name"), str) and fn["name"].strip() != "", f"{at}.name", "a non-blank string",
          fn.get("name"))
    args = fn.get("arguments")
    _need(args is None or isinstance(args, (str, dict)), f"{at}.arguments", "a JSON object string", args)


def check_messages(messages: Any) -> None:
    """Every message's fields have the protocol's types; an assistant's `reasoning` is copied to
    `reasoning_content` (both spellings come back in histories; the renderer reads the latter)."""
    _need(isinstance(messages, list) and len(messages) > 0, "messages", "a non-empty list", messages)
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        _need(isinstance(m, dict), where, "an object with a role", m)
        _need(isinstance(m.get("role"), str) and m["role"] in ROLES, f"{where}.role", f"one of {', '.join(ROLES)}",
              m.get("role"))
        _check_content(m.get("content"), f"{where}.content")
        for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            _optional_str(m, key, where)
        calls = m.get("tool_calls")
        if calls is not None:
            _need(isinstance(calls, list), f"{where}.tool_calls", "a list of tool calls", calls)
            for j, call in enumerate(calls):
                _check_call(call, f"{where}.tool_calls[{j}]")
        if m["role"] == "assistant" and "reasoning" in m and "reasoning_content" not in m:
            messages[k] = {**m, "reasoning_content": m["reasoning"]}


def check_tools(tools: Any) -> None:
    """`tools`: a list of {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    if tools is None:
        return
    _need(isinstance(tools, list), "tools", "a list of {\"type\": \"function\", \"function\": {...}}", tools)
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        _need(isinstance(tool, dict), where, "an object {\"type\": \"function\", \"function\": {...}}", tool)
        _need(tool.get("type") == "function", f"{where}.type", "\"function\"", tool.get("type"))
        fn = tool.get("function")
        _need(isinstance(fn, dict), f"{where}.function", "an object {\"name\", \"parameters\"}", fn)
        check_name(fn.get("name"), f"{where}.function.name")
        _optional_str(fn, "description", f"{where}.function")
        params = fn.get("parameters")
        _need(params is None or isinstance(params, dict), f"{where}.function.parameters", "a JSON schema object",
              params)
