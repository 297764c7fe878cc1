"""`openk3 serve` as real clients use it (issue 28 item 6): what broke five third-party clients, each tested with
the client that broke where it installs here, otherwise with the request body it sends.

- the official `openai` SDK and `langchain-openai` (a test dependency: it installs in about 10 s and 47 MB) run
  against a live server;
- litellm (252 MB), inspect-ai (176 MB) and kimi-cli (needs Python >= 3.12) do not install here: their
  requests are replayed as bodies in the shape their source builds (`RECORDED`: reconstructed from the
  clients' code and the issue's probe report, not captured on the wire).

Also here: the shapes of messages and tools as 400s naming the field path (probe C2, S2), the JSON nesting
bound (C3), legacy function calling, `GET /v1/models/{id}`, lenient `stream_options`, and a client that hangs
up mid-body. The server runs the nano model in an engine process (tests/serve_helpers.py), its name with a
`/` in it as hub ids have.
"""

from __future__ import annotations

import json
import logging
import socket

import httpx
import openai
import pytest
from serve_helpers import envelope, scripted_builder, served, sse_events, user, wait_until

from openk3.serve import create_app

MODEL = "openk3/nano-clients"
EFFORT = "openk3-reasoning-effort"
#: OpenAI's reasoning_effort values (and K3's own) -> the K3 effort the server uses (docs/serving.md).
EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max",
           "none": "none"}
READ_FILE = {"name": "ReadFile", "description": "Read a file.",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


@pytest.fixture(scope="module")
def server():
    app = create_app(scripted_builder(4), served_model_name=MODEL)
    with served(app) as url:
        yield url, app.state.openk3


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def chat(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, **body}, timeout=60, **kw)


# ---- reasoning effort (6a) ----------------------------------------------------------------------------------

def test_reasoning_effort_maps_openai_values_onto_k3_levels(client):
    def ask(**kw) -> tuple[str, int]:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=user("hi"), max_tokens=1, **kw)
        return raw.headers[EFFORT], raw.parse().usage.prompt_tokens

    tokens = {level: ask(reasoning_effort=level) for level in ("low", "high", "max")}
    assert {level: header for level, (header, _) in tokens.items()} == {"low": "low", "high": "high", "max": "max"}
    tokens = {level: n for level, (_, n) in tokens.items()}
    # byte tokenizer: the thinking-effort message says "high" in one byte more than "low" or "max"
    assert tokens["high"] == tokens["low"] + 1 == tokens["max"] + 1
    header, off = ask(extra_body={"chat_template_kwargs": {"thinking": False}})
    assert header == "none" and off < tokens["low"]
    tokens["none"] = off
    for value, level in EFFORTS.items():
        assert ask(reasoning_effort=value) == (level, tokens[level]), value
    assert ask(reasoning_effort=" Medium ") == ("high", tokens["high"])
    assert ask(reasoning_effort=None) == ("none", off)  # null is thinking off, as "none" (what kimi-cli sends)
    assert ask() == ("max", tokens["max"])  # none named, no --default-effort: K3's own default
    # thinking_effort and reasoning.effort take the same values; fields that agree after mapping are fine
    assert ask(extra_body={"thinking_effort": "xhigh"}) == ("max", tokens["max"])
    assert ask(extra_body={"reasoning": {"effort": "minimal"}}) == ("low", tokens["low"])
    assert ask(reasoning_effort="medium", extra_body={"thinking_effort": "high"}) == ("high", tokens["high"])
    # chat_template_kwargs are the template's own: null there omits the effort message, thinking stays on
    header, n = ask(extra_body={"chat_template_kwargs": {"thinking_effort": None}})
    assert header == "unspecified" and n < tokens["low"] and n != off
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=user("hi"), max_tokens=1,
                                                           stream=True, reasoning_effort="xhigh")
    assert raw.headers[EFFORT] == "max" and list(raw.parse())  # a stream says it before its first chunk


def test_unknown_or_conflicting_efforts_are_400s_naming_the_field(server):
    url, _ = server
    for body, param in (({"reasoning_effort": "huge"}, "reasoning_effort"),
                        ({"reasoning_effort": 3}, "reasoning_effort"),
                        ({"thinking_effort": ["low"]}, "thinking_effort"),
                        ({"reasoning": {"effort": "turbo"}}, "reasoning.effort"), ({"reasoning": "high"}, "reasoning"),
                        ({"reasoning_effort": "medium", "thinking_effort": "low"}, "thinking_effort"),
                        ({"reasoning_effort": None, "thinking": True}, "reasoning_effort"),
                        ({"chat_template_kwargs": {"thinking_effort": "medium"}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": 5}, "chat_template_kwargs"),
                        ({"enable_thinking": "yes"}, "enable_thinking")):
        err = envelope(chat(url, {"messages": user("hi"), **body}), 400, param=param)
        assert err["message"], body


# ---- models, stream options, legacy functions (6d) ---------------------------------------------------------

def test_models_retrieve_answers_the_served_model_and_404s_others(client, server):
    m = client.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "openk3")
    assert m.model_extra["max_model_len"] == server[1].max_model_len
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    envelope(httpx.get(server[0] + "/v1/models/openk3/other"), 404, param="model", code="model_not_found")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_options_accept_and_ignore_newer_fields(server, path):
    url, _ = server
    head = {"model": MODEL, "max_tokens": 2, "stream": True}
    head |= {"messages": user("hi")} if "chat" in path else {"prompt": "hi"}
    for options in ({"include_usage": True, "include_obfuscation": False},
                    {"include_usage": True, "continuous_usage_stats": True}, {"include_obfuscation": True}):
        with httpx.stream("POST", url + path, json={**head, "stream_options": options}, timeout=60) as r:
            assert r.status_code == 200, r.read()
            events = sse_events(r)
        assert events[-1] == "[DONE]" and ("usage" in events[-2]) == options.get("include_usage", False)
    envelope(httpx.post(url + path, json={**head, "stream_options": 5}), 400, param="stream_options")


def test_legacy_functions_are_translated_to_tools_and_answered_in_their_shape(client, server):
    url, _ = server
    r = client.chat.completions.create(model=MODEL, messages=user("#script:tool#"), max_tokens=200,
                                       functions=[READ_FILE], function_call="auto")
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "ReadFile"
    assert json.loads(choice.message.function_call.arguments) == {"path": "notes.txt"}
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("#script:tool#"), max_tokens=200,
                                                 functions=[READ_FILE], stream=True))
    calls = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert [c.name for c in calls] == ["ReadFile"] and chunks[-1].choices[0].finish_reason == "function_call"
    # the same request with tools renders the same prompt: the translation is exact
    as_tools = client.chat.completions.create(model=MODEL, messages=user("#script:tool#"), max_tokens=1,
                                              tools=[{"type": "function", "function": READ_FILE}], tool_choice="auto")
    assert as_tools.usage.prompt_tokens == r.usage.prompt_tokens
    # a legacy history (assistant function_call, role function) renders as its tools form
    call = {"name": "ReadFile", "arguments": '{"path": "a"}'}
    legacy = [*user("q"), {"role": "assistant", "content": None, "function_call": call},
              {"role": "function", "name": "ReadFile", "content": "text of a"}, *user("q2")]
    tools = [*user("q"), {"role": "assistant", "content": None,
                          "tool_calls": [{"id": "call_legacy_1", "type": "function", "function": call}]},
             {"role": "tool", "tool_call_id": "call_legacy_1", "name": "ReadFile", "content": "text of a"}, *user("q2")]
    assert chat(url, {"messages": legacy}).json()["usage"] == chat(url, {"messages": tools}).json()["usage"]
    for body, param in (({"functions": [READ_FILE], "tools": []}, "functions"), ({"functions": {"a": 1}}, "functions"),
                        ({"functions": [{"name": "bad name"}]}, "functions[0].name"),
                        ({"function_call": "always"}, "function_call"),
                        ({"function_call": "auto", "tool_choice": "auto"}, "function_call"),
                        ({"messages": [*user("q"), {"role": "function", "content": "x"}]}, "messages[1].role")):
        envelope(chat(url, {"messages": user("q"), **body}), 400, param=param)


# ---- message and tool shapes (C2, S2), nesting (C3) ---------------------------------------------------------

def _call(**function) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", **function}}


def test_message_and_tool_shapes_are_400s_naming_the_field(server):
    url, _ = server
    for msgs, param in (
            ([*user("q"), {"role": "assistant", "tool_calls": 1}], "messages[1].tool_calls"),
            ([*user("q"), {"role": "assistant", "tool_calls": [1]}], "messages[1].tool_calls[0]"),
            ([*user("q"), {"role": "assistant", "tool_calls": [_call(name=1)]}],
             "messages[1].tool_calls[0].function.name"),
            ([*user("q"), {"role": "assistant", "tool_calls": [_call(name=" ")]}],
             "messages[1].tool_calls[0].function.name"),
            ([*user("q"), {"role": "assistant", "tool_calls": [_call(arguments=5)]}],
             "messages[1].tool_calls[0].function.arguments"),
            ([*user("q"), {"role": "assistant", "tool_calls": [{**_call(), "type": "x"}]}],
             "messages[1].tool_calls[0].type"),
            ([{"role": "user", "content": 5}], "messages[0].content"),
            ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text"),
            ([{"role": "tool", "content": "x", "tool_call_id": 7}], "messages[0].tool_call_id"),
            ([{"role": "user", "content": "x", "name": []}], "messages[0].name"),
            ([{"role": "assistant", "content": "x", "reasoning_content": {}}], "messages[0].reasoning_content"),
            ([5], "messages[0]"), ([{"content": "x"}], "messages[0].role")):
        envelope(chat(url, {"messages": msgs}), 400, param=param)
    for tool, param in (({"type": "function", "function": {"name": 1}}, "tools[0].function.name"),
                        ({"type": "function", "function": {"name": "read file"}}, "tools[0].function.name"),
                        ({"type": "function", "function": {"name": "x" * 65}}, "tools[0].function.name"),
                        ({"type": "function", "function": {"name": ""}}, "tools[0].function.name"),
                        ({"type": "function", "function": {"name": "f", "parameters": 5}},
                         "tools[0].function.parameters"),
                        ({"type": "web", "function": {"name": "f"}}, "tools[0].type"), ("f", "tools[0]")):
        envelope(chat(url, {"messages": user("q"), "tools": [tool]}), 400, param=param)
    fine = [{"type": "function", "function": {"name": n}} for n in ("read.file", "a-b_C9", "1", "x" * 64)]
    assert chat(url, {"messages": user("q"), "tools": fine}).status_code == 200
    # What the renderer refuses is a 400 with its message (arguments that are JSON but not an object)
    err = envelope(chat(url, {"messages": [*user("q"), {"role": "assistant", "tool_calls": [_call(arguments="[1]")]}]}),
                   400, param="messages[1].tool_calls[0]")
    assert "arguments must be a JSON object" in err["message"]


def test_a_call_the_model_names_outside_the_declared_tools_is_delivered_as_written(client):
    other = {"type": "function", "function": {"name": "Other", "parameters": {"type": "object"}}}
    r = client.chat.completions.create(model=MODEL, messages=user("#script:tool#"), max_tokens=200, tools=[other])
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "ReadFile"


def _nested(depth: int) -> str:
    """A JSON schema `depth` objects deep, as text (json.dumps itself recurses too deep for the deepest)."""
    return '{"type": "object", "properties": {"x": ' * depth + '{"type": "string"}' + "}}" * depth


def _post_text(url: str, body: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", content=body.encode(), timeout=60,
                      headers={"content-type": "application/json"})


def test_deep_json_is_a_400_naming_the_limit_and_logs_no_traceback(server, caplog):
    url, _ = server
    caplog.set_level(logging.INFO)
    deep = _nested(300)  # 600 JSON levels: the parser takes it, the renderer's recursion broke (probe C3: ~490)
    head = f'{{"model": "{MODEL}", "max_tokens": 1, "messages": [{{"role": "user", "content": "q"}}], '
    tools = head + '"tools": [{"type": "function", "function": {"name": "f", "parameters": ' + deep + "}}]}"
    err = envelope(_post_text(url, tools), 400, param="tools", code="json_too_deep")
    assert "100 levels" in err["message"]
    rf = head + '"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": ' + deep + "}}}"
    envelope(_post_text(url, rf), 400, param="response_format", code="json_too_deep")
    far = b"[" * 100_000 + b"]" * 100_000  # deeper than the parser's own stack
    envelope(httpx.post(url + "/v1/completions", content=far), 400, code="json_too_deep")
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    realistic = {"type": "function", "function": {"name": "f", "parameters": json.loads(_nested(20))}}
    assert chat(url, {"messages": user("q"), "tools": [realistic]}).status_code == 200


def test_a_client_that_hangs_up_mid_body_logs_one_line_and_no_traceback(server, caplog):
    url, state = server
    caplog.set_level(logging.INFO)
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's "Exception in ASGI application" goes here
    uvicorn_log.addHandler(caplog.handler)
    try:
        port = int(url.rsplit(":", 1)[1])
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 1000\r\n\r\n{\"model\": ")
        wait_until(lambda: sum("disconnected" in r.getMessage() for r in caplog.records) == 3)
        assert httpx.get(url + "/health").status_code == 200
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert [r.levelno for r in caplog.records if "disconnected" in r.getMessage()] == [logging.INFO] * 3


# ---- the clients that broke (6e) ------------------------------------------------------------------------------

#: Request bodies in the shape each client builds (from its source; see the module docstring).
RECORDED = {
    # inspect-ai 0.3.285 (openai_compatible provider), GenerateConfig(reasoning_effort="medium"): one such flag
    # made every sample of an eval a 400
    "inspect-ai": {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                                {"role": "user", "content": "#script:text# What is 2+2?"}],
                   "max_tokens": 64, "reasoning_effort": "medium", "tool_choice": "auto",
                   "tools": [{"type": "function", "function": READ_FILE}]},
    # kimi-cli 1.52 (kosong's OpenAILegacy) with thinking switched off: reasoning_effort null, streamed with usage
    "kimi-cli": {"messages": [{"role": "system", "content": "You are Kimi CLI."},
                              {"role": "user", "content": "#script:tool# read notes.txt"}],
                 "tools": [{"type": "function", "function": READ_FILE}], "stream": True,
                 "stream_options": {"include_usage": True}, "reasoning_effort": None, "max_tokens": 200},
    # litellm 1.110 (openai-compatible route), reasoning_effort="minimal", stream_options passed through
    "litellm": {"messages": [{"role": "user", "content": "#script:text# hi"}], "stream": True, "max_tokens": 64,
                "reasoning_effort": "minimal", "stream_options": {"include_usage": True, "include_obfuscation": False}},
    # an agent framework's legacy fallback: functions / function_call
    "functions": {"messages": [{"role": "user", "content": "#script:tool# read notes.txt"}], "max_tokens": 200,
                  "functions": [READ_FILE], "function_call": "auto"},
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_client_requests_are_served(server, name):
    url, _ = server
    body = {"model": MODEL, **RECORDED[name]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        effort = r.headers[EFFORT]
        events = sse_events(r) if body.get("stream") else [json.loads(r.read())]
    assert effort == {"inspect-ai": "high", "kimi-cli": "none", "litellm": "low", "functions": "max"}[name]
    if body.get("stream"):
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] > 0
        finish = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]][-1]
    else:
        finish = events[0]["choices"][0]["finish_reason"]
    expected = {"inspect-ai": "stop", "kimi-cli": "tool_calls", "litellm": "stop", "functions": "function_call"}
    assert finish == expected[name]


def test_langchain_openai_chat_model(server):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    url, _ = server
    llm = ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60,
                     reasoning_effort="medium", max_tokens=200)
    reply = llm.bind_tools([{"type": "function", "function": READ_FILE}]).invoke([HumanMessage("#script:tool#")])
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("ReadFile", {"path": "notes.txt"})]
    assert reply.response_metadata["finish_reason"] == "tool_calls" and reply.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream([HumanMessage("#script:text#")], stream_usage=True))
    text = "".join(c.content for c in chunks if isinstance(c.content, str))
    assert text == "Hello world. Bye" and sum((c.usage_metadata or {}).get("output_tokens", 0) for c in chunks) > 0
