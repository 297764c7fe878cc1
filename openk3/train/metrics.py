"""Run metrics: the `metrics.jsonl` log, MFU, and `loss.png` (drawn with matplotlib).

metrics.jsonl holds one JSON object per line, appended and flushed one at a time:
  {"kind": "train", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "load_max_over_mean",
   "elapsed", ...}
  {"kind": "eval", "step", "val_loss", "val_bpb", "val_tokens", "elapsed"}
  {"kind": "resume", "step"}
A torn last line (a kill mid-write) is skipped when reading; on resume `truncate_after` drops it
and everything logged after the checkpoint being resumed.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from openk3.chart import new_figure, save_png
from openk3.fsutil import naming, write_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure


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
    """Appends JSON lines to `path`: each record is written whole and flushed before `log` returns; a write
    that fails (a full disk) is an OSError naming the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        try:
            self._fh.write(json.dumps(record, allow_nan=True) + "\n")
            self._fh.flush()
        except OSError as e:
            raise naming(e, self.path, "appending a record; the records before it are kept") from e

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def logged_eval(path: str, step: int) -> dict | None:
    """The last eval record logged for `step` in a metrics.jsonl, or None."""
    return next((r for r in reversed(read_metrics(path)) if r.get("kind") == "eval" and r.get("step") == step), None)


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
    write_atomic(path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in keep).encode("utf-8"))
    return len(recs) - len(keep)


def losses_by_step(records: Iterable[dict], kind: str = "train", key: str = "loss") -> dict[int, float]:
    """{step: value} for records of `kind` (a later record of the same step wins)."""
    return {int(r["step"]): r[key] for r in records if r.get("kind") == kind and key in r}


# ---- loss.png ----------------------------------------------------------------------------------------

TRAIN_COLOR = "#1f77b4"  # matplotlib's tab:blue and tab:red
VAL_COLOR = "#d62728"
SMOOTH_MIN_POINTS = 20  # below this the raw train line is readable on its own


def _smooth(values: list[float]) -> list[float]:
    """Centred moving average over ~2% of the points (at least 5): unlike an EMA it does not lag behind
    a falling loss; near the ends the window shrinks to the points there are."""
    h = max(2, len(values) // 100)
    cum = [0.0, *itertools.accumulate(values)]
    return [(cum[min(len(values), i + h + 1)] - cum[max(0, i - h)]) / (min(len(values), i + h + 1) - max(0, i - h))
            for i in range(len(values))]


def loss_figure(train: dict[int, float], val: dict[int, float], *, width: int = 640, height: int = 400,
                dpi: int = 100) -> Figure:
    """The loss chart as a matplotlib Figure (`width` x `height` pixels at `dpi`): train loss against step
    (a faint raw line plus its moving average once there are enough steps) and validation loss (line +
    dots), titled, with axis labels and a legend. Non-finite values are left out."""
    from matplotlib.ticker import MaxNLocator

    fig = new_figure(width / dpi, height / dpi, dpi)
    ax = fig.add_subplot()
    pts = [(s, v) for s, v in sorted(train.items()) if math.isfinite(v)]
    vpts = [(s, v) for s, v in sorted(val.items()) if math.isfinite(v)]
    steps, losses = [s for s, _ in pts], [v for _, v in pts]
    if len(pts) >= SMOOTH_MIN_POINTS:
        ax.plot(steps, losses, color=TRAIN_COLOR, alpha=0.3, linewidth=1, label="train loss")
        ax.plot(steps, _smooth(losses), color=TRAIN_COLOR, linewidth=1.8, label="train loss (moving average)")
    else:
        ax.plot(steps, losses, color=TRAIN_COLOR, linewidth=1.8, marker="o" if len(pts) == 1 else None,
                label="train loss")
    if vpts:
        last_step, last = vpts[-1]
        ax.plot([s for s, _ in vpts], [v for _, v in vpts], color=VAL_COLOR, linewidth=1.8, marker="o",
                markersize=4, label=f"validation loss (last {last:.3f} at step {last_step:,})")
    if not pts and not vpts:  # a run killed before its first logged step: say so instead of empty axes
        ax.text(0.5, 0.5, "no finite loss logged yet", transform=ax.transAxes, ha="center", va="center",
                color="0.4")
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_title("Training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(True, color="0.9", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(loc="best", framealpha=0.9, edgecolor="0.85")  # the corner that hides the least data
    return fig


def plot_losses(train: dict[int, float], val: dict[int, float], path: str, *, width: int = 640,
                height: int = 400) -> None:
    """Write `loss_figure(train, val)` to `path` as a PNG of `width` x `height` pixels."""
    save_png(loss_figure(train, val, width=width, height=height), path)
