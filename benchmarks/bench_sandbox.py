"""Sandbox latency (issue 17 item 7): start, first and warm `run`, an in-sandbox tool call, snapshot, fork
(n=1, n=8), restore, close, and episodes/s for a scripted 10-call episode, each beside a floor: the same work
without a sandbox (plain `subprocess` running `bash -c`, `cp -a` of the workspace for the state operations,
the tool code called in-process on a host folder).

    python benchmarks/bench_sandbox.py                  # 40 reps per row (fork n=8: a quarter), one table
    python benchmarks/bench_sandbox.py --reps 100 --json out.json

Rows (times in ms, p50 and p99 over the reps; with fewer than 100 reps p99 is the max or close to it):
- `start`: `Sandbox(files=...)` (builds the base layer; no process yet: the agent starts on the first call);
- `start + first run`: that, then `run("true")` (the goal: < 100 ms); floor: one `bash -c true`;
- `run`: a warm `run("true")` round trip; floor: `bash -c true`;
- `tool KVGet`: a warm in-sandbox tool call; floor: `toolbox.dispatch` in this process on a host folder;
- `snapshot`, `fork n`, `restore`: the call alone, and `+ run` (the call, then one `run` in the sandbox, or
  in every child: the agent restart those operations imply); floor: `cp -a` of the workspace (n copies);
- `close`;
- `episode`: a new sandbox, the 10 calls (a tool_arith reference solution padded with Shell calls), the
  verifier fork and grader, close; reported as ms and episodes/s. Floor: the same calls on a host folder
  (Shell through `bash -c`, tools in-process) and the grader as a host subprocess.

The goals (start + first call < 100 ms, fork < 20 ms) are printed beside the rows; nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from openk3.agent import Sandbox, toolbox, unavailable_reason  # noqa: E402
from openk3.agent.tasks import Call, generate, run_calls  # noqa: E402
from openk3.agent.tasks.base import write_tree  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _timed(fn, reps: int, setup=None, teardown=None) -> list[float]:
    """ms per call of fn(state) over `reps` (one untimed warm-up); setup() -> state before each, untimed."""
    out = []
    for i in range(reps + 1):
        state = setup() if setup else None
        t0 = time.perf_counter()
        res = fn(state)
        dt = (time.perf_counter() - t0) * 1e3
        if teardown:
            teardown(state, res)
        if i:
            out.append(dt)
    return out


def _bash(cmd: str, cwd: str | None = None) -> None:
    subprocess.run(["bash", "-c", cmd], cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, check=False)


def episode_calls(task) -> list[Call]:
    """The task's reference solution padded to 10 calls with Shell calls an agent would make."""
    pad = [Call("Shell", {"command": "ls -la"}), Call("Shell", {"command": "pwd && echo $HOME"}),
           Call("Shell", {"command": "wc -c .state/kv.sqlite"})]
    calls = list(task.solution)
    while len(calls) < 10:
        calls.insert(0, pad[(10 - len(calls)) % len(pad)])
    return calls[:10]


def _host_episode(task, calls: list[Call]) -> None:
    """The floor for an episode: the same calls and the grader with no sandbox (host folders)."""
    with tempfile.TemporaryDirectory(prefix="bench-ep-") as ws, task.grader_dir() as gd:
        write_tree(ws, task.files)
        for c in calls:
            if c.name == "Shell":
                _bash(c.args["command"], cwd=ws)
            else:
                toolbox.dispatch(c.name, c.args, root=ws)
        grade = open(os.path.join(gd, "grade.py")).read().replace("/grader", gd).replace('"/workspace"', repr(ws))
        subprocess.run([sys.executable, "-I", "-c", grade], cwd=ws, capture_output=True, check=False,
                       env={"OPENK3_NONCE": "n", "OPENK3_ANSWER": json.dumps("0"), "OPENK3_KEY": task.grader_key})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40, help="repetitions per row (fork n=8 and episodes: a quarter)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise SystemExit("--reps must be >= 1")
    why = unavailable_reason()
    if why is not None:
        raise SystemExit(f"bench_sandbox: no sandbox on this host: {why}")
    reps, few = args.reps, max(1, args.reps // 4)
    task = generate("tool_arith", 0, 3, "train")  # 5 reads + KVSet + Submit: 7 calls, padded to 10
    calls = episode_calls(task)
    rows: list[dict] = []

    def row(name: str, sb_ms: list[float], floor_ms: list[float] | None = None, note: str = "") -> None:
        r = {"op": name, "p50": statistics.median(sb_ms), "p99": _pct(sb_ms, 0.99), "reps": len(sb_ms), "note": note}
        if floor_ms:
            r.update(floor_p50=statistics.median(floor_ms), floor_p99=_pct(floor_ms, 0.99))
        rows.append(r)

    floor_dir = tempfile.mkdtemp(prefix="bench-floor-")
    write_tree(os.path.join(floor_dir, "ws"), task.files)
    try:
        bash_true = _timed(lambda _: _bash("true"), reps)
        copy = _timed(lambda _: _bash(f"cp -a {floor_dir}/ws {floor_dir}/copy"), reps,
                      teardown=lambda *_: shutil.rmtree(f"{floor_dir}/copy"))
        copy8 = _timed(lambda _: _bash(" && ".join(f"cp -a {floor_dir}/ws {floor_dir}/c{i}" for i in range(8))), few,
                       teardown=lambda *_: [shutil.rmtree(f"{floor_dir}/c{i}") for i in range(8)])
        restore_floor = _timed(lambda _: _bash(f"rm -rf {floor_dir}/copy && cp -a {floor_dir}/ws {floor_dir}/copy"),
                               reps)
        key = next(c.args["key"] for c in calls if c.name == "KVGet")  # a key the store holds
        kv_floor = _timed(lambda _: toolbox.dispatch("KVGet", {"key": key}, root=f"{floor_dir}/ws"), reps)

        def new_sb(_=None):
            return Sandbox(files=task.files, env=task.env)

        row("start", _timed(new_sb, reps, teardown=lambda _, sb: sb.close()), note="no process yet")
        row("start + first run", _first_run(new_sb, reps), bash_true, "goal < 100 ms")

        sb = new_sb()
        try:
            sb.run("true")
            row("run (warm)", _timed(lambda _: sb.run("true"), reps), bash_true)
            row("tool KVGet (warm)", _timed(lambda _: sb.tool("KVGet", {"key": key}), reps), kv_floor)
            base = sb.snapshot()

            def dirty():  # untimed: back to the base state, then one write, so each op seals one new layer
                sb.restore(base)
                sb.run("echo x >> f.txt")

            row("snapshot", _timed(lambda _: sb.snapshot(), reps, setup=dirty), copy, "after one write")
            row("snapshot + run", _timed(lambda _: (sb.snapshot(), sb.run("true")), reps, setup=dirty), copy)
            row("restore", _timed(lambda _: sb.restore(base), reps, setup=dirty), restore_floor)
            row("restore + run", _timed(lambda _: (sb.restore(base), sb.run("true")), reps, setup=dirty),
                restore_floor)
            for n, r, floor in ((1, reps, copy), (8, few, copy8)):
                row(f"fork n={n}", _timed(lambda _, n=n: sb.fork(n), r, setup=dirty, teardown=_close_all), floor,
                    "after one write" + ("; goal < 20 ms" if n == 1 else ""))
                row(f"fork n={n} + run each", _timed(lambda _, n=n: _fork_and_run(sb, n), r, setup=dirty,
                                                     teardown=_close_all), floor)
        finally:
            sb.close()
        row("close", _timed(lambda s: s.close(), reps, setup=lambda: _started(new_sb())))

        def episode(_):
            with new_sb() as s:
                answer = run_calls(s, calls, task.sql_mode)
                return task.score(s, answer)

        scores = []
        ep = _timed(lambda _: scores.append(episode(None)), few)
        ep_floor = _timed(lambda _: _host_episode(task, calls), few)
        assert all(x == 1.0 for x in scores), scores  # the scripted episode must be the real, passing one
        row("episode (10 calls + verify)", ep, ep_floor, f"{1e3 / statistics.median(ep):.1f} episodes/s; "
            f"floor {1e3 / statistics.median(ep_floor):.1f}/s")
    finally:
        shutil.rmtree(floor_dir, ignore_errors=True)

    load = os.getloadavg()[0]  # a shared host: a busy one shows in the p99s first
    print(f"bench_sandbox: {reps} reps (fork n=8 and episodes: {few}); uid {os.getuid()}; "
          f"{os.cpu_count()} CPUs, load {load:.2f}; times in ms")
    print(f"{'op':30s} {'p50':>8s} {'p99':>8s} {'floor p50':>10s} {'floor p99':>10s}  note")
    for r in rows:
        fl = (f"{r['floor_p50']:10.2f} {r['floor_p99']:10.2f}" if "floor_p50" in r else f"{'-':>10s} {'-':>10s}")
        print(f"{r['op']:30s} {r['p50']:8.2f} {r['p99']:8.2f} {fl}  {r['note']}")
    out = {"reps": reps, "uid": os.getuid(), "load": load, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _fork_and_run(sb: Sandbox, n: int) -> list[Sandbox]:
    kids = sb.fork(n)
    for k in kids:
        k.run("true")
    return kids


def _close_all(_state, kids: list[Sandbox]) -> None:
    for k in kids:
        k.close()


def _started(sb: Sandbox) -> Sandbox:
    sb.run("true")
    return sb


def _first_run(new_sb, reps: int) -> list[float]:
    boxes: list[Sandbox] = []

    def go(_):
        sb = new_sb()
        boxes.append(sb)
        sb.run("true")

    try:
        return _timed(go, reps, teardown=lambda *_: boxes.pop().close())
    finally:
        for sb in boxes:
            sb.close()


if __name__ == "__main__":
    main()
