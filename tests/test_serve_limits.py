"""`openk3 serve`'s options and limits (issue 28 items 6c, 6d and the probes C4-C7): the default effort and
completion cap, SSE keep-alive comments during a long prefill, the header deadline and the connection cap
(raw sockets that connect and send nothing), the body's size and time, /health while the engine process is
stopped, and requests larger than the server can ever hold.

Servers run the nano model in an engine process (tests/serve_helpers.py), or in a thread (the twin) where the
limit is the HTTP side's alone, configured as `openk3 serve` is (`uvicorn_config`), with the limits set small.
No assertion is on a duration: a limit that does not hold leaves a socket read waiting until its own timeout
(60 s), which fails the test.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
import torch
from serve_helpers import (
    byte_tokenizer,
    envelope,
    nano_model,
    scripted_builder,
    scripted_nano,
    served,
    user,
    wait_until,
)

import openk3
from openk3.chat import resolve_thinking
from openk3.infer.engine import Engine
from openk3.serve import create_app
from openk3.tokenizer import Tokenizer

MODEL = "nano-limits"
EFFORT = "openk3-reasoning-effort"
KEEPALIVE = ": keep-alive"


@pytest.fixture(scope="module")
def limited():
    """Every option set: effort medium (-> high) and 3 completion tokens unless asked, 64 KiB bodies read within
    1 s, request headers within 1 s, 2 running + 2 queued requests, /health 503 after 2 s of engine silence."""
    app = create_app(scripted_builder(2), served_model_name=MODEL, max_queue=2, default_effort="medium",
                     default_max_tokens=3, max_body_bytes=64 * 1024, body_timeout_s=1.0, engine_timeout_s=2.0)
    with served(app, header_timeout_s=1.0) as url:
        yield url, app.state.openk3


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def exchange(url: str, raw: bytes) -> bytes:
    """Send `raw` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=60) as s:
        s.sendall(raw)
        return read_to_close(s)


def read_to_close(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def split(raw: bytes) -> tuple[int, dict]:
    """(status, JSON body) of a raw HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


# ---- the defaults (6c) ----------------------------------------------------------------------------------------

def test_default_effort_and_max_tokens_apply_when_the_request_omits_them(limited):
    url, _ = limited
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        def ask(**kw):
            raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=user("#script:long#"), **kw)
            r = raw.parse()
            return raw.headers[EFFORT], r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason

        used, prompt, completion, finish = ask()
        assert (used, completion, finish) == ("high", 3, "length")  # the server's defaults
        assert ask(reasoning_effort="high", max_tokens=1)[:3] == ("high", prompt, 1)
        assert ask(reasoning_effort="low", max_completion_tokens=5)[:3] == ("low", prompt - 1, 5)  # the request's win
        assert ask(extra_body={"chat_template_kwargs": {"thinking": False}})[0] == "none"
        done = c.completions.create(model=MODEL, prompt="#script:long#")
        assert done.usage.completion_tokens == 3 and done.choices[0].finish_reason == "length"
        assert c.completions.create(model=MODEL, prompt="#script:long#", max_tokens=5).usage.completion_tokens == 5


def test_a_default_effort_of_none_is_thinking_off_unless_the_request_switches_it_on():
    from openk3.serve import effort

    def used(body: dict, default: str | None) -> tuple[bool, str | None]:
        return resolve_thinking(effort.render_keys(body, default))

    assert used({}, "none") == (False, None)
    assert used({"thinking": True}, "none") == used({"chat_template_kwargs": {"enable_thinking": True}}, "none") \
        == (True, "max")
    assert used({"reasoning_effort": "minimal"}, "none") == (True, "low")
    assert used({}, "high") == (True, "high") and used({"thinking": False}, "high") == (False, None)
    assert used({"chat_template_kwargs": {"thinking_effort": "low"}}, "high") == (True, "low")
    assert used({}, None) == (True, "max")  # no option: K3's own default
    for bad in ({"default_effort": "huge"}, {"default_max_tokens": 0}, {"sse_keepalive_s": -1},
                {"max_body_bytes": 0}, {"body_timeout_s": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            create_app(scripted_builder(1), **bad)


# ---- SSE keep-alive (6d) --------------------------------------------------------------------------------------

class OpenOnComment(httpx.BaseTransport):
    """An httpx transport that creates `gate` (letting the engine step) once the response carries a keep-alive
    comment: the SDK then reads a stream that has one, before its first token, for sure."""

    def __init__(self, gate) -> None:
        self.inner, self.gate = httpx.HTTPTransport(), gate

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        gate = self.gate

        class Watched(httpx.SyncByteStream):
            def __iter__(self):
                tail = b""
                for chunk in response.stream:
                    if KEEPALIVE.encode() in tail + chunk:
                        gate.touch()
                    tail = chunk[-len(KEEPALIVE):]
                    yield chunk

            def close(self) -> None:
                response.stream.close()

        return httpx.Response(response.status_code, headers=response.headers, stream=Watched(),
                              extensions=response.extensions)


def test_a_stream_waiting_for_its_first_token_sends_keepalive_comments(tmp_path):
    gate = tmp_path / "gate"  # the engine's steps wait until it exists: a prefill as long as the test wants
    # the comments are the HTTP side's (the SSE writer): the in-thread twin, not an engine process start
    app = create_app(scripted_nano(2, gate=str(gate)), served_model_name=MODEL, sse_keepalive_s=0.05)
    body = {"model": MODEL, "messages": user("#script:text#"), "max_tokens": 100, "stream": True}
    with served(app) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: ") and json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
            assert next(line for line in lines if line) == KEEPALIVE  # nothing else until a token comes
            gate.touch()
            rest = [line for line in lines if line and line != KEEPALIVE]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in rest[:-1]]
        assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == "Hello world. Bye"
        gate.unlink()
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(transport=OpenOnComment(gate), timeout=60)) as c:
            kw = {k: v for k, v in body.items() if k != "stream"}
            chunks = list(c.chat.completions.create(stream=True, **kw))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello world. Bye"
            gate.unlink()
            text = "".join(ch.choices[0].text for ch in c.completions.create(
                model=MODEL, prompt="#script:text#", max_tokens=100, stream=True))
            assert "Hello world. Bye" in text


# ---- connections (C4) -----------------------------------------------------------------------------------------

def test_a_silent_or_trickling_connection_is_closed_at_the_header_deadline(limited):
    url, _ = limited
    for first in (b"", b"GET /health HTTP/1.1\r\nhost: x\r\n"):  # nothing at all; headers begun, never ended
        with socket.create_connection(("127.0.0.1", port_of(url)), timeout=60) as s:
            s.sendall(first)
            assert read_to_close(s) == b""  # closed by the server
    assert httpx.get(url + "/v1/models").status_code == 200  # whole requests are answered as ever


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=10).status_code
    except httpx.HTTPError:  # refused mid-request while the cap is still full
        return None


def test_connections_past_the_cap_get_a_503_and_one_log_line(caplog):
    caplog.set_level(logging.WARNING, logger="openk3.serve.connections")
    app = create_app(scripted_nano(1), served_model_name=MODEL)  # the cap is uvicorn's: the in-thread twin
    with served(app, max_connections=4, header_timeout_s=60) as url:
        idle = [socket.create_connection(("127.0.0.1", port_of(url)), timeout=60) for _ in range(4)]
        try:
            refused = [exchange(url, b"") for _ in range(20)]
        finally:
            for s in idle:
                s.close()
        for raw in refused:
            status, body = split(raw)
            assert status == 503 and body["error"]["code"] == "too_many_connections", raw
            assert "--max-connections" in body["error"]["message"]
        logged = [r for r in caplog.records if "refused" in r.getMessage()]
        assert 1 <= len(logged) <= 2, logged  # per burst (one line per 10 s), never one per connection
        wait_until(lambda: _health(url) == 200)  # the idle ones closed: room again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sets the server's descriptor limit (setrlimit)")
def test_past_the_descriptor_limit_the_server_still_answers_and_logs_little(tmp_path):
    """Probe C4: under `ulimit -n 256`, 400 connections that send nothing. asyncio then logged a traceback per
    failed accept() (about 3 MB/s) and nothing new was answered; now connections past the cap get a 503, the
    log stays a few lines, and once the idle ones go the server answers 200 again."""
    ckpt = tmp_path / "ckpt"
    openk3.save(nano_model(), ckpt, dtype=torch.float32)
    byte_tokenizer().save(str(ckpt))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    cmd = [sys.executable, "-m", "openk3", "serve", str(ckpt), "--port", "0", "--max-num-seqs", "1"]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True).start()
    idle = []
    try:
        wait_until(lambda: any("[serve]" in line for line in lines) or server.poll() is not None, timeout=120)
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", "".join(lines)).group(1)
        idle = [socket.create_connection(("127.0.0.1", port_of(url)), timeout=60) for _ in range(400)]
        status, _ = split(exchange(url, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"))
        assert status == 503  # the cap is full of idle connections: a clear refusal, not silence
        for s in idle:
            s.close()
        wait_until(lambda: _health(url) == 200, timeout=60)
    finally:
        for s in idle:
            s.close()
        server.terminate()
        server.wait(60)
    assert not any("Traceback" in line for line in lines), "".join(lines[:40])
    assert len(lines) < 40, "".join(lines[:40])


# ---- request bodies (C5), capacity (C7) ------------------------------------------------------------------------

def test_bodies_past_the_size_or_time_limit_are_413_and_408(limited):
    url, _ = limited
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    status, body = split(exchange(url, head + b"content-length: 100000000\r\n\r\n"))  # answered before it comes
    assert status == 413 and body["error"]["code"] == "request_too_large" and "65536 bytes" in body["error"]["message"]

    def chunked():  # no length given: counted as it arrives
        yield b'{"model": "' + MODEL.encode() + b'", "pad": "'
        for _ in range(70):
            yield b"a" * 1024
    envelope(httpx.post(url + "/v1/completions", content=chunked(), timeout=60), 413, code="request_too_large")
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=60) as s:
        s.sendall(head + b"content-length: 100\r\n\r\n{\"model\": ")  # then nothing more
        assert httpx.get(url + "/v1/models").status_code == 200  # other requests go on meanwhile
        status, body = split(read_to_close(s))
    assert status == 408 and body["error"]["code"] == "request_timeout"
    ok = {"model": MODEL, "messages": user("hi"), "max_tokens": 1, "pad": "a" * 60_000}  # under the limit
    assert httpx.post(url + "/v1/chat/completions", json=ok, timeout=60).status_code == 200


def test_a_prompt_that_takes_long_to_tokenize_holds_no_other_request():
    """Probe C5's stall: a big body's prompt (4 MB of text: ~1 s with K3's tokenizer) was tokenized on the
    event loop, and every other request (/health too) waited for it. Here the tokenizer holds a marked prompt
    until /health has answered, which it could never do with the tokenizing on the event loop."""
    holding, release = threading.Event(), threading.Event()

    class HoldingTokenizer(Tokenizer):
        def encode(self, text, *args, **kwargs):
            if "#hold#" in text:
                holding.set()
                assert release.wait(60), "never released"
            return super().encode(text, *args, **kwargs)

    tok = HoldingTokenizer({bytes([b]): b for b in range(256)})
    app = create_app(Engine(nano_model(), tok, max_num_seqs=2), served_model_name=MODEL)
    body = {"model": MODEL, "messages": user("#hold#"), "max_tokens": 2}
    with served(app) as url:
        held: dict = {}
        poster = threading.Thread(target=lambda: held.update(r=httpx.post(url + "/v1/chat/completions", json=body,
                                                                           timeout=60)))
        poster.start()
        try:
            assert holding.wait(60)
            assert httpx.get(url + "/health", timeout=20).status_code == 200  # answered while the prompt is held
        finally:
            release.set()
            poster.join(60)
        assert held["r"].status_code == 200


def test_more_choices_than_the_server_ever_holds_is_a_400_naming_the_limit(limited):
    url, state = limited
    assert state.loop.capacity == 4  # 2 running + 2 queued
    for body, param in (({"prompt": ["a"] * 5}, "prompt"), ({"prompt": ["a"] * 3, "n": 2}, "prompt"),
                        ({"prompt": "a", "n": 5}, "n")):
        err = envelope(httpx.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": 1, **body}), 400,
                       param=param, code="request_too_large")
        assert "(4:" in err["message"]
    envelope(httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user("a"), "n": 5}), 400,
             param="n", code="request_too_large")
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ["a"] * 4, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


# ---- engine liveness (C6) --------------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="stops the engine process with SIGSTOP")
def test_health_is_503_while_the_engine_process_is_stopped(limited):
    url, state = limited
    wait_until(lambda: _health(url) == 200, timeout=60)
    os.kill(state.loop.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: _health(url) == 503, timeout=60)  # no heartbeat for engine_timeout_s
    finally:
        os.kill(state.loop.pid, signal.SIGCONT)
    wait_until(lambda: _health(url) == 200, timeout=60)  # it goes on where it stopped
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
