"""One-shot device check on one CUDA GPU (issue 32): everything openk3 cannot check on a CPU, in <= 8 minutes,
with one JSON summary. `scripts/gpu_check.sh` runs it; `--dry-run` prints the plan anywhere (no GPU needed).

Steps, each a subprocess with a timeout cut from `--budget-s` (a step that overruns is recorded and the next runs):

1. `environment`: torch, CUDA, the device, triton and fla versions (fla's kernels need both).
2. `tests`: the `gpu` test tier (tests/test_gpu.py): fla's kernels against the PyTorch twins on the GPU in float32
   and bfloat16, the nano model with backend="fla" against "chunked", bf16 autocast against float32, a compiled
   training step against eager; each with the tolerance stated in that file. Passed / failed / skipped counts.
3. `bench_train`: `benchmarks/bench_train.py --device cuda` at a `base`-like shape (the `base` preset: hidden
   1024, 21 layers, 256 experts top-16), bf16 autocast: tokens/s, model TFLOP/s and MFU against the device's
   dense bf16 peak (a table of known devices, else none).
4. `bench_decode`: the generation engine's decode tokens/s on the GPU at batch 1 and 16 (`bench_decode.engine_run`:
   the same timing as the CPU benchmark, without its transformers peer).

The summary (`OUT/gpu_check.json`, schema "openk3.gpu_check/1"): `device`, `steps` (name, command, status
"ok" | "failed" | "timeout" | "planned", seconds, and the step's own JSON `result` where it writes one), `ok`.
Record it in docs/benchmarks.md with the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "openk3.gpu_check/1"
STEPS = ("environment", "tests", "bench_train", "bench_decode")
CHOSEN = STEPS[1:]  # `--steps` picks among these; the environment always runs first (it finds the device)
# Dense bf16 tensor-core peaks (TFLOP/s) by device name, for MFU; unknown devices get none.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0, "A10": 125.0}
MIN_BUDGET_S = 60

ENV_CODE = """
import json, torch
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if out["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    out.update(name=p.name, memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
               count=torch.cuda.device_count())
for mod in ("triton", "fla"):
    try:
        out[mod] = __import__(mod).__version__
    except Exception as e:
        out[mod] = f"not importable: {type(e).__name__}: {e}"
print(json.dumps(out))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/gpu_check", help="folder for gpu_check.json and the steps' files")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget for all steps (default 480)")
    ap.add_argument("--steps", default=",".join(CHOSEN), help=f"comma-separated subset of {', '.join(CHOSEN)}")
    ap.add_argument("--python", default=sys.executable, help="the Python with a CUDA torch (default: this one)")
    ap.add_argument("--dry-run", action="store_true", help="write the plan (commands, timeouts) and run nothing")
    ap.add_argument("--decode-worker", action="store_true", help=argparse.SUPPRESS)  # step 4's subprocess
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in CHOSEN]
    if bad or not steps:
        ap.error(f"--steps: unknown {bad or 'empty'}; choose from {', '.join(CHOSEN)}")
    if args.budget_s < MIN_BUDGET_S:
        ap.error(f"--budget-s must be >= {MIN_BUDGET_S}, got {args.budget_s:g}")
    args.steps = steps
    return args


def plan(args: argparse.Namespace, device_name: str | None = None) -> list[dict]:
    """The steps to run: name, command, share of the budget (seconds), and where its JSON result goes."""
    out = Path(args.out)
    py = args.python
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if device_name and k in device_name), None)
    train = [py, str(ROOT / "benchmarks" / "bench_train.py"), "--device", "cuda", "--preset", "base", "--no-peer",
             "--dtype", "bf16", "--batch", "4", "--seq", "2048", "--repeats", "5", "--warmup", "2",
             "--json", str(out / "bench_train.json")]
    if peak is not None:
        train += ["--peak-tflops", str(peak)]
    commands = {
        "environment": ([py, "-c", ENV_CODE], 0.05, None),
        "tests": ([py, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", str(ROOT / "tests" / "test_gpu.py"),
                   "-q", f"--junitxml={out / 'tests.xml'}"], 0.45, out / "tests.xml"),
        "bench_train": (train, 0.3, out / "bench_train.json"),
        "bench_decode": ([py, str(Path(__file__).resolve()), "--decode-worker", "--json",
                          str(out / "bench_decode.json")], 0.2, out / "bench_decode.json"),
    }
    return [{"name": name, "command": commands[name][0], "timeout_s": round(args.budget_s * commands[name][1], 1),
             "result_file": None if commands[name][2] is None else str(commands[name][2])}
            for name in STEPS if name == "environment" or name in args.steps]


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # a step killed mid-write leaves no usable result, not a crash
        return None


def run_step(step: dict, deadline: float) -> dict:
    if step["result_file"]:  # a result from an earlier run in the same folder must not pass for this run's
        Path(step["result_file"]).unlink(missing_ok=True)
    timeout = max(1.0, min(step["timeout_s"], deadline - time.monotonic()))
    t0 = time.monotonic()
    record = {k: step[k] for k in ("name", "command", "timeout_s")}
    try:
        proc = subprocess.run(step["command"], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        record["status"] = "ok" if proc.returncode == 0 else "failed"
        record["returncode"] = proc.returncode
        record["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
        stdout = proc.stdout
    except subprocess.TimeoutExpired as e:
        record["status"] = "timeout"
        record["output_tail"] = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                                 else (e.stdout or ""))[-4000:]
        stdout = ""
    record["seconds"] = round(time.monotonic() - t0, 2)
    if step["name"] == "environment" and record["status"] == "ok":
        try:
            record["result"] = json.loads(stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            record["status"] = "failed"
    elif step["result_file"] and step["name"] == "tests":
        record["result"] = junit_counts(Path(step["result_file"]))
    elif step["result_file"]:
        record["result"] = _read_json(Path(step["result_file"]))
    return record


def junit_counts(path: Path) -> dict | None:
    """{"passed", "failed", "errors", "skipped"} from pytest's JUnit XML, or None when there is none."""
    if not path.exists():
        return None
    try:
        suite = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return {"passed": total - failed - errors - skipped, "failed": failed, "errors": errors, "skipped": skipped}


def summary(args: argparse.Namespace, device: dict | None, steps: list[dict], started: str) -> dict:
    ran = [s for s in steps if s.get("status") != "planned"]
    return {"schema": SCHEMA, "started": started, "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "budget_s": args.budget_s, "dry_run": args.dry_run, "device": device, "steps": steps,
            "ok": bool(ran) and all(s["status"] == "ok" for s in ran)}


def write_summary(out: Path, data: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_check.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: a killed check never leaves half a summary
    return path


def decode_worker(json_path: str | None) -> dict:
    """Step 4 (in its own process): the engine's decode speed on the GPU, `base` preset, bf16 weights."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_decode import engine_run

    from openk3.config import preset
    from openk3.model.model import K3ForCausalLM

    cfg = preset("base")
    model = K3ForCausalLM.build(cfg, seed=0, device="cuda", dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    result = {"preset": "base", "dtype": "bf16", "prompt_len": 512, "new_tokens": 64, "batches": []}
    for B in (1, 16):
        prompts = torch.randint(0, cfg.vocab_size, (B, 512), generator=gen).tolist()
        engine_run(model, prompts, 8)  # warm-up
        r = engine_run(model, prompts, 64)
        result["batches"].append({"batch": B, "decode_tokens_per_s": r["decode_tokens"] / r["decode_s"],
                                  "first_step_s": r["first_step_s"]})
        print(f"batch {B}: decode {result['batches'][-1]['decode_tokens_per_s']:.1f} tok/s", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.decode_worker:
        decode_worker(args.json)
        return 0
    started = datetime.datetime.now(datetime.timezone.utc).isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        steps = [{**s, "status": "planned"} for s in plan(args)]
        path = write_summary(out, summary(args, None, steps, started))
        for s in steps:
            shown = " ".join(c if "\n" not in c else "<code>" for c in s["command"])
            print(f"{s['name']:13s} <= {s['timeout_s']:6.1f} s  {shown}")
        print(f"plan written to {path}")
        return 0
    deadline = time.monotonic() + args.budget_s
    env = run_step(plan(args)[0], deadline)
    device = env.get("result")
    if not device or not device.get("cuda_available"):
        data = summary(args, device, [env], started)
        data["ok"], data["error"] = False, "no CUDA device: the gpu check needs one GPU (run it where one is)"
        write_summary(out, data)
        print(f"gpu_check: {data['error']}; summary in {out / 'gpu_check.json'}", file=sys.stderr)
        return 3
    steps = [env]
    for step in plan(args, device.get("name"))[1:]:
        record = run_step(step, deadline)
        steps.append(record)
        print(f"{record['name']:13s} {record['status']:8s} {record['seconds']:7.1f} s", flush=True)
        write_summary(out, summary(args, device, steps, started))  # after every step: a killed run keeps its news
    data = summary(args, device, steps, started)
    path = write_summary(out, data)
    print(f"gpu_check: {'ok' if data['ok'] else 'FAILED'}; summary in {path}")
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
