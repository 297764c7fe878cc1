"""`openk3 serve`: a real uvicorn on 127.0.0.1 (a free port, a background thread) driven by the official
`openai` client and raw httpx, over the nano model and a 512-id byte tokenizer built here.

Random weights cannot produce reasoning, content and tool calls on demand, so some requests are
scripted (`#script:NAME#` in the prompt; tests/serve_helpers.py, shared with tests/test_web.py). The
parser on token ids is what these requests exercise. Everything else runs the real model.

The servers run the engine as `openk3 serve` does by default, in a process of its own (the builder
`scripted_builder`); the in-thread twin (`create_app(engine)`) is kept where a test reaches into the engine
object itself, or where what it tests is the HTTP side's alone (an engine process start costs seconds). Every
server is stopped at the end of its fixture, its threads joined and its engine process gone (`served`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from serve_helpers import (
    byte_tokenizer,
    envelope,
    nano_model,
    script_engine,
    scripted_builder,
    scripts,
    served,
    sse_events,
    user,
    wait_until,
)

import openk3
from openk3.infer.engine import Engine
from openk3.serve import create_app

MODEL = "nano-test"


# ---- the model, the tokenizer, a live server -------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return nano_model()


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def server():
    app = create_app(scripted_builder(4), served_model_name=MODEL)
    assert app.state.openk3.engine is None  # the default: the engine in a process of its own
    with served(app) as url:
        yield url, app.state.openk3


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


# ---- routes ------------------------------------------------------------------------------------------

def test_health_models_metrics_and_the_page(server, client):
    url, state = server
    assert httpx.get(url + "/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].owned_by == "openk3"
    assert models[0].model_extra["max_model_len"] == state.max_model_len
    text = httpx.get(url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "generation_tokens_total",
                 "generation_tokens_per_second", "time_to_first_token_seconds_count"):
        assert f"openk3:{name}{{" in text
    page = httpx.get(url + "/")  # the web chat page (tests/test_web.py drives it in a browser)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"] and "/static/chat.js" in page.text
    for name, kind in (("chat.js", "text/javascript"), ("chat.css", "text/css"), ("favicon.svg", "image/svg+xml")):
        r = httpx.get(f"{url}/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and r.content
    for path in ("/static/index.html", "/static/../app.py", "/static/nothing.js", "/nothing"):
        r = httpx.get(url + path)  # only the listed files: nothing else of the package is reachable
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- chat ------------------------------------------------------------------------------------------

def test_chat_tool_call_non_stream(client):
    r = client.chat.completions.create(model=MODEL, messages=user("#script:tool# read notes.txt"), max_tokens=200)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content == "Let me check."
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == "I should read it."
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "ReadFile"
    assert json.loads(call.function.arguments) == {"path": "notes.txt"}
    assert call.id.startswith("call_") and len(call.id) == 5 + 24
    script = scripts(byte_tokenizer())["tool"]
    assert r.usage.completion_tokens == len(script)  # the end-of-message id included, as the engine counts
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + len(script)
    assert r.usage.completion_tokens_details.reasoning_tokens == len(b"I should read it.") + 1


def test_chat_stream_chunk_sequence(server):
    url, _ = server
    body = {"model": MODEL, "messages": user("#script:tool#"), "stream": True, "max_tokens": 200,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    kinds = []
    for d in deltas[1:-1]:
        kind = "reasoning" if "reasoning" in d else "content" if "content" in d else "tool_calls"
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    assert kinds == ["reasoning", "content", "tool_calls"]  # in this order, each as one run
    reasoning = [d for d in deltas if "reasoning" in d]
    assert all(d["reasoning"] == d["reasoning_content"] for d in reasoning)
    assert "".join(d["reasoning"] for d in reasoning) == "I should read it."
    assert "".join(d["content"] for d in deltas if "content" in d) == "Let me check."
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and len(calls[0]) == 1  # one whole call in one delta
    call = calls[0][0]
    assert call["index"] == 0 and call["function"] == {"name": "ReadFile", "arguments": '{"path":"notes.txt"}'}
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(scripts_tok()["tool"])


def scripts_tok():
    return scripts(byte_tokenizer())


def test_chat_stream_through_the_sdk_accumulates_the_call(client):
    with client.chat.completions.stream(model=MODEL, messages=user("#script:tool#"), max_tokens=200) as s:
        final = s.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert choice.message.tool_calls[0].function.arguments == '{"path":"notes.txt"}'


def test_chat_stream_equals_non_stream_under_greedy(client):
    kw = {"model": MODEL, "messages": user("hello"), "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**kw)
    parts = {"reasoning": "", "content": ""}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            d = chunk.choices[0].delta
            parts["content"] += d.content or ""
            parts["reasoning"] += (d.model_extra or {}).get("reasoning") or ""
            finish = chunk.choices[0].finish_reason or finish
    msg = whole.choices[0].message
    assert parts["content"] == (msg.content or "")
    assert parts["reasoning"] == (msg.model_extra.get("reasoning") or "")
    assert finish == whole.choices[0].finish_reason


def test_max_tokens_is_length_and_an_open_call_is_not_delivered(client):
    r = client.chat.completions.create(model=MODEL, messages=user("#script:long#"), max_completion_tokens=7)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    assert r.choices[0].message.model_extra["reasoning"] == "a" * 7
    cut = len(scripts_tok()["tool"]) - 23  # the argument closed, the call still open
    r = client.chat.completions.create(model=MODEL, messages=user("#script:tool#"), max_tokens=cut)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None and c.message.content == "Let me check."


def test_stop_string_applies_to_content_only(client):
    # "hmm" is reasoning: a stop string matching it does not end the answer; "world" in the content does
    r = client.chat.completions.create(model=MODEL, messages=user("#script:text#"), stop=["world", "hm"],
                                       max_tokens=100)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content == "Hello " and c.message.model_extra["reasoning"] == "hmm"
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("#script:text#"), stop="o w",
                                                 max_tokens=100, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Hell"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n2_effort_thinking_and_developer_role(client):
    r = client.chat.completions.create(model=MODEL, messages=user("#script:long#"), n=2, max_tokens=5)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    assert all(c.finish_reason == "length" and c.message.model_extra["reasoning"] == "aaaaa" for c in r.choices)
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("hi"), n=2, max_tokens=4, seed=3,
                                                 stream=True))
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices[0].finish_reason) == [0, 1]

    def prompt_tokens(**kw) -> int:
        return client.chat.completions.create(model=MODEL, max_tokens=1, **kw).usage.prompt_tokens

    msgs = [{"role": "developer", "content": "be brief"}, *user("hi")]
    low = prompt_tokens(messages=msgs, reasoning_effort="low")
    # thinking_effort is the same option under K3's name; "max" renders as many tokens as "low"
    assert prompt_tokens(messages=msgs, extra_body={"thinking_effort": "max"}) == low
    off = prompt_tokens(messages=msgs, extra_body={"chat_template_kwargs": {"thinking": False}})
    assert off < low  # no thinking-effort message, response channel opened
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's values map onto K3's (test_serve_clients.py)
        client.chat.completions.create(model=MODEL, messages=msgs, reasoning_effort="huge", max_tokens=1)
    assert "huge" in e.value.body["message"] and e.value.body["param"] == "reasoning_effort"


def test_history_with_reasoning_or_reasoning_content_renders_the_same(client):
    def usage_with(field: str) -> int:
        msgs = [*user("q"), {"role": "assistant", "content": "a", field: "because"}, *user("q2")]
        return client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage.prompt_tokens

    assert usage_with("reasoning") == usage_with("reasoning_content")


# ---- completions -------------------------------------------------------------------------------------

def test_completions_text_and_token_ids(client, tok):
    r = client.completions.create(model=MODEL, prompt="def ", max_tokens=6, temperature=0)
    same = client.completions.create(model=MODEL, prompt=list(b"def "), max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == same.choices[0].text
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens <= 6
    assert r.choices[0].finish_reason == "stop" or r.usage.completion_tokens == 6
    batch = client.completions.create(model=MODEL, prompt=["ab", [1, 2, 3]], max_tokens=3, n=2, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3] and batch.usage.prompt_tokens == 5
    assert batch.choices[0].text == batch.choices[1].text  # greedy: both choices alike
    echoed = client.completions.create(model=MODEL, prompt="def ", max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "def " + r.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="def ", max_tokens=6, temperature=0, stream=True))
    assert streamed == r.choices[0].text


def test_completions_stop_string_and_length(client):
    r = client.completions.create(model=MODEL, prompt="#script:text#", max_tokens=100, stop="world")
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text.endswith("Hello ")
    r = client.completions.create(model=MODEL, prompt="#script:long#", max_tokens=9)
    assert r.choices[0].finish_reason == "length" and r.choices[0].text == "a" * 9 and r.usage.completion_tokens == 9


# ---- log probabilities ---------------------------------------------------------------------------------

@torch.no_grad()
def direct_logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax (float64) of one full forward over prompt + output: row j scores out[j]."""
    logits = model(torch.tensor([prompt + out]))[0, len(prompt) - 1:len(prompt) - 1 + len(out)]
    return torch.log_softmax(logits.double(), dim=-1)


def _ids_of(tok, pieces: list[bytes]) -> list[int]:
    """Token ids back from the byte tokenizer's pieces (one byte, or a special token's name)."""
    return [p[0] if len(p) == 1 else tok.special_ids[p.decode()] for p in pieces]


def test_chat_logprobs_equal_a_direct_computation(client, model, tok):
    """Greedy chat with logprobs + top_logprobs=3, plain and streamed: one entry per generated token (all
    channels), each equal to log_softmax of a full forward over the rendered prompt and the output."""
    from openk3.chat import encode_segments, render

    msgs = user("hello")
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 9, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    out = _ids_of(tok, [bytes(e.bytes) for e in content])
    ref = direct_logprobs(model, encode_segments(render({"messages": msgs}), tok).ids, out)
    for j, e in enumerate(content):
        assert e.token == bytes(e.bytes).decode("utf-8", errors="replace")
        assert abs(e.logprob - ref[j, out[j]].item()) < 1e-4
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].bytes == e.bytes  # greedy: the top token
        top_ids = _ids_of(tok, [bytes(t.bytes) for t in e.top_logprobs])
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(ref[j].topk(3).values.tolist(), abs=1e-4)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(ref[j, top_ids].tolist(), abs=1e-4)
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [e.bytes for e in streamed] == [e.bytes for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    plain = client.chat.completions.create(**{k: v for k, v in kw.items() if "logprobs" not in k})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_chat_logprobs_cover_every_channel_unless_reasoning_is_hidden(client, tok):
    """Reasoning, markers, content, the tool call and the end-of-message token all have entries, in order
    (as vLLM); with include_reasoning=false there are none (their texts would show the reasoning)."""
    script = scripts(tok)["tool"]
    r = client.chat.completions.create(model=MODEL, messages=user("#script:tool#"), max_tokens=200, logprobs=True)
    content = r.choices[0].logprobs.content
    assert _ids_of(tok, [bytes(e.bytes) for e in content]) == script
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("#script:tool#"), max_tokens=200,
                                                 logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.bytes for e in streamed] == [e.bytes for e in content]
    # hidden: any reply with reasoning will do (the shorter scripted one)
    hidden = client.chat.completions.create(model=MODEL, messages=user("#script:text#"), max_tokens=200,
                                            logprobs=True, extra_body={"include_reasoning": False})
    assert hidden.choices[0].logprobs is None and hidden.choices[0].message.content == "Hello world. Bye"
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("#script:text#"), max_tokens=200,
                                                 logprobs=True, stream=True, extra_body={"include_reasoning": False}))
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world. Bye"


def test_completions_logprobs_equal_a_direct_computation(client, model, tok):
    """Greedy legacy completions with logprobs=2: tokens, token_logprobs, top_logprobs (the 2 most likely and
    the sampled token, by text) and text_offset equal a direct computation; the stream's pieces join to them."""
    prompt = list(b"def ")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    out: list[int] = []
    for j in range(n):
        ref = direct_logprobs(model, prompt, out + [0])[-1]  # the distribution after prompt + out
        best = ref.topk(2)
        out.append(int(best.indices[0]))  # greedy
        text = [tok.decode_bytes([i]).decode("utf-8", errors="replace") for i in best.indices.tolist()]
        assert lp.tokens[j] == text[0] and abs(lp.token_logprobs[j] - best.values[0].item()) < 1e-4
        want = dict(zip(text, best.values.tolist(), strict=True))  # greedy: the sampled token is among them
        assert lp.top_logprobs[j] == pytest.approx(want, abs=1e-4)
        assert lp.text_offset[j] == sum(len(t) for t in lp.tokens[:j])
    parts = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, logprobs=2,
                                           stream=True):
        if chunk.choices[0].logprobs is not None:
            for key in parts:
                parts[key] += getattr(chunk.choices[0].logprobs, key)
    assert parts["tokens"] == lp.tokens and parts["text_offset"] == lp.text_offset
    assert parts["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-5)
    k0 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=0)
    assert [list(d) for d in k0.choices[0].logprobs.top_logprobs] == [[t] for t in lp.tokens[:3]]  # sampled only
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == r.choices[0].text


def test_processed_logprobs_mode_reports_the_distribution_each_token_was_drawn_from(model, tok):
    """`create_app(..., logprobs_mode="processed")` (`openk3 serve --logprobs-mode processed`): a sampled chat's
    entries are log_softmax of the logits after temperature and top-k, from a full forward (what an RL
    trainer's importance ratio needs), not the raw distribution the default reports."""
    from openk3.chat import encode_segments, render
    from openk3.infer.sample import SamplingParams, sampling_logits

    with pytest.raises(ValueError, match="logprobs_mode must be one of raw, processed, got 'cooked'"):
        create_app(Engine(model, tok, max_num_seqs=1), served_model_name=MODEL, logprobs_mode="cooked")
    app = create_app(Engine(model, tok, max_num_seqs=2), served_model_name=MODEL, logprobs_mode="processed")
    msgs = user("hello")
    with served(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.7, seed=3,
                                      logprobs=True, extra_body={"top_k": 5})
        legacy = c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=6, temperature=0.7, seed=3,
                                      logprobs=0, extra_body={"top_k": 5}).choices[0].logprobs.token_logprobs
    # the legacy route too: the engine's own processed entries for the same seeded request
    (final,) = Engine(model, tok, max_num_seqs=1).generate([[5, 6, 7]], SamplingParams(
        temperature=0.7, top_k=5, seed=3, max_tokens=6, logprobs=0, logprobs_mode="processed"))
    assert len(legacy) == len(final.logprobs) >= 1
    assert legacy == pytest.approx([e[0] for e in final.logprobs], abs=1e-6)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    out = _ids_of(tok, [bytes(e.bytes) for e in content])
    prompt = encode_segments(render({"messages": msgs}), tok).ids
    logits = model(torch.tensor([prompt + out]))[0, len(prompt) - 1:len(prompt) - 1 + len(out)].double()
    params = SamplingParams(temperature=0.7, top_k=5)
    raw_gap = 0.0
    for j, e in enumerate(content):
        processed = torch.log_softmax(sampling_logits(logits[j], params), dim=-1)
        assert abs(e.logprob - processed[out[j]].item()) < 1e-4, (j, e.logprob, processed[out[j]].item())
        raw_gap = max(raw_gap, e.logprob - torch.log_softmax(logits[j], dim=-1)[out[j]].item())
    assert raw_gap > 0.05  # the raw distribution gives the drawn tokens less mass: the mode changed what is reported


def test_logprobs_bounds_are_400s_naming_the_field(server):
    url, _ = server
    chat, comp = url + "/v1/chat/completions", url + "/v1/completions"
    ok = {"model": MODEL, "messages": user("hi"), "max_tokens": 2}
    for extra, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
                         ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
                         ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
                         ({"logprobs": 1}, "logprobs")):  # chat's logprobs is a flag
        envelope(httpx.post(chat, json={**ok, **extra}), 400, param=param)
    assert httpx.post(chat, json={**ok, "logprobs": True, "top_logprobs": 20}).status_code == 200
    base = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for value in (21, -1, True, "3"):
        envelope(httpx.post(comp, json={**base, "logprobs": value}), 400, param="logprobs")
    assert httpx.post(comp, json={**base, "logprobs": 20}).status_code == 200
    envelope(httpx.post(comp, json={**base, "logprobs": 1, "echo": True}), 400, param="echo",
              code="unsupported_field")


# ---- batching, cancellation, admission -------------------------------------------------------------------

def test_concurrent_requests_share_the_batch(server, client):
    _, state = server
    state.metrics.peak_running = 0
    results: list = []

    def one(k: int) -> None:
        results.append(client.completions.create(model=MODEL, prompt=f"#script:long# {k}", max_tokens=60))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4 and all(r.choices[0].text == "a" * 60 for r in results)
    assert state.metrics.peak_running > 1


def test_disconnect_mid_stream_frees_the_slot(server, client):
    _, state = server
    cancelled, generated = state.metrics.cancelled, state.metrics.generation_tokens
    stream = client.chat.completions.create(model=MODEL, messages=user("#script:long#"), max_tokens=3000,
                                            stream=True)
    for k, _chunk in enumerate(stream):
        if k == 5:
            break
    assert state.loop.in_flight() == 1
    stream.close()
    wait_until(lambda: state.loop.in_flight() == 0 and state.metrics.running == 0, timeout=5)
    assert state.metrics.cancelled == cancelled + 1
    assert state.metrics.generation_tokens - generated < 3000  # stopped, not run to its end


def test_disconnect_before_a_non_streamed_answer_frees_the_slot(server):
    url, state = server
    cancelled = state.metrics.cancelled
    body = {"model": MODEL, "prompt": "#script:long#", "max_tokens": 3000}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
    wait_until(lambda: state.loop.in_flight() == 0 and state.metrics.running == 0, timeout=5)
    assert state.metrics.cancelled == cancelled + 1


def test_a_failing_step_fails_its_requests_and_the_engine_thread_goes_on(model, tok):
    """The in-thread twin: a step that raises fails the request it was generating (an error event after
    the 200, a 500-class error, not a 503), and the loop keeps serving: /health stays up, later requests complete."""
    engine = script_engine(Engine(model, tok, max_num_seqs=2), tok)
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device lost")
        return step()

    engine.step = failing_step
    app = create_app(engine, served_model_name=MODEL)
    body = {"model": MODEL, "prompt": "#script:long#", "max_tokens": 50, "stream": True}
    with served(app) as url:
        with httpx.stream("POST", url + "/v1/completions", json=body) as r:
            events = sse_events(r)
        assert r.status_code == 200 and events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert "device lost" in error["message"] and error["type"] == "server_error" and error["code"] == "engine_error"
        assert httpx.get(url + "/health").status_code == 200
        later = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 5}, timeout=30)
        assert later.status_code == 200 and later.json()["choices"][0]["text"] == "aaaaa"
        wait_until(lambda: state_idle(app.state.openk3) and not engine.running and not engine._by_id)


def state_idle(state) -> bool:
    return state.loop.in_flight() == 0 and state.metrics.running == 0 and state.metrics.waiting == 0


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    """A server that runs one request at a time and queues two more (the admission tests share it); its engine
    steps only while the file `gate` exists (it does unless a test removes it)."""
    gate = tmp_path_factory.mktemp("one-slot") / "gate"
    gate.touch()
    app = create_app(scripted_builder(1, gate=str(gate)), served_model_name=MODEL, max_queue=2)
    with served(app) as url:
        yield url, app.state.openk3, gate


def test_a_failing_step_fails_only_its_requests(one_slot):
    """In the engine process: a request whose sampling raises gets a 500 envelope (`engine_error`); the one
    running before it, the one waiting behind it and a later one all complete, and the server stays healthy."""
    url, state, gate = one_slot
    comp = {"model": MODEL, "max_tokens": 5}
    results: dict[str, httpx.Response] = {}

    def post(name: str, prompt: str) -> None:
        results[name] = httpx.post(url + "/v1/completions", json={**comp, "prompt": prompt}, timeout=60)

    with httpx.Client(base_url=url, timeout=60) as http:
        body = {**comp, "prompt": "#script:long# first", "max_tokens": 40, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as first:  # holds the one slot
            lines = first.iter_lines()
            head = [next(lines)]
            # the engine holds still while the two others queue behind `first`, in this order (a loaded machine
            # could otherwise finish first's 40 tokens before the second one arrived)
            gate.unlink()
            threads = [threading.Thread(target=post, args=("failing", "#script:fail# x"))]
            threads[0].start()
            wait_until(lambda: state.loop.in_flight() == 2)
            threads.append(threading.Thread(target=post, args=("behind", "#script:long# y")))
            threads[1].start()
            wait_until(lambda: state.loop.in_flight() == 3)
            gate.touch()
            wait_until(lambda: state.metrics.waiting == 2)  # the engine has them, waiting behind first
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in (*head, *lines)
                           if line.startswith("data: {"))
        assert text == "a" * 40
        for t in threads:
            t.join(60)
        err = envelope(results["failing"], 500, code="engine_error")
        assert err["type"] == "server_error" and "injected sampling failure" in err["message"]
        assert results["behind"].status_code == 200 and results["behind"].json()["choices"][0]["text"] == "aaaaa"
        assert httpx.get(url + "/health").status_code == 200
        later = http.post("/v1/completions", json={**comp, "prompt": "#script:long# z"})
        assert later.status_code == 200 and later.json()["choices"][0]["text"] == "aaaaa"
        wait_until(lambda: state_idle(state))
        assert 'openk3:requests_failed_total{model_name="nano-test"} 1' in http.get("/metrics").text


def test_engine_process_death_is_503_never_a_hang():
    app = create_app(scripted_builder(2), served_model_name=MODEL)
    state = app.state.openk3
    body = {"model": MODEL, "prompt": "#script:long#", "max_tokens": 3000}
    with served(app) as url:
        plain: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: plain.append(httpx.post(url + "/v1/completions", json=body,
                                                                         timeout=30)))
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            waiter.start()
            wait_until(lambda: state.metrics.running == 2)
            os.kill(state.loop.pid, signal.SIGKILL)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and "engine process exited" in error["message"]
        waiter.join(30)
        envelope(plain[0], 503, code="engine_unavailable")
        assert httpx.get(url + "/health").status_code == 503
        envelope(httpx.post(url + "/v1/completions", json=body, timeout=10), 503, code="engine_unavailable")
        assert state.loop.in_flight() == 0


def test_full_queue_is_429(one_slot):
    url, state, _ = one_slot
    body = {"model": MODEL, "prompt": "#script:long#", "max_tokens": 3000, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as running, \
                http.stream("POST", "/v1/completions", json=body) as waiting, \
                http.stream("POST", "/v1/completions", json=body) as last:
            lines = running.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            assert running.status_code == waiting.status_code == last.status_code == 200
            wait_until(lambda: state.metrics.running == 1 and state.metrics.waiting == 2)
            r = http.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
        wait_until(lambda: state.loop.in_flight() == 0, timeout=5)  # the streams closed: all freed
        assert state.metrics.rejected["queue_full"] == 1
        assert http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2}).status_code == 200


# ---- errors and auth ---------------------------------------------------------------------------------------

def test_every_error_is_an_envelope(server):
    url, state = server
    chat = url + "/v1/chat/completions"
    ok = {"model": MODEL, "messages": user("hi"), "max_tokens": 2}
    assert httpx.post(chat, json=ok).status_code == 200
    envelope(httpx.post(chat, content=b"{not json"), 400, code="invalid_json")
    envelope(httpx.post(chat, content=b"\xff\xfe"), 400, code="invalid_json")
    envelope(httpx.post(chat, json=[1, 2]), 400)
    envelope(httpx.post(chat, json={**ok, "temperature": -1}), 400, param="temperature")
    envelope(httpx.post(chat, json={**ok, "n": 0}), 400, param="n")
    envelope(httpx.post(chat, json={**ok, "max_tokens": "9"}), 400, param="max_tokens")
    envelope(httpx.post(chat, json={**ok, "stop": ["a"] * 5}), 400, param="stop")
    envelope(httpx.post(chat, json={**ok, "messages": []}), 400, param="messages")
    envelope(httpx.post(chat, json={**ok, "messages": [{"role": "robot", "content": "x"}]}), 400,
             param="messages[0].role")
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    envelope(httpx.post(chat, json={**ok, "messages": [{"role": "user", "content": image}]}), 400,
             param="messages[0].content[0].type")
    # keys of newer API versions (or typos) are ignored and logged, as vLLM does: a request never fails on them
    assert httpx.post(chat, json={**ok, "frobnicate": 1, "store": False, "metadata": {"a": "b"}}).status_code == 200
    for field, value in (("presence_penalty", 0.5), ("frequency_penalty", 1), ("logit_bias", {"1": 5})):
        err = envelope(httpx.post(chat, json={**ok, field: value}), 400, param=field, code="unsupported_field")
        assert "not supported yet" in err["message"]
    assert httpx.post(chat, json={**ok, "presence_penalty": 0, "logprobs": False, "top_logprobs": 0}).status_code == 200
    envelope(httpx.post(chat, json={**ok, "tool_choice": {"type": "function", "function": {"name": "f"}}}), 400,
              param="tool_choice")
    envelope(httpx.post(chat, json={**ok, "model": "gpt-9"}), 404, param="model", code="model_not_found")
    envelope(httpx.post(chat, json={k: v for k, v in ok.items() if k != "model"}), 400, param="model")
    long = state.max_model_len
    envelope(httpx.post(chat, json={**ok, "max_tokens": long}), 400, param="messages",
              code="context_length_exceeded")
    envelope(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5] * long}), 400,
              param="prompt", code="context_length_exceeded")
    envelope(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [512]}), 400, param="prompt")
    envelope(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "suffix": "y"}), 400,
              param="suffix")
    envelope(httpx.post(url + "/v1/nothing", json=ok), 404)
    envelope(httpx.get(chat), 405)


def test_sdk_error_classes(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=user("hi"))
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("hi"), logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"


def test_api_key(model, tok):
    # the key is the HTTP side's alone: the in-thread twin, not an engine process start
    app = create_app(Engine(model, tok, max_num_seqs=1), served_model_name=MODEL, api_key="sekrit")
    with served(app) as url:
        err = envelope(httpx.get(url + "/v1/models"), 401, code="invalid_api_key")
        assert err["type"] == "authentication_error" and "missing" in err["message"]
        bad = {"Authorization": "Bearer wrong"}
        envelope(httpx.post(url + "/v1/completions", headers=bad, json={"model": MODEL, "prompt": "a"}), 401,
                  code="invalid_api_key")
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
        with openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0) as c:
            assert c.completions.create(model=MODEL, prompt="a", max_tokens=2).usage.completion_tokens <= 2
        with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as c, \
                pytest.raises(openai.AuthenticationError):
            c.models.list()


# ---- the command ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, model, tok):
    """The nano model and the byte tokenizer saved as a checkpoint (what `openk3 serve` loads)."""
    path = tmp_path_factory.mktemp("serve") / "ckpt"
    openk3.save(model, path, dtype=torch.float32)
    tok.save(str(path))
    return path


def test_cli_builds_a_server_from_a_checkpoint(tmp_path, ckpt):
    from openk3.commands import serve as cmd
    from openk3.serve.connections import default_max_connections

    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    args = parser.parse_args([str(ckpt), "--port", "0", "--max-num-seqs", "2", "--max-model-len", "64",
                              "--api-key", "k"])
    assert args.host == "127.0.0.1"  # loopback unless asked
    server = cmd.build_server(args)
    app, first_http = server.config.app, server.config.http
    with served(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as c:
        (m,) = c.models.list().data
        assert m.id == "ckpt" and m.model_extra["max_model_len"] == 64
        assert app.state.openk3.loop.max_num_seqs == 2 and app.state.openk3.engine is None  # an engine process
    with pytest.raises(ValueError, match="--max-num-seqs"):
        cmd.build_server(parser.parse_args([str(ckpt), "--max-num-seqs", "0"]))
    # a failure to load, in the engine process, is the same error the command reports (not a traceback)
    with pytest.raises((ValueError, OSError), match="nothing"):
        cmd.build_server(parser.parse_args([str(tmp_path / "nothing")]))
    server = cmd.build_server(parser.parse_args([
        str(ckpt), "--engine-in-thread", "--max-num-seqs", "3", "--logprobs-mode", "processed",
        "--default-effort", "medium", "--default-max-tokens", "7", "--sse-keepalive", "0", "--max-body-mb", "1",
        "--body-timeout", "5", "--header-timeout", "2", "--max-connections", "50", "--engine-timeout", "9"]))
    state = server.config.app.state.openk3
    assert state.engine.max_num_seqs == 3  # the twin: the engine in this process
    assert state.logprobs_mode == "processed" and app.state.openk3.logprobs_mode == "raw"
    assert (state.default_effort, state.default_max_tokens, state.sse_keepalive_s, state.max_body_bytes,
            state.body_timeout_s) == ("high", 7, None, 2 ** 20, 5)
    assert (server.config.http.header_timeout_s, server.config.http.max_connections) == (2, 50)
    options = app.state.openk3  # the first server's: the release's defaults
    assert (options.default_effort, options.default_max_tokens, options.sse_keepalive_s) == (None, None, 15)
    assert options.loop.heartbeat_timeout_s == 20 and first_http.max_connections == default_max_connections()
    for flag, value in (("--default-max-tokens", "0"), ("--max-body-mb", "nan"), ("--sse-keepalive", "-1"),
                        ("--max-connections", "0"), ("--header-timeout", "0")):
        with pytest.raises(ValueError, match=flag):
            cmd.build_server(parser.parse_args([str(ckpt), flag, value]))
    with pytest.raises(SystemExit):
        parser.parse_args([str(ckpt), "--default-effort", "huge"])



def test_the_engine_process_imports_no_web_stack_and_no_compiler(server):
    """Each engine start costs what its process imports: the engine process (`python -m openk3.serve.engine_main`)
    imported fastapi, starlette and uvicorn (the package's __init__), and building a model imported torch._dynamo
    (nn.Embedding's own init on the meta device goes through torch._refs), ~3 s of CPU per start together.
    `scripted_nano` refuses to build in an engine process that imported any of them (serve_helpers.LEAN): this
    server, and every other one of these tests, would not have started."""
    _, state = server
    assert state.engine is None and state.loop.alive


def test_the_engine_process_exits_without_the_interpreters_teardown(tmp_path):
    """The server's shutdown waits for the engine process; Python's teardown with torch loaded took ~1.5 s of it,
    for nothing (the process has nothing left to write), so the process ends with os._exit: no atexit runs."""
    from openk3.serve.metrics import Metrics
    from openk3.serve.process import EngineProcess

    mark = tmp_path / "teardown-ran"
    proc = EngineProcess(scripted_builder(1, exit_mark=str(mark)), Metrics(MODEL))
    proc.stop()
    assert proc.stopped() and proc._proc.returncode == 0 and not mark.exists()


def test_the_listening_socket_sends_small_chunks_at_once():
    """`openk3 serve` binds its socket itself (to know the port); asyncio turns Nagle off (TCP_NODELAY) only on
    connections of a socket that says IPPROTO_TCP. With Nagle on, each small SSE chunk waited for the previous
    one's acknowledgement: a stream's first chunk came ~20 ms late (bench_serve, c=1)."""
    import asyncio
    import socket

    from openk3.commands.serve import bind

    async def nodelay_of_accepted() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                accepted.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                                                   socket.TCP_NODELAY))
                transport.close()

        sock = bind("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            value = await asyncio.wait_for(accepted, 10)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(nodelay_of_accepted()) == 1
    with bind("127.0.0.1", 0) as held:  # a port in use is one clear error, not uvicorn's exit
        with pytest.raises(OSError, match="cannot listen on 127.0.0.1"):
            bind("127.0.0.1", held.getsockname()[1])


def _gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by whoever inherited it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states through /proc")
def test_the_command_on_port_0_names_its_port_and_leaves_no_orphan_engine(ckpt):
    """`openk3 serve --port 0` prints the port it bound and its engine's pid (a request sent at once waits in
    the listen backlog, not refused, while the app starts); killing the server (SIGKILL: no shutdown code
    runs) ends the engine process too, which sees its inbox close."""
    cmd = [sys.executable, "-m", "openk3", "serve", str(ckpt), "--port", "0", "--max-num-seqs", "1",
           "--log-level", "warning"]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("[serve]" in line for line in lines) or server.poll() is not None, timeout=120)
        banner = next((line for line in lines if "[serve]" in line), "")
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1 \(engine process (\d+)", banner)
        assert m, lines
        url, engine_pid = f"http://127.0.0.1:{m.group(1)}", int(m.group(2))
        assert int(m.group(1)) != 0 and not _gone(engine_pid), lines
        r = httpx.post(url + "/v1/completions", json={"model": "ckpt", "prompt": "a", "max_tokens": 2},
                       headers={"x-request-id": "abc-123"}, timeout=30)
        assert r.status_code == 200 and r.headers.get("x-request-id") == "abc-123", (r.status_code, r.headers, lines)
        server.kill()
        server.wait(30)
        deadline = time.monotonic() + 15
        while not _gone(engine_pid):
            assert time.monotonic() < deadline, f"the engine process {engine_pid} outlived the server: {lines}"
            time.sleep(0.05)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
