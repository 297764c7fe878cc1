"""`openk3 serve`: an OpenAI-compatible HTTP server over one continuous-batching engine (docs/serving.md).

    app.py          create_app: routes, API key, x-request-id, lifespan (engine process or thread)
    process.py      EngineProcess: the engine in a process of its own (the default), one message per step
    engine_main.py  that process's entry point (python -m openk3.serve.engine_main)
    loop.py         EngineLoop: the engine in a thread (the twin); bounded admission; guarded_step
    outputs.py      per-request collection of engine outputs, SSE framing, disconnect handling
    chat.py         /v1/chat/completions: XTML render, parsing on token ids, content stop strings
    completions.py  /v1/completions: text or token-id prompts
    protocol.py     request fields -> checked values and SamplingParams
    errors.py       the OpenAI error envelope and the exception handlers
    metrics.py      Prometheus text for /metrics
    static/         the web chat page served at / (index.html, chat.js, chat.css)
"""

from openk3.serve.app import create_app

__all__ = ["create_app"]
