"""Run metrics: the `metrics.jsonl` log, MFU, and `loss.png` (a dependency-free PNG line plot).

metrics.jsonl holds one JSON object per line, appended and flushed one at a time:
  {"kind": "train", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "load_max_over_mean",
   "elapsed", ...}
  {"kind": "eval", "step", "val_loss", "val_bpb", "val_tokens", "elapsed"}
  {"kind": "resume", "step"}
A torn last line (a kill mid-write) is skipped when reading; on resume `truncate_after` drops it
and everything logged after the checkpoint being resumed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable

import torch

from openk3.plot import Canvas, format_number, text_width

# Matmul peak per core of the project's CPU machine (benchmarks/common.py, machine-facts §1.3).
PEAK_FLOPS_PER_CORE = {torch.float32: 95e9, torch.bfloat16: 210e9}


def peak_flops(dtype: torch.dtype, threads: int, device: str = "cpu") -> float | None:
    """FLOP/s the MFU is measured against: the per-core CPU table x threads; None off CPU."""
    if device != "cpu":
        return None
    return PEAK_FLOPS_PER_CORE[dtype] * threads


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    return None if not peak else tokens_per_s * flops_per_token / peak


class MetricsLog:
    """Appends JSON lines to `path`: each record is written whole and flushed before `log` returns."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        self._fh.write(json.dumps(record, allow_nan=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str) -> list[dict]:
    """All complete records of a metrics.jsonl (a torn or garbled line is skipped)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.endswith("\n"):
                break  # torn last line
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def truncate_after(path: str, step: int) -> int:
    """Rewrite `path` (atomically) keeping only complete records with step <= `step`; returns how many
    records were dropped."""
    if not os.path.exists(path):
        return 0
    recs = read_metrics(path)
    keep = [r for r in recs if int(r.get("step", 0)) <= step]
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in keep:
            fh.write(json.dumps(r, allow_nan=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return len(recs) - len(keep)


def losses_by_step(records: Iterable[dict], kind: str = "train", key: str = "loss") -> dict[int, float]:
    """{step: value} for records of `kind` (a later record of the same step wins)."""
    return {int(r["step"]): r[key] for r in records if r.get("kind") == kind and key in r}


# ---- loss.png (drawn with openk3.plot) ----------------------------------------------------------------

TRAIN_COLOR = (31, 119, 180)
VAL_COLOR = (214, 39, 40)


def plot_losses(train: dict[int, float], val: dict[int, float], path: str, *, width: int = 640,
                height: int = 400) -> None:
    """Write a PNG (atomically) of train loss (blue line) and validation loss (red line + dots) against
    step, with min/max labels on both axes."""
    c = Canvas(width, height)
    left, right, top, bottom = 70, 20, 20, 40
    pw, ph = width - left - right, height - top - bottom
    pts = [(s, v) for s, v in sorted(train.items()) if math.isfinite(v)]
    vpts = [(s, v) for s, v in sorted(val.items()) if math.isfinite(v)]
    allv = [v for _, v in pts + vpts]
    alls = [s for s, _ in pts + vpts]
    grid = (225, 225, 225)
    for i in range(5):  # grid
        y = top + round(i * ph / 4)
        c.line(left, y, left + pw, y, grid)
        x = left + round(i * pw / 4)
        c.line(x, top, x, top + ph, grid)
    c.line(left, top, left, top + ph, (0, 0, 0))
    c.line(left, top + ph, left + pw, top + ph, (0, 0, 0))
    if allv:
        lo, hi = min(allv), max(allv)
        if hi - lo < 1e-12:
            lo, hi = lo - 0.5, hi + 0.5
        pad = 0.05 * (hi - lo)
        lo, hi = lo - pad, hi + pad
        s0, s1 = min(alls), max(alls)
        s1 = s1 if s1 > s0 else s0 + 1

        def xy(s: float, v: float) -> tuple[int, int]:
            return (left + round((s - s0) / (s1 - s0) * pw), top + round((hi - v) / (hi - lo) * ph))

        for series, color, dots in ((pts, TRAIN_COLOR, len(pts) == 1), (vpts, VAL_COLOR, True)):
            prev = None
            for s, v in series:
                p = xy(s, v)
                if prev is not None:
                    c.line(*prev, *p, color, width=2)
                if dots:
                    c.dot(*p, color, r=3)
                prev = p
        c.text(4, top, format_number(hi))
        c.text(4, top + ph - 7, format_number(lo))
        c.text(left, top + ph + 8, format_number(s0))
        label = format_number(s1)
        c.text(left + pw - text_width(label), top + ph + 8, label)
    # legend: a blue and a red swatch
    c.line(left + pw - 60, top + 8, left + pw - 40, top + 8, TRAIN_COLOR, width=3)
    c.line(left + pw - 30, top + 8, left + pw - 10, top + 8, VAL_COLOR, width=3)
    c.save(path)
