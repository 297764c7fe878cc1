"""`openk3 serve MODEL [--host 127.0.0.1] [--port 8000] [--served-model-name NAME] [--api-key KEY] ...`

An OpenAI-compatible HTTP server (FastAPI + uvicorn) over one continuous-batching engine: /v1/models,
/v1/chat/completions, /v1/completions, /health, /metrics (docs/serving.md). MODEL is a checkpoint
folder or a training run folder, as `openk3 generate --model`. It listens on 127.0.0.1 unless --host
says otherwise: other machines can reach it only when asked for explicitly. The engine runs in a process
of its own (started and stopped with the server); `--engine-in-thread` keeps it in a thread of the HTTP
process instead (docs/serving.md). With `--port 0` the system picks a free port; the line printed at
startup names the one bound.

    openk3 serve runs/nano --served-model-name nano
    openk3 serve CKPT --host 0.0.0.0 --port 8000 --api-key "$KEY" --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path

from openk3.commands.common import add_dtype_argument
from openk3.commands.generate import add_stream_arguments, stream_kwargs

log = logging.getLogger("openk3.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="checkpoint folder, or a training run folder (its checkpoints/latest is used)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 = every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: MODEL's folder name)")
    p.add_argument("--api-key", default=os.environ.get("OPENK3_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $OPENK3_API_KEY; unset = no check)")
    p.add_argument("--max-num-seqs", type=int, default=16, metavar="N", help="requests decoded together (default 16)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests admitted beyond the running ones; more are answered 429 (default 256)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="prompt + completion tokens per request (default: the config's max_position_embeddings)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer folder (default: the checkpoint's own tiktoken.model)")
    add_dtype_argument(p, "auto", "compute dtype of the weights (auto: float32 on CPU, as stored on a GPU)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: $OPENK3_THREADS, else 1 on machines with <= 2 CPUs)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step (slow first requests, then fewer ms/token; docs/benchmarks.md)")
    p.add_argument("--keep-packed", action="store_true", help="keep MXFP4 experts packed in memory")
    add_stream_arguments(p, stats=False)  # the counters are on /metrics (openk3:expert_*)
    # infer.sample.LOGPROBS_MODES, spelled out: parsing the command line imports no torch (create_app checks)
    p.add_argument("--logprobs-mode", default="raw", choices=("raw", "processed"),
                   help="what requested logprobs describe: raw (the model's distribution, as OpenAI reports; "
                        "default) or processed (the distribution each token was drawn from, after the penalty, "
                        "temperature and top-k/top-p/min-p: what an RL trainer's importance ratio needs; greedy "
                        "requests: after the penalty alone)")
    # openk3.serve.effort.LEVELS, spelled out (no torch import here)
    p.add_argument("--default-effort", default=None, metavar="EFFORT",
                   choices=("minimal", "low", "medium", "high", "xhigh", "max", "none"),
                   help="reasoning effort of a chat request that names none: low, high, max, or none (thinking off); "
                        "OpenAI's minimal/medium/xhigh map to low/high/max (default: K3's own, max)")
    p.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="completion cap of a request that sets no max_tokens (default: up to --max-model-len)")
    p.add_argument("--sse-keepalive", type=float, default=15.0, metavar="S",
                   help="a stream with nothing to send for S seconds (a long prefill) sends an SSE comment so that "
                        "proxies keep it open (default 15; 0 = never)")
    p.add_argument("--max-body-mb", type=float, default=32.0, metavar="MB",
                   help="largest request body in MiB; a larger one is answered 413 (default 32)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a request body may take to arrive; then 408 (default 60)")
    p.add_argument("--header-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a connection may take to send its request headers; then it is closed (default 30)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections allowed; one more is answered 503 and closed (default: the file "
                        "descriptor limit less 128, at most 4096)")
    p.add_argument("--engine-timeout", type=float, default=20.0, metavar="S",
                   help="/health answers 503 once the engine process has been silent (no heartbeat) this long "
                        "(default 20)")
    p.add_argument("--engine-in-thread", action="store_true",
                   help="run the engine in a thread of the HTTP process instead of a process of its own (slower: "
                        "the two then share one interpreter lock; docs/serving.md)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info)")


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--max-model-len", args.max_model_len),
                        ("--default-max-tokens", args.default_max_tokens), ("--max-connections", args.max_connections)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--max-body-mb", args.max_body_mb), ("--body-timeout", args.body_timeout),
                        ("--header-timeout", args.header_timeout), ("--engine-timeout", args.engine_timeout)):
        if not value > 0:  # also NaN
            raise ValueError(f"{flag} must be > 0, got {value}")
    if not args.sse_keepalive >= 0:
        raise ValueError(f"--sse-keepalive must be >= 0 (0 = never), got {args.sse_keepalive}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key is empty; give a key or leave it out")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_server(args: argparse.Namespace):
    """The uvicorn.Server for these arguments, model loaded, not yet listening (main() runs it)."""
    import uvicorn

    from openk3.common import setup_cpu
    from openk3.infer.llm import LLM
    from openk3.serve import create_app, uvicorn_config

    _check(args)
    setup_cpu(args.threads)
    # A partial of the LLM class: picklable, so the engine process can build the engine itself (torch threads,
    # model load and all); the same arguments build it here with --engine-in-thread.
    build = functools.partial(LLM, args.model, args.tokenizer, dtype=args.dtype, device=args.device,
                              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                              compile=args.compile, keep_packed=args.keep_packed, **stream_kwargs(args))
    name = args.served_model_name or Path(args.model).resolve().name
    app = create_app(build, served_model_name=name, api_key=args.api_key, max_queue=args.max_queue,
                     engine_in_thread=args.engine_in_thread, threads=args.threads, logprobs_mode=args.logprobs_mode,
                     default_effort=args.default_effort, default_max_tokens=args.default_max_tokens,
                     sse_keepalive_s=args.sse_keepalive, max_body_bytes=int(args.max_body_mb * 2 ** 20),
                     body_timeout_s=args.body_timeout, engine_timeout_s=args.engine_timeout)
    if not _loopback(args.host):
        log.warning("listening on %s: reachable from other machines%s", args.host,
                    "" if args.api_key else " by anyone (no --api-key)")
    config = uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                            header_timeout_s=args.header_timeout, max_connections=args.max_connections)
    return uvicorn.Server(config)


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The listening socket, bound here rather than by uvicorn so that the port (the system's pick for 0)
    is known before serving, and a busy port is one clear error (OSError) instead of uvicorn's exit. It
    listens at once (uvicorn's default backlog), so that a client that connects as soon as the port is printed
    waits in the backlog until the app has started instead of being refused."""
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (a plain
    # socket() says 0), and without it Nagle holds each small SSE chunk until the previous one is acknowledged
    # (+20 ms to a stream's first chunk, measured); uvicorn's own sockets come from getaddrinfo and say TCP.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def main(args: argparse.Namespace) -> int:
    server = build_server(args)
    state = server.config.app.state.openk3
    try:
        sock = bind(args.host, args.port)
    except OSError:
        state.loop.stop()  # the engine process, already running, must not outlive the command
        raise
    port = sock.getsockname()[1]
    where = "in a thread" if state.engine is not None else f"process {state.loop.pid}"
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"[serve] {state.model_name} on http://{host}:{port}/v1 (engine {where}; Ctrl-C stops)",
          file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        state.loop.stop()  # a no-op after the lifespan's stop; else (startup failed) the engine process ends here
    return 0
