"""Property test of the HTTP API (issue 16 item 6): whatever a client sends, the server answers no 5xx.

The request bodies are validated by hand (openk3/serve/protocol.py, chat.py, completions.py), so
/openapi.json does not describe them and schemathesis has nothing to read; these hypothesis strategies
build the bodies from the documented fields instead (protocol.SAMPLING_FIELDS and each endpoint's FIELDS,
the field table of docs/serving.md) with values of every JSON type, odd message lists, raw garbage bodies
and odd paths and methods. Every case goes to ONE live server (tests/serve_helpers.py `served`), and:

- the status is never >= 500;
- every 4xx body is exactly the OpenAI error envelope with a non-empty message;
- every 200 is a well-formed completion, or an SSE stream that ends in [DONE];
- GET /health is 200 after each case, and nothing is left running at the end.

`max_tokens` is forced small (<= 4) in most bodies, or set to a value the server must refuse, so that an
accepted request never runs long: a valid large or absent one would generate up to the context length.
derandomize=True: CI sees the same examples every run. allow_subnormal=False: torch's import switches the
CPU to flush subnormals to zero, and hypothesis refuses to draw them then.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import scripted_builder, served, wait_until

from openk3.serve import chat, completions, create_app, protocol

MODEL = "nano-test"
FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def server():
    app = create_app(scripted_builder(4, script=False), served_model_name=MODEL)  # the engine in its own process
    with served(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        state = app.state.openk3
        yield http, state
        wait_until(lambda: state.loop.in_flight() == 0 and state.metrics.running == 0, timeout=10)


# ---- values of every JSON type -----------------------------------------------------------------------

EDGE_INTS = st.sampled_from([0, -1, 1, 2, 4, 8, 9, 20, 21, 511, 512, 2**31, 2**63, -(2**63), 10**30])
EDGE_STRINGS = st.sampled_from(["", " ", "NaN", "nan", "Infinity", "-Infinity", "null", "true", "0", "-1", "1e999",
                                "\x00", "\ud7ff", "é🙂中", "<|open|>", "<|end_of_msg|>", "#script:text#", "a" * 3000])
scalars = st.one_of(
    st.none(), st.booleans(), EDGE_INTS, st.integers(-10, 10),
    st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False),
    st.sampled_from([0.0, -0.0, 1e308, -1e308, 5e-324]),
    EDGE_STRINGS, st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


ON_OFF = st.sampled_from([True, False])  # st.booleans() leans to False: a switch would rarely be on


def field_values(name: str, wild: bool) -> st.SearchStrategy:
    """A wild body takes any JSON value for any field; a tame one values that pass (or nearly pass) the field's
    check, so that the checks after the first one, the template and the engine run too."""
    tame = {
        "temperature": st.floats(0, 2, allow_subnormal=False), "top_p": st.floats(0.01, 1, allow_subnormal=False),
        "min_p": st.floats(0, 1, allow_subnormal=False), "top_k": st.integers(-1, 600), "seed": EDGE_INTS,
        "n": st.integers(1, 3), "best_of": st.integers(1, 3),
        "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
        "stop_token_ids": st.lists(st.integers(0, 511), max_size=3),
        "repetition_penalty": st.floats(0.5, 2, allow_subnormal=False),
        "stream": ON_OFF, "ignore_eos": ON_OFF, "echo": ON_OFF,
        "logprobs": st.one_of(ON_OFF, st.integers(0, 5)), "top_logprobs": st.integers(0, 5),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": ON_OFF, "include_obfuscation": ON_OFF,
                                                              "continuous_usage_stats": ON_OFF}),
        "model": st.just(MODEL), "prompt": tame_prompts, "presence_penalty": st.just(0),
        "frequency_penalty": st.just(0), "logit_bias": st.just({}), "user": st.text(max_size=10),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "reasoning_effort": st.sampled_from(["minimal", "low", "medium", "high", "xhigh", "max", "none", None, "x"]),
        "thinking_effort": st.sampled_from(["low", "medium", "high", "x"]),
        "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "medium", None, "x"])}),
        "functions": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "read.file", "bad name"])},
                                                    optional={"parameters": json_values}), max_size=2),
        "function_call": st.sampled_from(["auto", "none", {"name": "f"}, "x"]),
        "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}),
        "tools": st.lists(tools, max_size=2), "messages": tame_messages, "parallel_tool_calls": ON_OFF,
        "enable_thinking": ON_OFF, "include_reasoning": ON_OFF,
        "thinking": ON_OFF | st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}),
        "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": ON_OFF}),
    }.get(name)
    if wild or tame is None:
        return {"messages": wild_messages, "prompt": wild_prompts}.get(name, json_values)
    return tame


tame_prompts = st.one_of(st.text(min_size=1, max_size=60), st.lists(st.integers(0, 511), min_size=1, max_size=8),
                         st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2))
wild_prompts = st.one_of(st.text(max_size=60), st.lists(st.integers(-2, 600), max_size=8), json_values,
                         st.lists(st.one_of(st.text(max_size=10), st.lists(st.integers(-2, 600), max_size=4)),
                                  max_size=3))
tools = st.one_of(json_values, st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "x"])},
    optional={"function": st.fixed_dictionaries({"name": st.text(max_size=10)},
                                                 optional={"description": json_values, "parameters": json_values})}))
good_call = st.fixed_dictionaries({"id": st.text(max_size=6), "type": st.just("function"), "function":
                                   st.fixed_dictionaries({"name": st.text(min_size=1, max_size=8),
                                                          "arguments": st.sampled_from(['{"a": 1}', "{}"])})})
odd_call = st.one_of(json_values, st.fixed_dictionaries(
    {}, optional={"id": json_values, "type": st.sampled_from(["function", "x"]) | json_values,
                  "function": st.one_of(json_values, st.fixed_dictionaries(
                      {}, optional={"name": json_values | st.text(max_size=8),
                                    "arguments": json_values | st.sampled_from(['{"a": 1}', "{", "[]"])}))}))
content_parts = st.lists(st.one_of(json_values, st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "x"])}, optional={"text": json_values | st.text(max_size=20)})),
    max_size=3)
ROLES = ["system", "developer", "user", "assistant", "tool"]
tame_message = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES), "content": st.one_of(st.text(max_size=60), st.none(), st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), max_size=2))},
    optional={"tool_calls": st.lists(st.one_of(good_call, odd_call), max_size=2), "tool_call_id": st.text(max_size=6),
              "reasoning_content": st.text(max_size=20), "name": st.text(max_size=6)})
wild_message = st.fixed_dictionaries(
    {}, optional={"role": st.sampled_from([*ROLES, "function", "robot"]) | json_values,
                  "content": st.one_of(st.text(max_size=60), content_parts, json_values),
                  "reasoning_content": json_values, "reasoning": json_values, "name": json_values,
                  "tool_calls": st.lists(odd_call, max_size=3), "tool_call_id": json_values})
tame_messages = st.lists(tame_message, min_size=1, max_size=4)
wild_messages = st.one_of(st.lists(st.one_of(tame_message, wild_message), max_size=4), json_values)


@st.composite
def bodies(draw, fields: tuple[str, ...], required: tuple[str, ...]) -> dict:
    # hypothesis favours 0 and the bounds, so the rarer branches are keyed to an inner value
    wild = draw(st.integers(0, 2)) == 1  # about a third wild
    # a wrong model is refused before anything else is read, so the required fields stay tame but for a few
    body = {name: draw(field_values(name, wild and name != "model")) for name in required
            if draw(st.integers(0, 19)) != 7}
    # which optional fields (0 to 8 of them): a seeded Random spreads the choice over all of them better than
    # hypothesis's own list draws, which repeat a few fields
    rng = draw(st.randoms(use_true_random=False))
    for name in rng.sample(fields, rng.randint(0, 8)):
        body[name] = draw(field_values(name, wild))
    if not wild and rng.randint(0, 3) == 1:  # stream about a quarter of the tame bodies: the SSE path has its own code
        body["stream"] = True
    body.update(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=2)))  # unknown keys, ignored
    # keep every accepted request short: a small max_tokens (chat: or max_completion_tokens, its newer name),
    # or one the server must refuse
    body.pop("max_tokens", None)
    body.pop("max_completion_tokens", None)
    limit = "max_completion_tokens" if "max_completion_tokens" in fields and rng.randint(0, 3) == 0 else "max_tokens"
    refused = st.sampled_from([0, -1, 2**63, 1.5, "2", True, [], {}])
    body[limit] = draw(refused if draw(st.integers(0, 5)) == 3 else st.integers(1, 4))
    return body


chat_bodies = bodies(chat.FIELDS, ("model", "messages"))
completion_bodies = bodies(completions.FIELDS, ("model", "prompt"))


# ---- what every answer must look like ------------------------------------------------------------------

def check_envelope(r: httpx.Response) -> None:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and (error["param"] is None or isinstance(error["param"], str)), body
    assert error["code"] is None or isinstance(error["code"], str), body


def check_completion(r: httpx.Response, kind: str, stream: bool) -> None:
    if stream:
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert data and data[-1] == "[DONE]", r.text[-500:]
        for event in data[:-1]:
            chunk = json.loads(event)
            # no error frame either: that is how a stream reports a server-side failure after its 200
            assert "error" not in chunk and chunk["object"] == (f"{kind}.chunk" if kind == "chat.completion"
                                                                 else kind), chunk
        return
    body = r.json()
    assert body["object"] == kind and body["choices"] and isinstance(body["usage"]["completion_tokens"], int), body
    for choice in body["choices"]:
        assert choice["finish_reason"] in ("stop", "length", "tool_calls", "function_call"), choice
        assert (isinstance(choice["message"]["content"], (str, type(None))) if kind == "chat.completion"
                else isinstance(choice["text"], str)), choice


def check(http: httpx.Client, r: httpx.Response, kind: str | None = None, stream: bool = False) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:2000])
    if r.status_code >= 400:
        check_envelope(r)
    elif kind is not None:
        assert r.status_code == 200, r.text[:2000]
        check_completion(r, kind, stream)
    assert http.get("/health").status_code == 200


def post(http: httpx.Client, path: str, body) -> tuple[httpx.Response, bool]:
    stream = isinstance(body, dict) and body.get("stream") is True
    return http.post(path, json=body), stream


# ---- the properties ---------------------------------------------------------------------------------

@FUZZ
@given(body=chat_bodies)
def test_chat_bodies_never_5xx(server, body):
    http, _ = server
    r, stream = post(http, "/v1/chat/completions", body)
    check(http, r, "chat.completion", stream)


@FUZZ
@given(body=completion_bodies)
def test_completion_bodies_never_5xx(server, body):
    http, _ = server
    r, stream = post(http, "/v1/completions", body)
    check(http, r, "text_completion", stream)


ENDPOINTS = {"/v1/chat/completions": ("chat.completion", chat.FIELDS, {"messages": [{"role": "user", "content": "x"}]}),
             "/v1/completions": ("text_completion", completions.FIELDS, {"prompt": "x"})}


@settings(FUZZ, max_examples=60)
@given(data=st.data(), path=st.sampled_from(sorted(ENDPOINTS)))
def test_each_field_alone_never_5xx(server, data, path):
    """One field at a time, tame, on an otherwise valid body: the random mixes above can miss a field's
    accepted path (most of them are refused by some other field first)."""
    http, _ = server
    kind, fields, base = ENDPOINTS[path]
    name = data.draw(st.sampled_from([f for f in fields if f not in ("model", "max_tokens", "max_completion_tokens")]))
    body = {"model": MODEL, **base, "max_tokens": 2, name: data.draw(field_values(name, wild=False))}
    r, stream = post(http, path, body)
    check(http, r, kind, stream)


garbage = st.one_of(st.binary(max_size=200), st.sampled_from([b"", b"{", b"{not json", b"\xff\xfe", b"null", b"[]",
                                                             b'"x"', b"1e999", b"[" * 5000 + b"]" * 5000,
                                                             b'{"model": NaN}', b'{"a": Infinity}']),
                    json_values.map(lambda v: json.dumps(v).encode()))


@settings(FUZZ, max_examples=40)
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), raw=garbage,
       content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]))
def test_garbage_bodies_are_envelopes(server, path, raw, content_type):
    http, _ = server
    check(http, http.post(path, content=raw, headers={"content-type": content_type}))


PRINTABLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="?#")  # httpx refuses the rest


@settings(FUZZ, max_examples=30)
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
       path=st.one_of(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/x",
                                       "/v1", "/v1/", "//v1/completions", "/v1/completions/", "/static/..%2f..",
                                       "/static/nothing.js", "/%00", "/v1/%ff"]),
                      st.text(PRINTABLE, max_size=20).map("/v1/".__add__)))
def test_odd_paths_and_methods(server, method, path):
    http, _ = server
    r = http.request(method, path, content=b"{}" if method in ("POST", "PUT", "PATCH") else None)
    assert r.status_code < 500, (method, path, r.status_code, r.text[:500])
    if r.status_code >= 400:
        check_envelope(r)
    assert http.get("/health").status_code == 200


def test_the_fields_fuzzed_are_the_documented_ones():
    """A field added to an endpoint is fuzzed without touching this file; this guards the wiring."""
    assert set(protocol.SAMPLING_FIELDS) <= set(chat.FIELDS) & set(completions.FIELDS)
    assert {"messages", "tools", "tool_choice"} <= set(chat.FIELDS) and "prompt" in completions.FIELDS


def test_a_tiny_temperature_or_repetition_penalty_does_not_stop_the_engine(server):
    """Found by test_each_field_alone_never_5xx: temperature 1e-300 (or repetition_penalty 1e-300) divided
    the fp32 logits to inf, the sampler raised on the NaN softmax and the engine loop stopped: every later
    request was a 503. A temperature below 1e-5 is now greedy (vLLM's rule); such a penalty is a 400."""
    http, _ = server
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3}
    greedy = http.post("/v1/completions", json={**body, "temperature": 0})
    tiny = http.post("/v1/completions", json={**body, "temperature": 1e-300})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    for penalty in (1e-300, 0.005):
        r = http.post("/v1/completions", json={**body, "repetition_penalty": penalty})
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
    assert http.post("/v1/completions", json={**body, "repetition_penalty": 0.01}).status_code == 200
    assert http.get("/health").status_code == 200
