"""What tests/test_serve.py and tests/test_web.py share: the nano model and a 512-id byte tokenizer, scripted
outputs, and a live uvicorn on a free port.

Random weights cannot produce reasoning, content and tool calls on demand, so some requests are
scripted: a prompt containing `#script:NAME#` has its sampled ids replaced by the ids of SCRIPTS[NAME]
(the model still runs every step; only `Engine._sample` is wrapped). `#script:fail#` makes the sampling
step raise (a failing engine step).

The servers run the engine as `openk3 serve` does by default, in a process of its own: `scripted_nano`
is the builder that process calls (a module-level function, so `functools.partial(scripted_nano, ...)`
pickles), and `gate` (a file path) lets a test hold the engine's steps from the outside: they wait until
the file exists.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch

import openk3
from openk3.infer.engine import Engine
from openk3.tokenizer import Tokenizer
from openk3.train.config import TrainConfig
from openk3.train.config import apply_overrides as train_overrides

if TYPE_CHECKING:  # the engine process unpickles `scripted_nano` from here: it imports no HTTP library
    import httpx


#: What the engine process must not import (it serves no HTTP and compiles nothing): `scripted_nano` checks it there.
LEAN = ("fastapi", "starlette", "uvicorn", "httpx", "torch._dynamo")


def nano_model():
    """The nano preset cut to 4 layers (3 KDA + 1 MLA, two AttnRes blocks, MoE): every layer kind at under half of
    nano's ~20 ms per eager decode step on a slow core. These tests are about the server and the engine around the
    model; a scripted reply is ~170 tokens, so the per-token cost is most of their run time."""
    torch.manual_seed(0)
    cfg = train_overrides(TrainConfig(model=openk3.preset("nano")), ["model.num_hidden_layers=4"]).model
    return openk3.K3ForCausalLM.build(cfg, seed=0).eval()


def byte_tokenizer() -> Tokenizer:
    return Tokenizer({bytes([b]): b for b in range(256)})  # 256 bytes + 256 specials = 512


def _ids(tok, *parts) -> list[int]:
    """Text parts as byte ids; a part that is a special token's name becomes its control id."""
    out: list[int] = []
    for p in parts:
        out += [tok.special_ids[p]] if p in tok.special_ids else list(p.encode())
    return out


def scripts(tok) -> dict[str, list[int]]:
    O, C, S = "<|open|>", "<|close|>", "<|sep|>"
    end = (C, "message", S, "<|end_of_msg|>")
    return {
        # next-agents-serving.md §3.4: reasoning, content, one tool call
        "tool": _ids(tok, "I should read it.", C, "think", S, O, "response", S, "Let me check.", C, "response", S,
                     O, "tools", S, O, 'call tool="ReadFile" index="1"', S, O, 'argument key="path" type="string"',
                     S, "notes.txt", C, "argument", S, C, "call", S, C, "tools", S, *end),
        "text": _ids(tok, "hmm", C, "think", S, O, "response", S, "Hello world. Bye", C, "response", S, *end),
        "long": _ids(tok, "a"),  # "a" forever (the last id repeats)
    }


def script_engine(engine: Engine, tok) -> Engine:
    table = scripts(tok)
    original = engine._sample

    def script_of(req):
        if not hasattr(req, "script"):
            raw = bytes(i for i in req.prompt if i < 256)
            start = raw.rfind(b"#script:")
            name = raw[start + 8:raw.index(b"#", start + 8)].decode() if start >= 0 else None
            req.script = "fail" if name == "fail" else table[name] if name else None
        return req.script

    def sample(reqs, logits):
        toks = original(reqs, logits)
        for i, req in enumerate(reqs):
            script = script_of(req)
            if script == "fail":
                raise RuntimeError("injected sampling failure")
            if script is not None:
                toks[i] = script[min(len(req.out), len(script) - 1)]
        return toks

    engine._sample = sample
    return engine


def scripted_nano(max_num_seqs: int = 4, gate: str | None = None, script: bool = True, exit_mark: str | None = None,
                  **engine_kw) -> Engine:
    """The nano engine with the scripted outputs (none with script=False), built in whichever process calls
    it. `gate`: a file path; every step waits until that file exists (a file, because the engine process
    shares no memory with the test). `exit_mark`: a file path the process writes if it runs its interpreter's
    teardown (atexit)."""
    if exit_mark is not None:
        atexit.register(lambda: open(exit_mark, "w").close())
    tok = byte_tokenizer()
    engine = Engine(nano_model(), tok, max_num_seqs=max_num_seqs, **engine_kw)
    main = getattr(sys.modules["__main__"], "__spec__", None)
    heavy = [m for m in LEAN if m in sys.modules]
    if main is not None and main.name == "openk3.serve.engine_main" and heavy:
        raise ValueError(f"the engine process imported {heavy}: each engine start pays for them")
    if script:
        script_engine(engine, tok)
    if gate is not None:
        step = engine.step

        def gated_step():
            deadline = time.monotonic() + 120
            while not os.path.exists(gate):
                assert time.monotonic() < deadline, "the gate never opened"
                time.sleep(0.005)
            return step()

        engine.step = gated_step
    return engine


def scripted_builder(max_num_seqs: int = 4, **kw):
    """`create_app`'s builder of `scripted_nano` (picklable: the engine process calls it)."""
    return functools.partial(scripted_nano, max_num_seqs, **kw)


@contextlib.contextmanager
def served(app, **limits):
    """uvicorn on 127.0.0.1:<free port> in a thread, configured as `openk3 serve` does (`uvicorn_config`;
    `limits`: its header_timeout_s, max_connections); yields the base URL; stops it and joins the thread."""
    import uvicorn

    from openk3.serve import uvicorn_config

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY: see commands/serve.bind
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", **limits))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive()
        assert app.state.openk3.loop.stopped()  # the engine thread or process has ended


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE body (JSON decoded; the final "[DONE]" kept as a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def envelope(r: httpx.Response, status: int, param=None, code=None) -> dict:
    """The error of an OpenAI error envelope answer, checked: its status, exactly its four keys, its param/code."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == param and (code is None or body["error"]["code"] == code), body
    return body["error"]


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
