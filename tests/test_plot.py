"""The matplotlib charts: the trainer's loss.png (openk3/train/metrics.py) and the planner's memory-vs-context
chart (openk3/plan/report.py, `openk3 plan --plot`). Each is built as a Figure whose texts and artists are
inspected here, then written as a PNG that is decoded back."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.text import Text
from PIL import Image

from openk3.plan import ServeSpec, hardware, plan, report, serve
from openk3.plan.models import preset
from openk3.train import metrics
from openk3.train.metrics import TRAIN_COLOR, VAL_COLOR, loss_figure, plot_losses


def texts(fig: Figure) -> list[str]:
    """Every non-empty text drawn in the figure: titles, axis labels, tick labels, legend entries, notes."""
    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


def legend(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def png_size(path) -> tuple[int, int]:
    with Image.open(path) as img:
        assert img.format == "PNG"
        img.verify()  # a truncated or corrupt file raises here
        return img.size


# ---- loss.png -------------------------------------------------------------------------------------------

TRAIN = {s: 1.6 + 5 * math.exp(-s / 30) + 0.05 * math.sin(s) for s in range(1, 121)}
VAL = {40: 2.0, 80: 1.75, 120: 1.66}


def test_loss_figure_title_labels_legend():
    fig = loss_figure(TRAIN, VAL)
    ax = fig.axes[0]
    assert ax.get_title() == "Training loss"
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "loss (nats per token)"
    assert legend(fig) == ["train loss", "train loss (moving average)", "validation loss (last 1.660 at step 120)"]
    raw, smooth, val = ax.get_lines()
    assert list(raw.get_xdata()) == list(TRAIN) and list(raw.get_ydata()) == list(TRAIN.values())
    assert list(val.get_xdata()) == [40, 80, 120] and val.get_marker() == "o"
    assert (raw.get_color(), smooth.get_color(), val.get_color()) == (TRAIN_COLOR, TRAIN_COLOR, VAL_COLOR)
    assert ax.get_xscale() == ax.get_yscale() == "linear"  # as the hand-drawn chart had


def test_loss_figure_short_run_and_bad_values():
    train = {1: 6.0, 2: math.nan, 3: 5.5, 4: math.inf}
    fig = loss_figure(train, {3: -math.inf})
    (line,) = fig.axes[0].get_lines()  # no moving average under 20 points, no validation line without a value
    assert list(line.get_xdata()) == [1, 3] and list(line.get_ydata()) == [6.0, 5.5]
    assert legend(fig) == ["train loss"]
    (dot,) = loss_figure({7: 6.0}, {}).axes[0].get_lines()
    assert dot.get_marker() == "o"  # a single step is still visible
    empty = loss_figure({}, {})
    assert "no finite loss logged yet" in texts(empty) and "Training loss" in texts(empty)


def test_smoothing_does_not_lag():
    """A centred window reproduces a straight line exactly away from its ends (an EMA would trail it)."""
    line = [10.0 - 0.01 * i for i in range(500)]
    smooth = metrics._smooth(line)
    assert len(smooth) == 500
    assert smooth[5:-5] == pytest.approx(line[5:-5])
    assert metrics._smooth([1.0, 3.0]) == [2.0, 2.0]  # short input: the window shrinks to what there is


def test_plot_losses_png(tmp_path):
    path = tmp_path / "loss.png"
    plot_losses(TRAIN, VAL, str(path))
    assert png_size(path) == (640, 400)  # what tests/test_trainer.py checks of a run's loss.png
    with Image.open(path) as img:
        colours = {c for _, c in img.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert (0xD6, 0x27, 0x28) in colours and (255, 255, 255) in colours  # the validation line, the background
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]
    plot_losses({1: 1.0}, {}, str(path), width=800, height=500)  # overwrite in place
    assert png_size(path) == (800, 500) and [p.name for p in tmp_path.iterdir()] == ["loss.png"]


def test_failed_render_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "loss.png"
    plot_losses(TRAIN, VAL, str(path))
    before = path.read_bytes()

    def broken(self, *a, **k):
        raise RuntimeError("renderer failed")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(RuntimeError):
        plot_losses({1: 2.0}, {}, str(path))
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["loss.png"]


def test_failed_write_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "loss.png"

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics.os, "replace", full_disk)
    with pytest.raises(OSError):
        plot_losses(TRAIN, VAL, str(path))
    assert list(tmp_path.iterdir()) == []


# ---- the planner's memory chart ---------------------------------------------------------------------------

def _k3_b300(concurrency: int = 8, context: int = 131072):
    spec = ServeSpec(context=context, concurrency=concurrency)
    return plan("k3", hardware_key="b300", serve_spec=spec), preset("k3"), hardware.get("b300"), spec


def test_memory_figure_stacks_on_a_log_axis():
    r, cfg, hw, spec = _k3_b300()
    fig = report.memory_figure(r, cfg, hw, spec)
    ax = fig.axes[0]
    assert ax.get_title() == "k3 on 8x b300: memory vs context, 8 sequences"
    assert ax.get_xlabel() == "context per sequence (tokens, log scale)"
    assert ax.get_ylabel() == "memory of the whole deployment"
    assert ax.get_xscale() == "log" and ax.get_yscale() == "linear"
    assert legend(fig) == ["weights", "activations", "KDA state", "MLA cache (x8 TP copies)",
                           "8x b300 usable (90%): 2.07 TB", "8x b300 memory: 2.3 TB", "planned context (128K)"]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["1K", "4K", "16K", "64K", "256K", "1M"]
    assert "2 TB" in [t.get_text() for t in ax.get_yticklabels()]
    # four stacked areas; the top of the last is the planner's budget (the fullest device x devices)
    areas = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(areas) == 4
    lay = serve.Layout(**r["deployment"]["layout"])
    rows = report.memory_curve(cfg, spec, [cfg.max_position_embeddings], lay)
    peak = max(v[1] for v in areas[-1].get_paths()[0].vertices)
    assert peak == pytest.approx(sum(rows[0][k] for k in ("weights", "activations", "kda_state", "mla_cache")))
    assert r["deployment"]["per_device_bytes"]["total"] * lay.devices < peak  # 1M tokens does not fit
    # where the stack crosses the usable line is marked, and agrees with the planner's own fit test
    assert "fits up to 278.6K tokens" in texts(fig)  # 285,323 tokens
    for context, fits in ((285_323, True), (285_324, False)):
        at = ServeSpec(context=context, concurrency=8, devices=8)
        assert plan("k3", hardware_key="b300", serve_spec=at)["deployment"]["fits"] is fits, context


def test_memory_figure_small_model_and_no_fit():
    spec = ServeSpec(context=2048, concurrency=1)
    fig = report.memory_figure(plan("nano", hardware_key="h100", serve_spec=spec), preset("nano"),
                               hardware.get("h100"), spec)
    ax = fig.axes[0]
    # 72 GB of usable memory would flatten nano's ~45 MB to a line: the lines stay in the legend only
    assert "1x h100 usable (90%): 72 GB, above the chart" in legend(fig)
    assert ax.get_ylim()[1] < 1e9 and ax.get_title() == "nano on 1x h100: memory vs context, 1 sequence"
    assert not any(t.startswith("fits up to") for t in texts(fig))
    spec = ServeSpec(context=131072, concurrency=1, usable_memory=0.001)
    r = plan("k3", hardware_key="rtx4090", serve_spec=spec)
    assert r["deployment"]["fits"] is False
    fig = report.memory_figure(r, preset("k3"), hardware.get("rtx4090"), spec)
    assert fig.axes[0].get_title() == "k3 on rtx4090 (does not fit): memory vs context, 1 sequence"
    assert legend(fig)[-1] == "planned context (128K)" and not any("usable" in t for t in legend(fig))


def test_plot_memory_png(tmp_path):
    path = tmp_path / "mem.png"
    r, cfg, hw, spec = _k3_b300()
    report.plot_memory(r, cfg, hw, spec, str(path))
    assert png_size(path) == (1575, 810)  # 10.5 x 5.4 in at 150 dpi
    assert [p.name for p in tmp_path.iterdir()] == ["mem.png"]


@pytest.mark.parametrize("v,s", [(0, "0 B"), (999, "999 B"), (1000, "1 KB"), (1500, "1.5 KB"), (414e6, "414 MB"),
                                 (12_345_678_901, "12.3 GB"), (999.6e9, "1 TB"), (1.5e12, "1.5 TB"),
                                 (2.5e15, "2500 TB"), (-2e9, "-2 GB")])
def test_short_bytes(v, s):
    assert report.short_bytes(v) == s


def test_plan_imports_matplotlib_only_to_plot_and_never_torch_or_pyplot(tmp_path):
    """The planner stays torch-free with --plot; matplotlib loads only when a chart is drawn, and pyplot
    (global figure state, an interactive backend) never; the trainer's chart avoids pyplot too."""
    png, loss = tmp_path / "m.png", tmp_path / "l.png"
    code = (f"import sys, openk3.__main__ as m; m.main(['plan', '--json']); assert 'matplotlib' not in sys.modules; "
            f"m.main(['plan', '--plot', {str(png)!r}]); assert 'matplotlib' in sys.modules; "
            "assert 'torch' not in sys.modules, 'torch'; assert 'matplotlib.pyplot' not in sys.modules, 'pyplot'; "
            f"from openk3.train.metrics import plot_losses; plot_losses({{1: 2.0}}, {{}}, {str(loss)!r}); "
            "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert png_size(png) == (1575, 810) and png_size(loss) == (640, 400)
