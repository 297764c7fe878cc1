"""Serving with the routed experts on disk (`openk3 plan --experts-on disk`): one machine, the experts read from
NVMe into a per-layer cache as layers need them (`openk3.stream`), the trunk resident and quantised.

A decoded token asks top_k experts of every MoE layer (16 x 92 = 1,472 for K3); a share h of them is in the
cache, the rest is read: bytes/token = (1 - h) x 1,472 x 17,547,264 (25.83 GB at h = 0). The step costs the
largest of its overlapped terms:

* disk: bytes/token / the disk's GB/s on expert-sized reads;
* memory: the CPU reads the resident trunk and every used expert's bytes once (host GB/s);
* compute: decode FLOPs / the CPU's (or GPU's) FLOP/s;

(`s_per_token`; `s_per_token_serial` adds disk and memory, for a loop without overlap). A prefill chunk of T
tokens reads each expert its tokens touch once: uniform routing touches E (1 - (1 - k/E)^T) per layer, an upper
bound (tokens of one text share experts: ports measured 2.7-3.3x fewer reads at 32-token chunks).

The hit rate h is the user's (`--hit-rate`) or K3's measured curve by slots per layer (`K3_HIT_CURVE`: short
runs of three C ports, docs/inference.md cites them; uncertain, so a flag overrides it).

Memory (fits), as `openk3.load(..., experts="stream", trunk=...)` holds it: the trunk's linears in openk3's
integer formats (`TRUNK_BYTES`: int4 is 4-bit codes plus a float32 scale and zero per 32 weights, 0.75 bytes;
int8 one byte plus a float32 scale per row), lm_head int8, and in the compute dtype (float32: the MXFP4 kernel's)
what is never quantised: the embedding table, the routers, `kv_b_proj`, the AttnRes projections, vectors and
convolutions; the decode state at `context`; an OS/runtime reserve; at least one cache slot per MoE layer. The rest
of RAM is the expert cache unless `cache_bytes` says.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from openk3.config import K3Config
from openk3.plan import counts
from openk3.plan.hardware import Hardware
from openk3.plan.serve import ServeSpec, expected_distinct_experts, memory

# Bytes per weight of openk3's trunk formats (`openk3.quant.trunk`; the per-row int8 scale adds 4 / K, ~0.001)
TRUNK_BYTES = {"bf16": 2.0, "int8": 1.0, "int4": 0.5 + 8 / 32}  # int4 at group 32; `trunk_bytes` for others


def trunk_bytes(fmt: str, group: int = 32) -> float:
    return 0.5 + 8 / group if fmt == "int4" else TRUNK_BYTES[fmt]
_KEEP_FLOAT = ("kv_b_proj", "res_proj")  # read as tensors elsewhere: never quantised

# (cache slots per MoE layer, hit rate) measured on K3 by ports with a per-layer LRU (next-expert-streaming.md
# §1): colibri 12 slots/layer 16 %; waste ~26/layer 30 % (its lookahead off); kimi-k3-in-c ~62/layer (92-110 GB)
# ~44-45 %. Linear between the points, to 1.0 once a layer holds all its experts (E slots).
K3_HIT_CURVE = ((0.0, 0.0), (12.0, 0.16), (26.0, 0.30), (62.0, 0.45))


def k3_hit_rate(slots_per_layer: float, num_experts: int) -> float:
    pts = list(K3_HIT_CURVE) + [(float(num_experts), 1.0)]
    s = max(0.0, min(float(slots_per_layer), float(num_experts)))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if s <= x1:
            return y0 + (y1 - y0) * (s - x0) / (x1 - x0)
    return 1.0


def expert_bytes_per_token(moe_layers: int, top_k: int, expert_bytes: int, hit_rate: float) -> float:
    """Disk bytes one decoded token reads (batch 1): (1 - h) x top_k x MoE layers x bytes per expert."""
    return (1.0 - hit_rate) * top_k * moe_layers * expert_bytes


@dataclass
class DiskSpec:
    disk_gbps: float = 7.0  # sustained GB/s of expert-sized reads (PCIe 4 x4 NVMe ~7; gen 3 ~3.5, gen 5 ~14)
    ram_bytes: float = 64e9
    trunk_format: str = "int4"  # bf16 | int8 | int4 (openk3's weight-only formats, TRUNK_BYTES)
    lm_head_format: str = "int8"
    trunk_group: int = 32  # int4 group size (32, 64, 128, 256): 0.75, 0.625, 0.5625, 0.53 bytes per weight
    compute_bytes: float = 4.0  # the compute dtype of what is never quantised (float32)
    cache_bytes: float | None = None  # None: what RAM leaves after the resident set, the state and the reserve
    hit_rate: float | None = None  # None: K3_HIT_CURVE at the cache's slots per layer
    host_gbps: float = 60.0  # DRAM bandwidth the CPU reads weights at (dual-channel DDR5 ~60-80)
    cpu_gflops: float = 1500.0  # CPU matmul rate for prefill (16 AVX-512 cores ~1-3 TFLOP/s fp32/bf16)
    reserve_bytes: float = 8e9  # OS, Python, buffers, page tables
    context: int = 8192
    prefill_chunk: int = 4096
    gpu: Hardware | None = None  # the trunk (and decode state) in its memory when they fit there

    def validate(self) -> None:
        for name in ("disk_gbps", "ram_bytes", "host_gbps", "cpu_gflops"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be positive, got {v!r}")
        for name in ("trunk_format", "lm_head_format"):
            if getattr(self, name) not in TRUNK_BYTES:
                raise ValueError(f"{name} must be one of {sorted(TRUNK_BYTES)}, got {getattr(self, name)!r}")
        if self.trunk_group not in (32, 64, 128, 256):
            raise ValueError(f"trunk_group must be 32, 64, 128 or 256, got {self.trunk_group!r}")
        if self.hit_rate is not None and not 0 <= self.hit_rate <= 1:
            raise ValueError(f"hit_rate must be in [0, 1], got {self.hit_rate!r}")
        if self.cache_bytes is not None and not self.cache_bytes > 0:
            raise ValueError(f"cache_bytes must be positive, got {self.cache_bytes!r}")
        for name in ("context", "prefill_chunk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")


def plan_disk(cfg: K3Config, spec: DiskSpec) -> dict:
    """Memory, fit, bytes and seconds per token, and prefill per chunk, with the experts on disk."""
    spec.validate()
    p = counts.params(cfg)
    mem = memory(cfg, ServeSpec(context=spec.context, prefill_chunk=spec.prefill_chunk))
    head = p.lm_head * TRUNK_BYTES[spec.lm_head_format]
    floats = quantised = 0.0
    for t in counts.tensors(cfg):
        if t.component in ("routed_experts", "lm_head"):
            continue
        if t.vector or t.fp32 or t.component in ("embedding", "router") or t.name.endswith(_KEEP_FLOAT):
            floats += t.numel
        else:
            quantised += t.numel
    trunk = quantised * trunk_bytes(spec.trunk_format, spec.trunk_group) + floats * spec.compute_bytes + head
    state = mem["cache_bytes_per_sequence"]
    expert = mem["expert_bytes_each"]
    L, k, E = counts.num_moe_layers(cfg), cfg.num_experts_per_token, cfg.num_experts
    gpu_holds = spec.gpu is not None and trunk + state <= spec.gpu.memory_bytes * 0.9
    resident_ram = spec.reserve_bytes + (0 if gpu_holds else trunk + state)
    min_cache = L * expert
    free = spec.ram_bytes - resident_ram
    cache = spec.cache_bytes if spec.cache_bytes is not None else max(0.0, free)
    fits = free >= min_cache and cache <= free
    slots = cache / expert / L if L else 0.0
    h = spec.hit_rate if spec.hit_rate is not None else k3_hit_rate(slots, E)
    requests = k * L
    disk_bytes = expert_bytes_per_token(L, k, expert, h)
    disk_s = disk_bytes / (spec.disk_gbps * 1e9)
    used_expert_bytes = requests * expert
    fl = counts.decode_flops_per_token(cfg, spec.context, p)
    if gpu_holds:
        trunk_s = trunk / spec.gpu.memory_bandwidth
        compute_s = fl["other"] / spec.gpu.flops_for("bf16")[0] + fl["routed"] / (spec.cpu_gflops * 1e9)
        host_bytes = used_expert_bytes
    else:
        trunk_s = 0.0
        compute_s = fl["total"] / (spec.cpu_gflops * 1e9)
        host_bytes = used_expert_bytes + trunk
    memory_s = host_bytes / (spec.host_gbps * 1e9) + trunk_s
    step = max(disk_s, memory_s, compute_s)
    chunk = spec.prefill_chunk
    touched = min(E, expected_distinct_experts(cfg, chunk)) * L * expert
    pf = counts.prefill_flops_per_token(cfg, chunk, p)
    pf_rate = spec.gpu.flops_for("bf16")[0] if gpu_holds else spec.cpu_gflops * 1e9
    chunk_disk = touched / (spec.disk_gbps * 1e9)
    chunk_compute = chunk * pf["total"] / pf_rate
    chunk_s = max(chunk_disk, chunk_compute)
    return {
        "spec": {**asdict(spec), "gpu": spec.gpu.key if spec.gpu else None},
        "memory": {"trunk_bytes": trunk, "lm_head_bytes": head, "float_params": floats, "quantised_params": quantised,
                   "state_bytes": state, "reserve_bytes": spec.reserve_bytes, "trunk_on_gpu": gpu_holds,
                   "ram_resident_bytes": resident_ram, "expert_cache_bytes": cache, "min_cache_bytes": min_cache,
                   "routed_experts_on_disk_bytes": mem["routed_experts_bytes"], "fits": fits,
                   "reason": None if fits else (
                       f"RAM {spec.ram_bytes / 1e9:.1f} GB leaves {free / 1e9:.1f} GB after the resident "
                       f"{resident_ram / 1e9:.1f} GB; the cache needs at least {min_cache / 1e9:.2f} GB (one expert "
                       f"per MoE layer)" + (f" and was given {cache / 1e9:.1f} GB" if spec.cache_bytes else ""))},
        "decode": {"expert_bytes_each": expert, "requests_per_token": requests, "slots_per_layer": slots,
                   "hit_rate": h, "hit_rate_source": "given" if spec.hit_rate is not None else "K3 measured curve",
                   "disk_bytes_per_token": disk_bytes, "disk_s_per_token": disk_s, "memory_s_per_token": memory_s,
                   "compute_s_per_token": compute_s, "s_per_token": step, "s_per_token_serial": disk_s + memory_s,
                   "tokens_per_s": 1 / step, "bound": max((disk_s, "disk"), (memory_s, "memory"),
                                                           (compute_s, "compute"))[1]},
        "prefill": {"chunk": chunk, "expert_bytes_per_chunk": touched, "disk_s_per_chunk": chunk_disk,
                    "compute_s_per_chunk": chunk_compute, "s_per_chunk": chunk_s, "tokens_per_s": chunk / chunk_s,
                    "distinct_experts_per_layer": min(E, expected_distinct_experts(cfg, chunk))},
    }


def text(result: dict, name: str) -> str:
    m, d, pf, s = result["memory"], result["decode"], result["prefill"], result["spec"]
    gb = 1e9
    group = f"-g{s['trunk_group']}" if s["trunk_format"] == "int4" else ""
    lines = [
        f"{name} with the routed experts on disk ({m['routed_experts_on_disk_bytes'] / gb:,.0f} GB of MXFP4), "
        f"{s['ram_bytes'] / gb:.0f} GB RAM, disk {s['disk_gbps']:g} GB/s" + (f", GPU {s['gpu']}" if s["gpu"] else ""),
        f"  resident: trunk {s['trunk_format']}{group}"
        f" + lm_head {s['lm_head_format']} + {m['float_params'] / 1e9:.1f} B "
        f"float weights (embedding, routers, kv_b_proj, vectors) {m['trunk_bytes'] / gb:.1f} GB"
        f"{' (on the GPU)' if m['trunk_on_gpu'] else ''}, state {m['state_bytes'] / gb:.2f} GB at {s['context']:,} "
        f"tokens, reserve {m['reserve_bytes'] / gb:.0f} GB",
        f"  expert cache {m['expert_cache_bytes'] / gb:.1f} GB = {d['slots_per_layer']:.1f} experts per MoE layer; "
        f"hit rate {d['hit_rate']:.2f} ({d['hit_rate_source']})",
        f"  fits: {'yes' if m['fits'] else 'no: ' + m['reason']}",
        f"  decode: {d['disk_bytes_per_token'] / gb:.2f} GB read per token; disk {d['disk_s_per_token']:.2f} s, "
        f"memory {d['memory_s_per_token']:.2f} s, compute {d['compute_s_per_token']:.2f} s -> "
        f"{d['s_per_token']:.2f} s/token ({d['bound']}-bound; {d['s_per_token_serial']:.2f} without overlap)",
        f"  prefill: a {pf['chunk']:,}-token chunk touches {pf['distinct_experts_per_layer']:.0f} experts per layer "
        f"({pf['expert_bytes_per_chunk'] / gb:,.0f} GB, {pf['disk_s_per_chunk']:.0f} s of disk) and computes "
        f"{pf['compute_s_per_chunk']:.0f} s -> {pf['tokens_per_s']:.1f} tokens/s (uniform routing: an upper bound "
        f"on reads)",
    ]
    return "\n".join(lines) + "\n"
