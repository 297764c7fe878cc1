"""`openk3 serve` under load, as `vllm bench serve` measures it (next-agents-serving.md §4.4): requests/s,
output tokens/s, time to first token (TTFT), time per output token after the first (TPOT), the gap
between text chunks (ITL: a chunk carries several tokens when some decode to no text, as the special
ids a random model emits do) and the whole request (E2E), at 1, 8 and 32 concurrent streaming clients
over loopback; and the same metrics for the same requests fed to an `openk3.infer.engine.Engine` in this
process (the in-process contender: no HTTP, no JSON, no streaming), so that the table shows what serving
costs (issue 16 item 7: HTTP + streaming overhead <= 10 % of in-process tokens/s at 8 clients).

The server is the real command in its own process (`python -m openk3 serve`, so that the clients do not
share its interpreter; its engine in a process of its own, the command's default, or with
`--engine-in-thread` in a thread of the server, the twin), over a preset's random-weight model saved to a
temporary checkpoint with a byte tokenizer; or any OpenAI-compatible server already running (`--url`,
`--model`), e.g. vLLM or SGLang serving K3, for parity. Every request is a streamed `/v1/completions` of
exactly `--max-tokens` tokens (`ignore_eos`, greedy), so the levels do the same work per request:

    python benchmarks/bench_serve.py                                  # nano, 1/8/32 clients
    python benchmarks/bench_serve.py --preset small --concurrency 1 8 --requests 32 --max-tokens 64
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --model k3     # HTTP only

The in-process engine loads the same checkpoint with the same `max_num_seqs` and thread count as the server
and runs a closed loop like the HTTP clients: c requests in flight, the next one added when one finishes; a
"chunk" is an output that carries text or finishes, as the server sends one. Per concurrency level the two
contenders alternate (in-process, then HTTP, `--repeats` times), never at the same time (the idle server
waits on a condition variable), and each row is the median over the repeats of every number. The overhead
line is 1 - (HTTP out tok/s) / (in-process out tok/s).

Prints one table (mean, p50, p90, p99 in ms); nothing asserts on time. OPENK3_BENCH_PROFILE=<path> runs
the server under cProfile, one profiler per thread, and writes their stats to <path> (the main thread:
asyncio, HTTP, JSON) and <path>.<thread name> (with --engine-in-thread, the engine loop) when it stops, to
find where the overhead goes; the engine process (the default) is not profiled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
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
from openk3.common import setup_cpu  # noqa: E402
from openk3.infer.engine import Engine  # noqa: E402
from openk3.infer.sample import SamplingParams  # noqa: E402
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


# `python -c` this, then the profile path, then `openk3`'s arguments: `openk3 serve` under cProfile, with one
# profiler per thread (`python -m cProfile` would see the main thread only, not the engine loop's), each
# written when its thread ends: the main thread's to <path>, the others' to <path>.<thread name>.
PROFILE_BOOTSTRAP = """
import cProfile, runpy, sys, threading
out = sys.argv.pop(1)
run = threading.Thread.run
def profiled_run(self):
    prof = cProfile.Profile()
    try:
        prof.runcall(run, self)
    finally:
        prof.dump_stats(out + "." + self.name)
threading.Thread.run = profiled_run
sys.argv[0] = "openk3"
prof = cProfile.Profile()
try:
    prof.runcall(runpy.run_module, "openk3", run_name="__main__", alter_sys=True)
finally:
    prof.dump_stats(out)
"""


def start_server(ckpt: str, port: int, max_num_seqs: int, threads: int, log,
                 engine_in_thread: bool = False) -> subprocess.Popen:
    """`openk3 serve` in its own process; its output goes to the file `log` (a pipe nobody reads could fill
    and stall the server). With $OPENK3_BENCH_PROFILE=<path>, the server runs under cProfile (`PROFILE_BOOTSTRAP`)."""
    profile = os.environ.get("OPENK3_BENCH_PROFILE")
    python = [sys.executable] + (["-c", PROFILE_BOOTSTRAP, profile] if profile else ["-m", "openk3"])
    cmd = python + ["serve", ckpt, "--host", "127.0.0.1", "--port", str(port),
                    "--served-model-name", "bench", "--max-num-seqs", str(max_num_seqs), "--threads", str(threads),
                    "--log-level", "warning"] + (["--engine-in-thread"] if engine_in_thread else [])
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


def prompt_text(k: int, prompt_len: int) -> str:
    """Request k's prompt: `prompt_len` bytes, so `prompt_len` tokens with the byte tokenizer."""
    return (f"request {k}: " + "def f(x): return x\n" * prompt_len)[:prompt_len]


def summarize(concurrency: int, results: list[dict], wall: float) -> dict:
    """One level's row from its requests (`one_request`'s dicts) and its wall time."""
    ok = [r for r in results if r["ok"]]
    return {"concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:3], "wall_s": wall,
            "requests_per_s": len(ok) / wall, "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_ms": percentiles([1e3 * r["ttft"] for r in ok]),
            "tpot_ms": percentiles([1e3 * r["tpot"] for r in ok if r["tpot"] is not None]),
            "itl_ms": percentiles([1e3 * x for r in ok for x in r["itl"]]),
            "e2e_ms": percentiles([1e3 * r["e2e"] for r in ok])}


def timings(t0: float, arrivals: list[float], end: float, tokens: int) -> dict:
    """A finished request's TTFT, TPOT, ITL and E2E from its start, chunk arrivals and end (seconds)."""
    ttft = arrivals[0] - t0
    return {"ok": True, "ttft": ttft, "e2e": end - t0, "tokens": tokens,
            "tpot": (end - t0 - ttft) / (tokens - 1) if tokens > 1 else None,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])]}


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
    return timings(t0, arrivals, end, tokens)


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
            results.append(await one_request(http, model, prompt_text(k, prompt_len), max_tokens))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600), limits=limits) as http:
        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    # the clients' own CPU: on a machine with few cores it is taken from the server (the engine does not pay it)
    return {**summarize(concurrency, results, wall), "client_cpu_share": cpu / wall}


def run_inprocess_level(engine: Engine, concurrency: int, requests: int, prompt_len: int, max_tokens: int) -> dict:
    """The same requests as `run_level`, fed to `engine` in this process: `concurrency` in flight, the next
    added when one finishes. A chunk arrives when a step's output carries text or finishes (what the server
    streams); its time is when `step()` returns, where a caller of the engine first sees it."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    todo = iter(range(requests))
    live: dict[str, dict] = {}  # request id -> start time and chunk arrivals
    results: list[dict] = []

    def submit() -> None:
        k = next(todo, None)
        if k is not None:
            t0 = time.perf_counter()
            live[engine.add_request(prompt_text(k, prompt_len), params, ignore_eos=True)] = {"t0": t0, "arrivals": []}

    t_start = time.perf_counter()
    for _ in range(concurrency):
        submit()
    while live:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rec = live[out.request_id]
            if out.delta_text or out.finished:
                rec["arrivals"].append(now)
            if out.finished:
                del live[out.request_id]
                results.append(timings(rec["t0"], rec["arrivals"], now, len(out.token_ids)))
                submit()
    return summarize(concurrency, results, time.perf_counter() - t_start)


def median_row(rows: list[dict]) -> dict:
    """The median over repeats of every number in `rows` (same level, same contender); counts are summed."""
    out = {"concurrency": rows[0]["concurrency"], "repeats": len(rows),
           "completed": sum(r["completed"] for r in rows), "failed": sum(r["failed"] for r in rows),
           "errors": sorted({e for r in rows for e in r["errors"]})[:3]}
    for k in ("wall_s", "requests_per_s", "output_tokens_per_s", "client_cpu_share"):
        if k in rows[0]:
            out[k] = statistics.median(r[k] for r in rows)
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        out[k] = {q: statistics.median(r[k][q] for r in rows) for q in rows[0][k]}
    return out


def print_row(contender: str, row: dict) -> None:
    cells = [" / ".join(f"{row[k][q]:.0f}" for q in ("mean", "p50", "p90", "p99"))
             for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")]
    print(f"| {row['concurrency']} | {contender} | {row['completed']} ({row['failed']}) | "
          f"{row['requests_per_s']:.2f} | {row['output_tokens_per_s']:.1f} | " + " | ".join(cells) + " |", flush=True)
    for e in row["errors"]:
        print(f"  failed: {e}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="nano", help="the model the server loads (random weights; default nano)")
    ap.add_argument("--url", default=None, help="benchmark a server already running here instead of starting one "
                    "(HTTP only: the in-process engine needs the checkpoint)")
    ap.add_argument("--model", default="bench", help="the model name to send with --url (default bench)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default 2 x concurrency, >= 8)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the server and of the in-process engine (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per level and contender; rows are medians (default 3)")
    ap.add_argument("--engine-in-thread", action="store_true",
                    help="the server's engine in a thread of the HTTP process (the twin) instead of its own process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if (min(args.concurrency) < 1 or args.prompt_len < 1 or args.max_tokens < 1 or (args.requests or 1) < 1
            or args.repeats < 1):
        raise ValueError("--concurrency, --requests, --prompt-len, --max-tokens and --repeats must be >= 1, got "
                         f"{args.concurrency}, {args.requests}, {args.prompt_len}, {args.max_tokens}, {args.repeats}")
    setup_cpu(args.threads)  # the in-process engine's threads, as the server's --threads
    machine = (machine_line(args.threads) + f"; server and in-process engine threads {args.threads}, "
               f"server engine in {'a thread' if args.engine_in_thread else 'its own process'}, "
               "clients in one asyncio process")
    result = {"machine": machine, "preset": None if args.url else args.preset, "prompt_len": args.prompt_len,
              "engine_in_thread": args.engine_in_thread,
              "max_tokens": args.max_tokens, "repeats": args.repeats, "levels": [], "inprocess_levels": []}
    proc = None
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "server.log"), "wb") as log:
        url, model, engine = args.url, args.model, None
        if url is None:
            port = free_port()
            ckpt = save_preset(args.preset, os.path.join(tmp, "ckpt"))
            proc = start_server(ckpt, port, max(args.concurrency), args.threads, log, args.engine_in_thread)
            url, model = f"http://127.0.0.1:{port}", "bench"
            # loaded as `openk3 serve` loads it (same dtype rule, max_num_seqs, no compile), while the server starts
            engine = openk3.LLM(ckpt, max_num_seqs=max(args.concurrency)).engine
        try:
            wait_healthy(url, proc, log.name)
            asyncio.run(run_level(url, model, 1, 1, args.prompt_len, 2))  # warm-up: first-call costs
            if engine is not None:
                run_inprocess_level(engine, 1, 1, args.prompt_len, 2)
            print(machine)
            print(f"\n{result['preset'] or url}: prompt {args.prompt_len} tokens, {args.max_tokens} generated per "
                  f"request; medians of {args.repeats} runs; times in ms as mean / p50 / p90 / p99")
            print("| clients | contender | done (failed) | req/s | out tok/s | TTFT | TPOT | ITL | E2E |")
            print("|---|---|---|---|---|---|---|---|---|")
            overheads = []
            for c in args.concurrency:
                n = args.requests or max(8, 2 * c)
                http_runs, local_runs = [], []
                for _ in range(args.repeats):  # alternate, so a slow phase of the machine hits both
                    if engine is not None:
                        local_runs.append(run_inprocess_level(engine, c, n, args.prompt_len, args.max_tokens))
                    http_runs.append(asyncio.run(run_level(url, model, c, n, args.prompt_len, args.max_tokens)))
                row = median_row(http_runs)
                result["levels"].append(row)
                if engine is not None:
                    local = median_row(local_runs)
                    result["inprocess_levels"].append(local)
                    print_row("in-process", local)
                    row["overhead"] = 1 - row["output_tokens_per_s"] / local["output_tokens_per_s"]
                    overheads.append((c, row["overhead"]))
                print_row("HTTP", row)
            for (c, o), row in zip(overheads, result["levels"], strict=True):
                target = "; target <= 10 %: " + ("met" if o <= 0.10 else "MISSED") if c == 8 else ""
                print(f"HTTP + streaming overhead at {c} clients: {100 * o:.1f} % of in-process out tok/s "
                      f"(the clients used {100 * row['client_cpu_share']:.0f} % of a CPU{target})")
        finally:
            if proc is not None:
                # SIGINT ends the profiled run with KeyboardInterrupt, which still writes the stats; SIGTERM would not
                if os.environ.get("OPENK3_BENCH_PROFILE"):
                    proc.send_signal(signal.SIGINT)
                else:
                    proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return write_json(args.json, result)


if __name__ == "__main__":
    main()
