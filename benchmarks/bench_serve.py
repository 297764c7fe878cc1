"""`openk3 serve` under load, as `vllm bench serve` measures it (next-agents-serving.md §4.4): requests/s,
output tokens/s, time to first token (TTFT), time per output token after the first (TPOT), the gap
between text chunks (ITL: a chunk carries several tokens when some decode to no text, as the special
ids a random model emits do) and the whole request (E2E), at 1, 8 and 32 concurrent streaming clients
over loopback.

The server is the real command in its own process (`python -m openk3 serve`, so that the clients do not
share its interpreter), over a preset's random-weight model saved to a temporary checkpoint with a byte
tokenizer; or any OpenAI-compatible server already running (`--url`, `--model`), e.g. vLLM or SGLang
serving K3, for parity. Every request is a streamed `/v1/completions` of exactly `--max-tokens` tokens
(`ignore_eos`, greedy), so the levels do the same work per request:

    python benchmarks/bench_serve.py                                  # nano, 1/8/32 clients
    python benchmarks/bench_serve.py --preset small --concurrency 1 8 --requests 32 --max-tokens 64
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --model k3

Prints one table (mean, p50, p90, p99 in ms); nothing asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, write_json  # noqa: E402

import openk3  # noqa: E402
from openk3.tokenizer import Tokenizer  # noqa: E402

STARTUP_S = 120  # the server process imports torch and builds the model before /health answers


def percentiles(xs: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 of `xs` (nearest rank); NaN when there are none."""
    if not xs:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p99")}
    s = sorted(xs)
    rank = {q: s[min(len(s) - 1, int(q / 100 * len(s)))] for q in (50, 90, 99)}
    return {"mean": statistics.fmean(s), "p50": rank[50], "p90": rank[90], "p99": rank[99]}


def save_preset(preset: str, folder: str) -> str:
    """A random-weight `preset` checkpoint with a 512-id byte tokenizer (256 bytes + the specials)."""
    model = openk3.K3ForCausalLM.build(openk3.preset(preset), seed=0)
    openk3.save(model, folder, dtype=torch.float32)
    Tokenizer({bytes([b]): b for b in range(256)}).save(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: str, port: int, max_num_seqs: int, threads: int, log) -> subprocess.Popen:
    """`openk3 serve` in its own process; its output goes to the file `log` (a pipe nobody reads could fill
    and stall the server)."""
    cmd = [sys.executable, "-m", "openk3", "serve", ckpt, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "bench", "--max-num-seqs", str(max_num_seqs), "--threads", str(threads),
           "--log-level", "warning"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen | None, log_path: str | None) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            with open(log_path, errors="replace") as fh:
                raise RuntimeError(f"the server exited with {proc.returncode}: {fh.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} was not healthy within {STARTUP_S} s")


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals, tokens, error = [], 0, None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
            elif event.get("choices"):
                arrivals.append(time.perf_counter())
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    if error is not None or not arrivals:
        return {"ok": False, "error": error or "no chunk arrived"}
    ttft = arrivals[0] - t0
    return {"ok": True, "ttft": ttft, "e2e": end - t0, "tokens": tokens,
            "tpot": (end - t0 - ttft) / (tokens - 1) if tokens > 1 else None,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])]}


async def run_level(url: str, model: str, concurrency: int, requests: int, prompt_len: int,
                    max_tokens: int) -> dict:
    """`requests` requests through `concurrency` clients, each sending its next one when the last ends."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for k in range(requests):
        queue.put_nowait(k)
    results: list[dict] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            k = queue.get_nowait()
            prompt = (f"request {k}: " + "def f(x): return x\n" * prompt_len)[:prompt_len]  # a byte per token
            results.append(await one_request(http, model, prompt, max_tokens))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600), limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    return {"concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:3], "wall_s": wall,
            "requests_per_s": len(ok) / wall, "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_ms": percentiles([1e3 * r["ttft"] for r in ok]),
            "tpot_ms": percentiles([1e3 * r["tpot"] for r in ok if r["tpot"] is not None]),
            "itl_ms": percentiles([1e3 * x for r in ok for x in r["itl"]]),
            "e2e_ms": percentiles([1e3 * r["e2e"] for r in ok])}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="nano", help="the model the server loads (random weights; default nano)")
    ap.add_argument("--url", default=None, help="benchmark a server already running here instead of starting one")
    ap.add_argument("--model", default="bench", help="the model name to send with --url (default bench)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default 2 x concurrency, >= 8)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads (default 1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if min(args.concurrency) < 1 or args.prompt_len < 1 or args.max_tokens < 1 or (args.requests or 1) < 1:
        raise ValueError("--concurrency, --requests, --prompt-len and --max-tokens must be >= 1, got "
                         f"{args.concurrency}, {args.requests}, {args.prompt_len}, {args.max_tokens}")
    machine = machine_line(args.threads) + f"; server threads {args.threads}, clients in one asyncio process"
    result = {"machine": machine, "preset": None if args.url else args.preset, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "levels": []}
    proc = None
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "server.log"), "wb") as log:
        url, model = args.url, args.model
        if url is None:
            port = free_port()
            proc = start_server(save_preset(args.preset, os.path.join(tmp, "ckpt")), port,
                                max(args.concurrency), args.threads, log)
            url, model = f"http://127.0.0.1:{port}", "bench"
        try:
            wait_healthy(url, proc, log.name)
            asyncio.run(run_level(url, model, 1, 1, args.prompt_len, 2))  # warm-up: first-call costs
            print(machine)
            print(f"\n{result['preset'] or url}: prompt {args.prompt_len} tokens, {args.max_tokens} generated per "
                  "request; times in ms as mean / p50 / p90 / p99")
            print("| clients | done (failed) | req/s | out tok/s | TTFT | TPOT | ITL | E2E |")
            print("|---|---|---|---|---|---|---|---|")
            for c in args.concurrency:
                n = args.requests or max(8, 2 * c)
                row = asyncio.run(run_level(url, model, c, n, args.prompt_len, args.max_tokens))
                result["levels"].append(row)
                cells = [" / ".join(f"{row[k][q]:.0f}" for q in ("mean", "p50", "p90", "p99"))
                         for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")]
                print(f"| {c} | {row['completed']} ({row['failed']}) | {row['requests_per_s']:.2f} | "
                      f"{row['output_tokens_per_s']:.1f} | " + " | ".join(cells) + " |", flush=True)
                for e in row["errors"]:
                    print(f"  failed: {e}")
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return write_json(args.json, result)


if __name__ == "__main__":
    main()
