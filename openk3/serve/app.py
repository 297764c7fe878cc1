"""`create_app`: the FastAPI app of `openk3 serve` (an OpenAI-compatible API over one engine).

    app = create_app(functools.partial(openk3.LLM, "runs/nano"), served_model_name="nano")  # engine process
    app = create_app(openk3.LLM("runs/nano"), served_model_name="nano")   # an in-memory engine: a thread
    uvicorn.run(app, host="127.0.0.1", port=8000)

Given a builder (a picklable callable returning an `openk3.LLM` or an `Engine`), the engine is built and
run in a process of its own (`process.EngineProcess`, started here: create_app returns once the engine is
ready); given an `LLM` or `Engine`, or `engine_in_thread=True`, it runs in a thread of this process
(`loop.EngineLoop`).

Every response echoes the request's `x-request-id` header, when it has one. Routes: GET /health, GET
/v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions, GET /metrics, and the web
chat page: GET /
(static/index.html) with its files under GET /static/NAME. With `api_key`, every /v1/* route needs
`Authorization: Bearer KEY`; /health, /metrics and the page stay open (probes, scrapers, and a page that holds
no secret: the user types the key into it). The engine loop starts delivering with the app's lifespan and
stops with it (the engine process exits). Request bodies are read within a size and a time limit
(`protocol.read_body`); the connections' own limits are uvicorn's config (`connections.uvicorn_config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.resources
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse

from openk3.infer.engine import Engine
from openk3.infer.sample import LOGPROBS_MODES
from openk3.serve import chat, completions, effort
from openk3.serve.connections import quiet_accept_errors
from openk3.serve.errors import APIError, bad_request, install_handlers
from openk3.serve.loop import EngineLoop
from openk3.serve.metrics import Metrics
from openk3.serve.outputs import unless_disconnected
from openk3.serve.process import HEARTBEAT_TIMEOUT_S, EngineProcess
from openk3.serve.protocol import MAX_BODY_BYTES, parse_body, read_body

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: Streams send an SSE comment after this long without a chunk: under the read timeouts of common proxies
#: (nginx 60 s, cloud load balancers 60-120 s), and as often as sse-starlette pings by default.
SSE_KEEPALIVE_S = 15.0
BODY_TIMEOUT_S = 60.0  # a 32 MiB body at about 0.5 MiB/s; nginx's client_body_timeout is 60 s too

# The web page's files (openk3/serve/static, package data) and their media types. A fixed list, not a
# directory mount: nothing else in the package can be fetched through /static.
_STATIC_TYPES = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8",
                 "favicon.svg": "image/svg+xml"}
# The page loads only its own files and talks only to this server: the browser refuses anything else
# (no CDN, no external fonts, no inline script for model output to smuggle in).
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _positive(name: str, value, *, zero_is_none: bool = False):
    """A server option that must be > 0 when given (None: off or the default); `zero_is_none`: 0 means off."""
    if value is None or (zero_is_none and value == 0):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return value


def _static_files() -> dict[str, bytes]:
    """The page's files, read once. Missing package data (a wheel built without it) fails here, at startup."""
    root = importlib.resources.files("openk3.serve") / "static"
    try:
        return {name: (root / name).read_bytes() for name in ("index.html", *_STATIC_TYPES)}
    except FileNotFoundError as e:
        raise RuntimeError(f"the web page's files are missing from {root} ({e.filename}): reinstall openk3 "
                           "with its package data (pyproject.toml [tool.setuptools.package-data])") from e


class EchoRequestId:
    """Echo a client's `x-request-id` header on its response (as vLLM does), to match logs on both sides. A raw
    ASGI wrapper: it adds one header to the response start and stays out of streamed bodies and disconnects."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        if scope["type"] != "http" or given is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", given)]
            await send(message)

        await self.app(scope, receive, send_with_id)


@dataclass
class ServerState:
    loop: EngineLoop | EngineProcess
    metrics: Metrics
    model_name: str
    api_key: str | None
    created: int
    tok: object
    vocab_size: int
    max_model_len: int
    engine: Engine | None = None  # the engine object when it runs in this process (a thread), else None
    logprobs_mode: str = "raw"  # what a request's logprobs describe (`SamplingParams.logprobs_mode`)
    default_effort: str | None = None  # K3's effort for a chat that names none (effort.LEVELS' values); None: max
    default_max_tokens: int | None = None  # the completion cap of a request that sets none; None: the context
    sse_keepalive_s: float | None = SSE_KEEPALIVE_S  # a comment after this long without a chunk; None: never
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S


def create_app(engine_source, served_model_name: str = "openk3", api_key: str | None = None,
               max_queue: int = 256, *, engine_in_thread: bool = False, threads: int | None = None,
               logprobs_mode: str = "raw", default_effort: str | None = None, default_max_tokens: int | None = None,
               sse_keepalive_s: float | None = SSE_KEEPALIVE_S, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S, engine_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> FastAPI:
    """The app over an engine: `engine_source` is a builder (a picklable callable returning an `openk3.LLM`
    or an `Engine` with a tokenizer: run in an engine process unless `engine_in_thread`), or an `LLM` or
    `Engine` already built (run in a thread).

    max_queue: requests admitted beyond the engine's `max_num_seqs` running ones; one more is a 429.
    threads: torch threads of the engine process (`setup_cpu`; None: its default).
    logprobs_mode: what the `logprobs` of every request describe: "raw" (the model's distribution, as the
        OpenAI API reports) or "processed" (the distribution each token was drawn from: after the penalty,
        temperature, top-k/top-p/min-p; a greedy request's: after the penalty alone; what an RL trainer's
        importance ratio needs; vLLM's `--logprobs-mode processed_logprobs`).
    default_effort: the reasoning effort of a chat request that names none: a value of `effort.LEVELS`
        (low, high, max, none; OpenAI's minimal/medium/xhigh are mapped); None keeps K3's default, max.
    default_max_tokens: the completion cap of a request that sets no max_tokens; None: what the context leaves.
    sse_keepalive_s: a stream that has had nothing to send this long sends an SSE comment (None or 0: never).
    max_body_bytes, body_timeout_s: a larger body is a 413, one that takes longer to arrive a 408.
    engine_timeout_s: /health is 503 once the engine process has not been heard from this long (its heartbeat).
    """
    if not served_model_name:
        raise ValueError("served_model_name must not be empty")
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty (None disables the check)")
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
    options = {"default_effort": effort.default_level(default_effort),
               "default_max_tokens": _positive("default_max_tokens", default_max_tokens),
               "sse_keepalive_s": _positive("sse_keepalive_s", sse_keepalive_s, zero_is_none=True),
               "max_body_bytes": _positive("max_body_bytes", max_body_bytes),
               "body_timeout_s": _positive("body_timeout_s", body_timeout_s)}
    static = _static_files()
    metrics = Metrics(served_model_name)
    built = getattr(engine_source, "engine", engine_source)
    if not isinstance(built, Engine) and callable(engine_source) and engine_in_thread:
        built = getattr(engine_source(), "engine", None)
        if not isinstance(built, Engine):
            raise TypeError("the engine builder must return an openk3.LLM or an Engine")
    if isinstance(built, Engine):
        if built.tok is None:
            raise ValueError("the server needs a tokenizer: give the LLM or Engine one")
        loop = EngineLoop(built, metrics, max_queue=max_queue)
        state = ServerState(loop, metrics, served_model_name, api_key, int(time.time()), built.tok,
                            built.cfg.vocab_size, built.max_model_len, built, logprobs_mode, **options)
    elif callable(engine_source):
        proc = EngineProcess(engine_source, metrics, max_queue=max_queue, threads=threads,
                             heartbeat_timeout_s=engine_timeout_s)
        state = ServerState(proc, metrics, served_model_name, api_key, int(time.time()), proc.info.tok,
                            proc.info.vocab_size, proc.info.max_model_len, None, logprobs_mode, **options)
    else:
        raise TypeError("create_app needs an openk3.LLM, an Engine, or a builder of one, got "
                        f"{type(engine_source).__name__}")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        quiet_accept_errors(asyncio.get_running_loop())
        state.loop.start()
        try:
            yield
        finally:
            state.loop.stop()

    app = FastAPI(title="openk3", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.openk3 = state
    app.add_middleware(EchoRequestId)
    install_handlers(app)

    def authorize(request: Request) -> None:
        """The API key check of every /v1 route (a plain call, not HTTP middleware: Starlette's
        BaseHTTPMiddleware wraps streamed bodies and would get between a disconnect and the generator)."""
        if state.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), state.api_key.encode()):
            what = "missing" if not given.strip() else "wrong"
            raise APIError(401, f"{what} API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.loop.healthy() else 503)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def page() -> Response:
        return HTMLResponse(static["index.html"], headers=_PAGE_HEADERS)

    @app.get("/static/{name}")
    async def static_file(name: str) -> Response:
        if name not in _STATIC_TYPES:
            raise APIError(404, f"no static file {name!r}", code="not_found")
        return Response(static[name], media_type=_STATIC_TYPES[name], headers=_PAGE_HEADERS)

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "openk3",
                "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        authorize(request)
        if model_id != state.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    def prepare(raw: bytes, endpoint) -> tuple[str, dict]:
        """(model, job) of a request body: parsed, checked, rendered and tokenized."""
        body = parse_body(raw)
        model = body.get("model")
        if not isinstance(model, str):
            raise bad_request(f"model must be a string naming the served model ({state.model_name!r})",
                              param="model")
        if model != state.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")
        return model, endpoint.prepare(state, body)

    async def run(request: Request, endpoint) -> Response:
        authorize(request)
        raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
        # In a worker thread: a long prompt takes seconds to tokenize (4 MB of text: ~1 s), and the tokenizer
        # lets go of the interpreter lock meanwhile, so the event loop goes on serving every other request.
        model, job = await asyncio.to_thread(prepare, raw, endpoint)
        headers = job.get("headers", {})
        if job["common"].stream:
            return StreamingResponse(await endpoint.stream(state, job, model), media_type="text/event-stream",
                                     headers=_SSE_HEADERS | headers)
        result = await unless_disconnected(request, endpoint.complete(state, job, model))
        return Response(status_code=499) if result is None else JSONResponse(result, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, chat)

    @app.post("/v1/completions")
    async def text_completions(request: Request) -> Response:
        return await run(request, completions)

    return app
