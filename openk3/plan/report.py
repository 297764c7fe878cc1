"""Human-readable tables for `openk3 plan`, and the memory-vs-context PNG."""

from __future__ import annotations

import math

from openk3.plan import serve


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


def plot_memory(r: dict, cfg, hw, spec: serve.ServeSpec, path: str) -> None:
    """PNG: stacked weights / activations / KDA state / MLA cache of the whole deployment vs context
    (log x), with the planned devices' memory as a dashed line."""
    from openk3.plot import Series, format_bytes, line_chart

    top = max(cfg.max_position_embeddings, spec.context)
    contexts = sorted({2 ** e for e in range(10, int(math.log2(top)) + 1)} | {spec.context, top})
    lay = r["deployment"].get("layout")
    layout = serve.Layout(**lay) if lay else None
    rows = memory_curve(cfg, spec, contexts, layout)
    stacks, base = [], [0.0] * len(rows)
    copies = lay["tp"] if lay and lay["attention"] == "tp" else 1
    mla_label = f"MLA cache (x{copies} TP copies)" if copies > 1 else "MLA cache"
    for key, label, color in (("weights", "weights", (31, 119, 180)), ("activations", "activations", (148, 103, 189)),
                              ("kda_state", "KDA state", (44, 160, 44)), ("mla_cache", mla_label, (214, 39, 40))):
        top_vals = [b + row[key] for b, row in zip(base, rows)]
        stacks.append(Series(label, list(zip(contexts, top_vals)), color, fill_to=list(zip(contexts, base))))
        base = top_vals
    hlines = []
    if lay:  # the fit test uses the usable share; the full memory is drawn for reference
        n = lay["devices"]
        hlines += [(f"{n}x {hw.key} usable ({spec.usable_memory:.0%})", n * hw.memory_bytes * spec.usable_memory,
                    (0, 0, 0)), (f"{n}x {hw.key} memory", n * hw.memory_bytes, (150, 150, 150))]
    line_chart(path, stacks, title=f"{r['model']} on {hw.key}: memory vs context, {spec.concurrency} sequence(s)",
               x_label="context (tokens)", y_label="bytes", hlines=hlines, x_log=True, x_format=_tokens,
               y_format=format_bytes)
