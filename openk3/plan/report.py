"""Human-readable tables for `openk3 plan`, and the memory-vs-context chart (matplotlib, imported only
when a chart is drawn)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from openk3.chart import new_figure, save_png
from openk3.plan import serve

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def human_bytes(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f} B"


def human_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:,.2f}{unit}"
    return f"{n:,.0f}"


def _table(rows: list[tuple[str, str]], title: str) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [title, *(f"  {k:<{width}}  {v}" for k, v in rows), ""]


def text(r: dict) -> str:
    """The plan as aligned tables (what `openk3 plan` prints without --json)."""
    m, s = r["memory"], r["serve"]
    lines = _table([
        ("total parameters", f"{r['total_params']:,} ({human_count(r['total_params'])})"),
        ("active per token", f"{r['active_params']:,} ({human_count(r['active_params'])}; "
                             f"{human_count(r['active_params_with_embedding'])} with the embedding lookup)"),
        ("layers", f"{r['num_hidden_layers']} = {r['num_kda_layers']} KDA + {r['num_mla_layers']} MLA"),
        *([("published", f"{human_count(r['published']['total_params'])} total / "
                         f"{human_count(r['published']['active_params'])} active ({r['published']['source']})")]
          if r.get("published") else []),
    ], f"Model: {r['model']}")
    f = r["formats"]
    lines += _table([
        (f"routed experts ({f['experts']})", human_bytes(m["routed_experts_bytes"])),
        (f"trunk ({f['trunk']}, fp32 islands)", human_bytes(m["trunk_bytes"])),
        (f"embedding + lm_head ({f['embeddings']})", human_bytes(m["embedding_bytes"])),
        ("weights", human_bytes(m["weights_bytes"])),
        (f"KDA state per sequence ({f['kda_state']})",
         f"{human_bytes(m['kda_state_bytes_per_sequence'])} ({m['kda_state_bytes_per_sequence'] / 2**20:,.1f} MiB)"
         f" + conv {human_bytes(m['kda_conv_bytes_per_sequence'])}"),
        (f"MLA cache per token ({f['mla_cache']})", f"{m['mla_cache_bytes_per_token']:,} B"),
        (f"cache per sequence at {s['context']:,} tokens", human_bytes(m["cache_bytes_per_sequence"])),
        (f"caches for {s['concurrency']} sequence(s)", human_bytes(m["cache_bytes"])),
        (f"activations (prefill chunk {s['prefill_chunk']:,})", human_bytes(m["activation_bytes"])),
        ("total", human_bytes(m["total_bytes"])),
    ], "Memory (whole model)")
    hw = r["hardware"]
    dep = r["deployment"]
    head = f"Deployment on {hw['name']} ({human_bytes(hw['memory_bytes'])}, {hw['memory_bandwidth'] / 1e12:.2f} TB/s)"
    if not dep["fits"] and "layout" not in dep:
        lines += _table([("fits", "no: " + dep["reason"])], head)
    else:
        lay, dev = dep["layout"], dep["per_device_bytes"]
        lines += _table([
            ("devices", f"{lay['devices']} ({lay['nodes']} node(s)); TP{lay['tp']} x PP{lay['pp']}, EP{lay['ep']}, "
                        f"{'tensor' if lay['attention'] == 'tp' else 'data'}-parallel attention"),
            ("fits", "yes" if dep["fits"] else "NO (forced device count)"),
            ("per device", f"{human_bytes(dev['total'])} of {human_bytes(dep['usable_bytes_per_device'])} usable: "
                           f"weights {human_bytes(dev['weights'])}, KDA {human_bytes(dev['kda_state'])}, "
                           f"MLA {human_bytes(dev['mla_cache'])}, activations {human_bytes(dev['activations'])}"),
            ("max sequences at this context", f"{dep['max_concurrency_at_context'] or 0:,}"),
        ], head)
        p, c = r["performance"], r["cost"]
        lines += _table([
            (f"decode, {s['concurrency']} sequence(s)", f"{p['decode_tokens_per_s']:,.1f} tok/s "
             f"({p['decode_tokens_per_s_per_sequence']:,.1f} per sequence, {p['decode_step_ms']:.2f} ms/step, "
             f"{p['decode_bound']}-bound)"),
            ("bytes read per decode step", f"{human_bytes(p['decode_bytes_per_step'])} "
             f"({p['decode_distinct_experts_per_layer']:.1f} distinct experts per layer)"),
            ("prefill", f"{p['prefill_tokens_per_s']:,.0f} tok/s ({p['prefill_bound']}-bound); "
                        f"{s['context']:,}-token prompt in {p['time_to_first_token_s']:.2f} s"),
            ("cost", f"${c['usd_per_hour']:,.2f}/h: ${c['usd_per_million_output_tokens']:,.3f} per M output tokens, "
                     f"${c['usd_per_million_input_tokens']:,.3f} per M input tokens"),
            ("efficiency assumed", f"{s['mbu']:.0%} of peak bandwidth, {s['mfu']:.0%} of peak FLOP/s "
                                   f"(compute: experts {p['compute_formats']['routed']}, "
                                   f"rest {p['compute_formats']['other']})"),
        ], "Speed (roofline)")
    fl = r["flops_per_token"]
    lines += _table([
        (f"prefill (average over {s['context']:,} tokens)", f"{fl['prefill'] / 1e9:,.2f} GFLOP"),
        (f"decode at {s['context']:,} context", f"{fl['decode'] / 1e9:,.2f} GFLOP "
                                                 f"(MLA attention {fl['decode_mla_attention'] / 1e9:,.2f})"),
        (f"training (seq {r['train']['seq_len']:,})", f"{fl['training'] / 1e9:,.2f} GFLOP"),
    ], "FLOPs per token")
    t = r["train"]
    tg = t["per_gpu_bytes"]
    lines += _table([
        ("tokens", f"{human_count(t['tokens'])} at seq {t['seq_len']:,}"),
        ("total FLOPs", f"{t['total_flops']:.3e}"),
        (f"{hw['key']} GPU-hours at {t['mfu']:.0%} MFU ({t['precision']})",
         f"{t['gpu_hours']:,.0f} (${t['cost_usd']:,.0f})"),
        ("GPUs (sharded)" if t["spec"]["gpus"] else "GPUs to fit (sharded)",
         f"{t['gpus']:,}" + (f" ({t['days']:,.1f} days)" if t["days"] else "")
         + ("" if t["fits"] else f"; does NOT fit in {t['spec']['usable_memory']:.0%} of each GPU")
         if t["gpus"] else "none: the unsharded part alone does not fit"),
        ("per GPU", f"{human_bytes(tg['total'])}: state {human_bytes(tg['sharded_state'])}, gathered layer "
                    f"{human_bytes(tg['gathered_weights'])}, activations {human_bytes(tg['activations'])}, "
                    f"logits {human_bytes(tg['logits'])}" if tg else "-"),
        (f"optimizer ({t['optimizer']})", f"{human_bytes(t['state_bytes']['optimizer'])} of state"),
    ], "Training")
    return "\n".join(lines).rstrip() + "\n"


def audit_text(items: list[dict]) -> str:
    out = []
    for i, it in enumerate(items, 1):
        out += [f"{i}. \"{it['claim']}\"", f"   claimed:   {it['claimed']}", f"   corrected: {it['corrected']}",
                f"   why:       {it['reason']}", ""]
    return "\n".join(out)


def memory_curve(cfg, spec: serve.ServeSpec, contexts: list[int], lay: serve.Layout | None = None) -> list[dict]:
    """Deployment memory at each context for `spec.concurrency` sequences, by component. With a layout,
    as the planner budgets it (the fullest device x devices: the MLA latent once per TP rank, the trunk
    once per rank under DP attention, a prefill workspace per stage); without one, the bare model."""
    out = []
    for ctx in contexts:
        sp = serve.ServeSpec(**{**spec.__dict__, "context": ctx})
        m = serve.memory(cfg, sp)
        if lay is not None:
            dev = serve.per_device_bytes(cfg, sp, m, lay)
            out.append({"context": ctx, **{k: dev[k] * lay.devices for k in ("weights", "activations", "kda_state",
                                                                               "mla_cache")}})
            continue
        out.append({"context": ctx, "weights": m["weights_bytes"], "activations": m["activation_bytes"],
                    "kda_state": (m["kda_state_bytes_per_sequence"] + m["kda_conv_bytes_per_sequence"])
                    * sp.concurrency, "mla_cache": m["mla_cache_bytes_per_sequence"] * sp.concurrency})
    return out


def _tokens(v: float) -> str:
    for unit, div in (("M", 2**20), ("K", 2**10)):
        if v >= div:
            q = v / div
            return f"{q:.0f}{unit}" if abs(q - round(q)) < 0.05 else f"{q:.1f}{unit}"
    return f"{v:.0f}"


def short_bytes(v: float) -> str:
    """Axis-tick bytes: decimal units, at most 3 significant digits (0 B, 500 GB, 1.5 TB, 2500 TB)."""
    a, units = abs(v), ("B", "KB", "MB", "GB", "TB")
    i = 0
    while i < len(units) - 1 and float(f"{a / 1000 ** i:.3g}") >= 1000:  # 999.6e9 is "1 TB", not "1000 GB"
        i += 1
    x = a / 1000 ** i
    digits = f"{x:.0f}" if x >= 1000 else f"{x:.3g}"
    return f"{'-' if v < 0 else ''}{digits} {units[i]}"


MEMORY_SERIES = (("weights", "weights", "#1f77b4"), ("activations", "activations", "#9467bd"),
                 ("kda_state", "KDA state", "#2ca02c"), ("mla_cache", "MLA cache", "#d62728"))
POINTS_PER_OCTAVE = 4  # the MLA cache grows linearly in context: one point per power of 2 shows corners on a log axis


def _crossing(xs: list[float], ys: list[float], level: float) -> float | None:
    """The first x where the rising curve ys passes `level` (interpolated linearly: memory is affine in
    context); None if the curve starts above `level` or never reaches it."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y0 <= level < y1:
            return x0 + (level - y0) / (y1 - y0) * (x1 - x0)
    return None


def memory_figure(r: dict, cfg, hw, spec: serve.ServeSpec) -> Figure:
    """The memory-vs-context chart as a matplotlib Figure: the deployment's weights / activations / KDA
    state / MLA cache stacked against context (log2 x axis, from 1K tokens to the longest context), the
    planned devices' usable and full memory as dashed lines (with the context where the stack crosses the
    usable line marked) and the planned context as a dotted line."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    top = max(cfg.max_position_embeddings, spec.context)
    steps = range(10 * POINTS_PER_OCTAVE, int(math.log2(top) * POINTS_PER_OCTAVE) + 1)
    contexts = sorted({round(2 ** (e / POINTS_PER_OCTAVE)) for e in steps} | {spec.context, top})
    lay = r["deployment"].get("layout")
    rows = memory_curve(cfg, spec, contexts, serve.Layout(**lay) if lay else None)
    totals = [sum(row[key] for key, _, _ in MEMORY_SERIES) for row in rows]
    copies = lay["tp"] if lay and lay["attention"] == "tp" else 1

    fig = new_figure(10.5, 5.4, 150)
    ax = fig.add_subplot()
    labels = [f"{label} (x{copies} TP copies)" if key == "mla_cache" and copies > 1 else label
              for key, label, _ in MEMORY_SERIES]
    ax.stackplot(contexts, *([row[key] for row in rows] for key, _, _ in MEMORY_SERIES), labels=labels,
                 colors=[c for _, _, c in MEMORY_SERIES], alpha=0.75, edgecolor="white", linewidth=0.6)
    ceiling = max(totals)
    devices = f"{lay['devices']}x {hw.key}" if lay else hw.key
    if lay:  # the fit test uses the usable share; the full memory is drawn for reference
        usable, full = (lay["devices"] * hw.memory_bytes * f for f in (spec.usable_memory, 1.0))
        # Far above a small model's stack the lines would flatten it to nothing: keep the stack readable
        # and let the legend give the lines' values.
        off_scale = usable > 10 * ceiling
        ceiling = ceiling if off_scale else max(ceiling, full)
        above = ", above the chart" if off_scale else ""
        ax.axhline(usable, color="black", linestyle="--", linewidth=1.4,
                   label=f"{devices} usable ({spec.usable_memory:.0%}): {short_bytes(usable)}{above}")
        ax.axhline(full, color="0.55", linestyle="--", linewidth=1.4,
                   label=f"{devices} memory: {short_bytes(full)}{above}")
        limit = _crossing(contexts, totals, usable)
        if limit is not None:
            ax.plot([limit], [usable], "o", color="black", markersize=5, zorder=5)
            ax.annotate(f"fits up to {_tokens(limit)} tokens", (limit, usable), xytext=(-8, 8),
                        textcoords="offset points", ha="right", va="bottom", fontsize=9,
                        bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none"})
    ax.axvline(spec.context, color="0.35", linestyle=":", linewidth=1.2,
               label=f"planned context ({_tokens(spec.context)})")

    ax.set_xscale("log", base=2)
    ax.set_xlim(contexts[0], contexts[-1])
    octaves = int(math.log2(contexts[-1])) - 10
    every = max(1, math.ceil(octaves / 8))  # at most ~9 labelled powers of 2
    ax.xaxis.set_major_locator(FixedLocator([2.0 ** e for e in range(10, 11 + octaves, every)]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tokens(v)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: short_bytes(v)))
    ax.set_ylim(0, ceiling * 1.08)
    sequences = f"{spec.concurrency:,} sequence" + ("s" if spec.concurrency != 1 else "")
    fits = "" if r["deployment"]["fits"] else " (does not fit)"
    ax.set_title(f"{r['model']} on {devices}{fits}: memory vs context, {sequences}")
    ax.set_xlabel("context per sequence (tokens, log scale)")
    ax.set_ylabel("memory of the whole deployment")
    ax.grid(True, color="0.9", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)  # outside: never over the stack
    return fig


def plot_memory(r: dict, cfg, hw, spec: serve.ServeSpec, path: str) -> None:
    """Write `memory_figure(...)` to `path` as a PNG, atomically (`openk3.chart.save_png`)."""
    save_png(memory_figure(r, cfg, hw, spec), path)
