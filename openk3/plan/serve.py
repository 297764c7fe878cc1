"""Serving arithmetic: memory by component, devices and parallel layout, roofline speed, $ per token.

K3 has two memory pools that grow differently (docs/planner.md): the KDA recurrent state is a fixed
~414 MiB per *sequence* and is split across tensor-parallel ranks by head, while the MLA latent cache
grows 27.6 KB per *token* and, with tensor-parallel attention, is replicated on every rank (the
576-wide latent is shared by all heads, so there is nothing to split). Data-parallel attention
(`attention="dp"`) keeps one copy but replicates the non-expert weights instead.

Speed is a roofline: a decode step costs max(bytes touched / bandwidth, FLOPs / peak) on the busiest
device, plus the interconnect time of the step's collectives (bandwidth only, not overlapped), and
pipeline stages run one after another. Bytes touched per step = the non-routed weights
(minus the embedding table, of which a step reads B rows) + the experts that B tokens actually pick
(uniform routing: E (1 - (1 - k/E)^B) distinct experts per layer) + the KDA state (read and written)
+ the MLA cache of every sequence. `mbu`/`mfu` scale the peaks (1.0 = the ideal roofline).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from openk3.config import K3Config
from openk3.plan import counts
from openk3.plan.formats import state_format, weight_format
from openk3.plan.hardware import Hardware


@dataclass
class ServeSpec:
    context: int = 131072  # tokens per sequence (prompt + generated so far)
    concurrency: int = 1  # sequences decoding together on the whole deployment
    expert_format: str = "mxfp4"
    trunk_format: str = "bf16"  # non-routed matrices except the embedding table and lm_head
    embedding_format: str = "bf16"  # embed_tokens and lm_head
    kda_state_format: str = "fp32"
    mla_cache_format: str = "bf16"
    conv_state_format: str = "bf16"  # the activation dtype
    prefill_chunk: int = 8192  # tokens per prefill forward (sizes the activation workspace)
    usable_memory: float = 0.9  # share of device memory the model may use (runtime, graphs, fragmentation)
    devices: int | None = None  # force a device count; None = the fewest that fit
    attention: str = "tp"  # "tp": heads split, MLA cache replicated per TP rank; "dp": sequences split
    mbu: float = 1.0  # achieved / peak memory bandwidth
    mfu: float = 1.0  # achieved / peak FLOP/s

    def validate(self) -> None:
        for name in ("context", "concurrency", "prefill_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("usable_memory", "mbu", "mfu"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:  # NaN fails too
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        if self.devices is not None and (not isinstance(self.devices, int) or isinstance(self.devices, bool)
                                         or self.devices < 1):
            raise ValueError(f"devices must be a positive integer, got {self.devices!r}")
        if self.attention not in ("tp", "dp"):
            raise ValueError(f"attention must be 'tp' or 'dp', got {self.attention!r}")
        for role in ("expert", "trunk", "embedding"):
            weight_format(getattr(self, f"{role}_format"), f"{role} format")
        for role in ("kda_state", "mla_cache", "conv_state"):
            state_format(getattr(self, f"{role}_format"), f"{role.replace('_', ' ')} format")


def memory(cfg: K3Config, spec: ServeSpec, p: counts.Params | None = None) -> dict:
    """Bytes of the whole model and of one sequence's decode state, in the chosen formats."""
    spec.validate()
    p = p or counts.params(cfg)
    ts = counts.tensors(cfg)
    fp32 = sum(t.numel for t in ts if t.fp32)
    vectors16 = sum(t.numel for t in ts if t.vector and not t.fp32)  # norm gains stay bf16 in any trunk format
    emb = p.embedding + p.lm_head
    trunk_matrices = p.non_routed - emb - fp32 - vectors16
    st = counts.state_sizes(cfg)
    routed = p.routed_experts * weight_format(spec.expert_format).bytes_per_value
    embedding = emb * weight_format(spec.embedding_format).bytes_per_value
    trunk = trunk_matrices * weight_format(spec.trunk_format).bytes_per_value + 2 * vectors16 + 4 * fp32
    kda = st["kda_state_values_per_sequence"] * state_format(spec.kda_state_format)
    conv = st["kda_conv_values_per_sequence"] * state_format(spec.conv_state_format)
    mla = st["mla_cache_values_per_token"] * state_format(spec.mla_cache_format)
    per_seq = kda + conv + mla * spec.context
    return {
        "routed_experts_bytes": _int(routed), "trunk_bytes": _int(trunk), "embedding_bytes": _int(embedding),
        "non_routed_bytes": _int(trunk + embedding), "weights_bytes": _int(routed + trunk + embedding),
        "kda_state_bytes_per_sequence": kda, "kda_conv_bytes_per_sequence": conv, "mla_cache_bytes_per_token": mla,
        "mla_cache_bytes_per_sequence": mla * spec.context, "cache_bytes_per_sequence": per_seq,
        "cache_bytes": per_seq * spec.concurrency, "activation_bytes": _int(activation_bytes(cfg, spec.prefill_chunk)),
        "expert_bytes_each": _int(counts.params_per_expert(cfg) * weight_format(spec.expert_format).bytes_per_value),
    }


def activation_bytes(cfg: K3Config, chunk: int) -> float:
    """Largest live activations of one prefill chunk (bf16), an estimate: the AttnRes block
    representations + partial sum + a few hidden-size buffers, one token-mixer's projections, and
    the routed experts' inputs and intermediates of the k chosen experts."""
    la = cfg.linear_attn_config
    hidden = cfg.hidden_size * (counts.num_attn_res_blocks(cfg) + 4)
    mixer = max(6 * la.num_heads * la.head_dim, cfg.num_attention_heads * (cfg.qk_head_dim + 2 * cfg.v_head_dim))
    experts = cfg.num_experts_per_token * (cfg.expert_in_dim + 2 * cfg.moe_intermediate_size)
    return 2.0 * chunk * (hidden + mixer + experts)


@dataclass
class Layout:
    devices: int
    tp: int  # attention / dense tensor parallelism (inside a node)
    pp: int  # pipeline stages (across nodes)
    ep: int  # expert parallelism: the devices of one stage share each of its layers' experts
    nodes: int  # a stage's TP group never straddles two nodes
    attention: str

    def to_dict(self) -> dict:
        return asdict(self)


def _tp_max(cfg: K3Config, hw: Hardware) -> int:
    """Largest power of two <= min(8, devices per node) dividing both head counts."""
    heads = (cfg.num_attention_heads, cfg.linear_attn_config.num_heads)
    tp = 1
    while tp * 2 <= min(8, hw.devices_per_node) and all(h % (tp * 2) == 0 for h in heads):
        tp *= 2
    return tp


def layout_for(cfg: K3Config, hw: Hardware, n: int, attention: str) -> Layout:
    """TP as wide as the heads and a node allow (narrowed until it divides `n`), the rest pipeline
    stages. A layer's experts live in its stage, so EP = devices per stage (= TP), not all devices."""
    tp = _tp_max(cfg, hw)
    while n % tp:
        tp //= 2
    pp = n // tp
    stages_per_node = max(1, hw.devices_per_node // tp)  # e.g. TP4 on a 6-GPU box: one stage per box
    return Layout(devices=n, tp=tp, pp=pp, ep=tp, nodes=math.ceil(pp / stages_per_node), attention=attention)


def per_device_bytes(cfg: K3Config, spec: ServeSpec, mem: dict, lay: Layout) -> dict:
    """Memory on the fullest device of a layout."""
    n, tp, pp = lay.devices, lay.tp, lay.pp
    experts = mem["routed_experts_bytes"] / n
    if lay.attention == "tp":
        weights = experts + mem["non_routed_bytes"] / (tp * pp)
        kda = (mem["kda_state_bytes_per_sequence"] + mem["kda_conv_bytes_per_sequence"]) * spec.concurrency / (tp * pp)
        mla = mem["mla_cache_bytes_per_sequence"] * spec.concurrency / pp  # latent shared by heads: on every TP rank
        act = mem["activation_bytes"] / tp
    else:
        weights = experts + mem["non_routed_bytes"] / pp  # trunk replicated per rank (within a stage)
        seqs = math.ceil(spec.concurrency / (n // pp))
        kda = (mem["kda_state_bytes_per_sequence"] + mem["kda_conv_bytes_per_sequence"]) * seqs / pp
        mla = mem["mla_cache_bytes_per_sequence"] * seqs / pp
        act = mem["activation_bytes"]
    return {"weights": weights, "kda_state": kda, "mla_cache": mla, "activations": act,
            "total": weights + kda + mla + act}


def choose_layout(cfg: K3Config, hw: Hardware, spec: ServeSpec, mem: dict, max_devices: int = 65536) -> Layout | None:
    """The fewest devices (1, 2, 4, .., TP, then multiples of TP) whose fullest device fits."""
    if spec.devices is not None:
        lay = layout_for(cfg, hw, spec.devices, spec.attention)
        if lay.pp > cfg.num_hidden_layers:  # a stage needs at least one layer
            most = cfg.num_hidden_layers * _tp_max(cfg, hw)
            raise ValueError(f"devices {spec.devices} on {hw.key} means TP{lay.tp} x PP{lay.pp}, more pipeline "
                             f"stages than the {cfg.num_hidden_layers} layers; use at most {most} devices")
        return lay
    budget = hw.memory_bytes * spec.usable_memory
    tp = _tp_max(cfg, hw)
    candidates = [d for d in (1, 2, 4, 8) if d <= tp] + list(range(2 * tp, max_devices + 1, tp))
    for n in candidates:
        lay = layout_for(cfg, hw, n, spec.attention)
        if lay.pp <= cfg.num_hidden_layers and per_device_bytes(cfg, spec, mem, lay)["total"] <= budget:
            return lay
        if lay.pp > cfg.num_hidden_layers:
            return None
    return None


def expected_distinct_experts(cfg: K3Config, tokens: int) -> float:
    """Distinct experts per MoE layer that `tokens` tokens pick (uniform independent routing)."""
    E, k = cfg.num_experts, cfg.num_experts_per_token
    return E * (1.0 - (1.0 - k / E) ** tokens)


def comm_seconds(cfg: K3Config, hw: Hardware, lay: Layout, tokens: int) -> float:
    """Interconnect time of one pipeline stage for `tokens` tokens, bandwidth only (no latency term),
    not overlapped with compute. TP attention: two ring all-reduces of the bf16 hidden state per
    layer. DP attention: the MoE all-to-all, dispatch and combine of k expert-width (latent) vectors
    per token, of which (n - 1)/n leave the device; the latent halves these bytes for K3."""
    bw = hw.interconnect_bandwidth
    per_stage = lay.devices // lay.pp
    if per_stage == 1:
        return 0.0
    if bw <= 0:  # Hardware rejects this for multi-device nodes; a forced layout must not divide by zero
        raise ValueError(f"hardware {hw.key} has no interconnect, so a stage cannot span {per_stage} devices")
    if lay.attention == "tp":
        layers = cfg.num_hidden_layers / lay.pp
        return tokens * layers * 2 * (2 * cfg.hidden_size) * 2 * (lay.tp - 1) / lay.tp / bw
    moe_layers = counts.num_moe_layers(cfg) / lay.pp
    local_tokens = math.ceil(tokens / per_stage)
    moved = 2 * cfg.num_experts_per_token * cfg.expert_in_dim * 2 * (per_stage - 1) / per_stage
    return local_tokens * moe_layers * moved / bw


def roofline(cfg: K3Config, hw: Hardware, spec: ServeSpec, mem: dict, lay: Layout,
             p: counts.Params | None = None) -> dict:
    """Decode and prefill tokens/s from bytes and FLOPs per device (ideal when mbu = mfu = 1)."""
    p = p or counts.params(cfg)
    B, n, tp, pp = spec.concurrency, lay.devices, lay.tp, lay.pp
    moe_layers = counts.num_moe_layers(cfg)
    bw = hw.memory_bandwidth * spec.mbu
    e_fmt, t_fmt = weight_format(spec.expert_format), weight_format(spec.trunk_format)
    peak_routed = hw.flops_for(e_fmt.compute)[0] * spec.mfu
    peak_other = hw.flops_for(t_fmt.compute)[0] * spec.mfu

    # ---- decode: one step advances all B sequences by a token ----
    dp = lay.attention == "dp"
    seqs = math.ceil(B / (n // pp)) if dp else B  # sequences whose attention and trunk one device runs
    distinct = expected_distinct_experts(cfg, B)
    expert_bytes = moe_layers * distinct * mem["expert_bytes_each"]
    # lm_head read in full; of the embedding table only the B looked-up rows
    emb_row = mem["embedding_bytes"] / 2 / cfg.vocab_size
    trunk_read = mem["non_routed_bytes"] - mem["embedding_bytes"] / 2 + B * emb_row
    state_rw = 2 * (mem["kda_state_bytes_per_sequence"] + mem["kda_conv_bytes_per_sequence"])
    mla_read = mem["mla_cache_bytes_per_sequence"]
    if not dp:
        dev_bytes = expert_bytes / n + trunk_read / (tp * pp) + B * state_rw / (tp * pp) + B * mla_read / pp
    else:
        dev_bytes = expert_bytes / n + trunk_read / pp + seqs * (state_rw + mla_read) / pp
    fl = counts.decode_flops_per_token(cfg, spec.context, p)
    # experts: the B tokens' routed work spreads over each stage's EP group either way; the rest is split
    # by heads (TP) or done whole by the device that holds the sequence (DP attention)
    routed_time = B * fl["routed"] / peak_routed / n
    other_time = (seqs * fl["other"] / peak_other / pp) if dp else (B * fl["other"] / peak_other / n)
    dev_time_compute = routed_time + other_time
    dev_time_memory = dev_bytes / bw
    comm = comm_seconds(cfg, hw, lay, B)
    step = pp * (max(dev_time_compute, dev_time_memory) + comm)  # stages run in turn for one batch
    decode_tps = B / step

    # ---- prefill: chunks pipeline through the stages, so all devices compute at once ----
    pf = counts.prefill_flops_per_token(cfg, spec.context, p)
    chunk = min(spec.prefill_chunk, spec.context)
    t_compute = chunk * (pf["routed"] / peak_routed + pf["other"] / peak_other) / n
    touched_experts = moe_layers * expected_distinct_experts(cfg, chunk) * mem["expert_bytes_each"]
    t_memory = (touched_experts + trunk_read) / (n * bw)
    t_comm = comm_seconds(cfg, hw, lay, chunk)
    prefill_tps = chunk / (max(t_compute, t_memory) + t_comm)
    # One prompt alone: its chunks fill the pipeline ((pp - 1) extra stage times), and under DP attention
    # a single rank per stage runs its trunk and attention (experts still spread over the stage).
    ranks = 1 if dp else tp
    one_c = chunk * (pf["routed"] / peak_routed / tp + pf["other"] / peak_other / ranks) / pp
    one_m = (touched_experts / tp + trunk_read / ranks) / (pp * bw)
    one_stage = max(one_c, one_m) + comm_seconds(cfg, hw, lay, chunk * (n // pp if dp else 1))
    ttft = (spec.context / chunk + pp - 1) * one_stage
    return {
        "decode_tokens_per_s": decode_tps, "decode_tokens_per_s_per_sequence": 1.0 / step,
        "decode_step_ms": 1e3 * step, "decode_comm_ms": 1e3 * pp * comm,
        "prefill_comm_share": t_comm / (max(t_compute, t_memory) + t_comm),
        "decode_bound": "memory" if dev_time_memory >= dev_time_compute else "compute",
        "decode_bytes_per_step": expert_bytes + trunk_read + B * (state_rw + mla_read),
        "decode_bytes_per_step_per_device": dev_bytes, "decode_distinct_experts_per_layer": distinct,
        "decode_flops_per_token": fl["total"], "decode_flops_breakdown": fl,
        "prefill_tokens_per_s": prefill_tps, "prefill_flops_per_token": pf["total"], "prefill_flops_breakdown": pf,
        "prefill_bound": "compute" if t_compute >= t_memory else "memory",
        "time_to_first_token_s": ttft,
        "compute_formats": {"routed": hw.flops_for(e_fmt.compute)[1], "other": hw.flops_for(t_fmt.compute)[1]},
    }


def plan(cfg: K3Config, hw: Hardware, spec: ServeSpec) -> dict:
    """Everything for one (config, hardware, formats, context, concurrency): the `serve` part of
    `openk3 plan --json`. When nothing fits, `deployment.fits` is false and speeds are absent."""
    spec.validate()
    p = counts.params(cfg)
    mem = memory(cfg, spec, p)
    mem["total_bytes"] = mem["weights_bytes"] + mem["cache_bytes"] + mem["activation_bytes"]
    lay = choose_layout(cfg, hw, spec, mem)
    out = {"memory": mem, "hardware": hw.key, "spec": asdict(spec)}
    if lay is None:
        out["deployment"] = {"fits": False, "reason": _no_fit_reason(cfg, hw, spec, mem)}
        return out
    dev = per_device_bytes(cfg, spec, mem, lay)
    budget = hw.memory_bytes * spec.usable_memory
    free = budget - (dev["total"] - dev["kda_state"] - dev["mla_cache"])
    out["deployment"] = {
        "fits": dev["total"] <= budget, "layout": lay.to_dict(), "per_device_bytes": dev,
        "device_memory_bytes": hw.memory_bytes, "usable_bytes_per_device": budget,
        "max_concurrency_at_context": max_concurrency(mem, lay, free),
    }
    perf = roofline(cfg, hw, spec, mem, lay, p)
    usd_h = hw.price_per_hour * lay.devices
    out["performance"] = perf
    out["cost"] = {"usd_per_hour": usd_h,
                   "usd_per_million_output_tokens": usd_h / (perf["decode_tokens_per_s"] * 3600) * 1e6,
                   "usd_per_million_input_tokens": usd_h / (perf["prefill_tokens_per_s"] * 3600) * 1e6}
    return out


def max_concurrency(mem: dict, lay: Layout, free: float) -> int | None:
    """Sequences of the planned context the deployment can hold in `free` bytes per device. TP attention:
    every sequence is on every rank (KDA heads split, latent replicated). DP attention: whole sequences
    per rank, so the ranks of a stage add up."""
    kda = mem["kda_state_bytes_per_sequence"] + mem["kda_conv_bytes_per_sequence"]
    mla = mem["mla_cache_bytes_per_sequence"]
    if lay.attention == "tp":
        per_seq, holders = kda / (lay.tp * lay.pp) + mla / lay.pp, 1
    else:
        per_seq, holders = (kda + mla) / lay.pp, lay.devices // lay.pp
    return holders * max(0, int(free // per_seq)) if per_seq > 0 else None


def _no_fit_reason(cfg: K3Config, hw: Hardware, spec: ServeSpec, mem: dict) -> str:
    budget = hw.memory_bytes * spec.usable_memory
    if spec.attention == "dp" and mem["non_routed_bytes"] > budget * cfg.num_hidden_layers:
        return "data-parallel attention replicates the non-routed weights, which exceed even one layer per device"
    widest = layout_for(cfg, hw, _tp_max(cfg, hw) * cfg.num_hidden_layers, spec.attention)
    need = per_device_bytes(cfg, spec, mem, widest)["total"]
    return (f"{spec.concurrency:,} sequence(s) of {spec.context:,} tokens need {need / 1e9:,.1f} GB per device even "
            f"at TP{widest.tp} x PP{widest.pp} (one layer per stage), over the {budget / 1e9:,.4g} GB usable "
            f"({100 * spec.usable_memory:.3g}% of {hw.memory_bytes / 1e9:,.0f} GB)")


def _int(x: float) -> int:
    return int(round(x))
