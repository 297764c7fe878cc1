"""`openk3 serve`: an OpenAI-compatible HTTP server over one continuous-batching engine (docs/serving.md).

    app.py          create_app: routes, API key, x-request-id, lifespan (engine process or thread)
    connections.py  uvicorn_config: the h11 protocol with a header deadline, a connection cap, TCP keepalive
    process.py      EngineProcess: the engine in a process of its own (the default), one message per step
    engine_main.py  that process's entry point (python -m openk3.serve.engine_main)
    loop.py         EngineLoop: the engine in a thread (the twin); bounded admission; guarded_step
    outputs.py      per-request collection of engine outputs, SSE framing, disconnect handling
    chat.py         /v1/chat/completions: XTML render, parsing on token ids, content stop strings
    messages.py     the shapes of a chat's messages and tools (400s naming the field path)
    effort.py       reasoning_effort: OpenAI's values -> K3's low/high/max or off; the server's default
    legacy.py       legacy functions / function_call <-> tools, both ways
    completions.py  /v1/completions: text or token-id prompts
    protocol.py     request bodies (size, time, nesting bounded) and fields -> checked values and SamplingParams
    errors.py       the OpenAI error envelope and the exception handlers
    metrics.py      Prometheus text for /metrics
    static/         the web chat page served at / (index.html, chat.js, chat.css)
"""

__all__ = ["create_app", "uvicorn_config"]


def __getattr__(name: str):
    """The HTTP side on first use: the engine process (`python -m openk3.serve.engine_main`, which imports this
    package first) never serves HTTP, and importing fastapi, starlette and uvicorn cost each engine start ~0.7 s of
    CPU (`python -X importtime -m openk3.serve.engine_main`)."""
    if name == "create_app":
        from openk3.serve.app import create_app

        return create_app
    if name == "uvicorn_config":
        from openk3.serve.connections import uvicorn_config

        return uvicorn_config
    raise AttributeError(f"module 'openk3.serve' has no attribute {name!r}")
