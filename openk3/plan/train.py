"""Training arithmetic: FLOPs for N tokens, GPU-hours and cost at an MFU, memory per GPU.

Memory per GPU assumes everything persistent is fully sharded over the G GPUs (FSDP/ZeRO-3 for the
trunk, expert parallelism + FSDP for the experts): bf16 weights, fp32 master weights, fp32 gradients
and the optimizer state. openk3's optimizer split (`openk3/train/optim.py`) puts the matrices on Muon
(one fp32 momentum) and the embedding, head, vectors, conv taps, AttnRes queries, router and KDA beta
gate on AdamW (two fp32 moments). On top: the all-gathered bf16 weights of one layer (experts stay
sharded) and the activations of one micro-batch with full activation checkpointing (each layer's
input and the AttnRes block representations kept, one layer recomputed at a time).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from openk3.config import K3Config
from openk3.plan import counts
from openk3.plan.hardware import Hardware
from openk3.plan.serve import activation_bytes

_ADAMW_SUFFIXES = ("_conv1d", "_res_proj", ".gate", ".b_proj")


@dataclass
class TrainSpec:
    tokens: float = 1e12  # training tokens
    seq_len: int = 8192
    mfu: float = 0.4  # model FLOPs utilisation
    precision: str = "bf16"  # matmul rate: "bf16" or "fp8"
    optimizer: str = "muon"  # "muon" (openk3's split) or "adamw" (everything AdamW)
    gpus: int | None = None  # None = the fewest that fit (multiples of a node)
    micro_batch_tokens: int | None = None  # per GPU per micro-step; default seq_len
    usable_memory: float = 0.9

    def validate(self) -> None:
        # `not x > 0` also rejects NaN; inf tokens would print "inf" and break --json
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, (int, float)) or not 0 < self.tokens < math.inf:
            raise ValueError(f"training tokens must be a positive finite number, got {self.tokens!r}")
        for name in ("seq_len", "gpus", "micro_batch_tokens"):
            v = getattr(self, name)
            if (v is not None or name == "seq_len") and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"training {name} must be a positive integer, got {v!r}")
        for name in ("mfu", "usable_memory"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"training {name} must be in (0, 1], got {v!r}")
        if self.precision not in ("bf16", "fp8"):
            raise ValueError(f"training precision must be 'bf16' or 'fp8', got {self.precision!r}")
        if self.optimizer not in ("muon", "adamw"):
            raise ValueError(f"optimizer must be 'muon' or 'adamw', got {self.optimizer!r}")


def optimizer_split(cfg: K3Config) -> dict[str, int]:
    """Parameters on Muon and on AdamW under openk3's grouping."""
    adamw = muon = 0
    for t in counts.tensors(cfg):
        if t.name.endswith("e_score_correction_bias"):
            continue  # a buffer moved by load balancing, not by an optimizer
        if t.vector or t.component in ("embedding", "lm_head") or t.name.endswith(_ADAMW_SUFFIXES):
            adamw += t.numel
        else:
            muon += t.numel
    return {"muon": muon, "adamw": adamw}


def state_bytes(cfg: K3Config, optimizer: str) -> dict[str, int]:
    """Persistent training state of the whole model, bytes (before sharding)."""
    p = counts.params(cfg)
    split = optimizer_split(cfg)
    opt = 8 * p.total if optimizer == "adamw" else 4 * split["muon"] + 8 * split["adamw"]
    return {"weights_bf16": 2 * p.total, "master_fp32": 4 * p.total, "grads_fp32": 4 * p.total,
            "optimizer": opt, "total": 10 * p.total + opt}


def largest_layer_bytes(cfg: K3Config) -> int:
    """bf16 bytes of the biggest non-expert layer (what FSDP all-gathers at once)."""
    per_layer: dict[str, int] = {}
    for t in counts.tensors(cfg):
        if t.component == "routed_experts" or not t.name.startswith("layers."):
            continue
        key = t.name.split(".")[1]
        per_layer[key] = per_layer.get(key, 0) + t.numel
    return 2 * max(per_layer.values(), default=0)


def checkpoint_bytes_per_token(cfg: K3Config) -> float:
    """Kept per token with full checkpointing: each layer's input (bf16) + the AttnRes block reps."""
    return 2.0 * cfg.hidden_size * (cfg.num_hidden_layers + counts.num_attn_res_blocks(cfg))


def per_gpu_bytes(cfg: K3Config, spec: TrainSpec, gpus: int) -> dict[str, float]:
    mb = spec.micro_batch_tokens or spec.seq_len
    st = state_bytes(cfg, spec.optimizer)
    sharded = st["total"] / gpus
    gathered = 2 * largest_layer_bytes(cfg)  # the current layer + the next one prefetched
    act = mb * checkpoint_bytes_per_token(cfg) + 3 * activation_bytes(cfg, mb)  # forward + backward of one layer
    logits = mb * cfg.vocab_size * 4  # fp32 logits of the micro-batch (chunked losses avoid this)
    return {"sharded_state": sharded, "gathered_weights": gathered, "activations": act, "logits": logits,
            "total": sharded + gathered + act + logits}


def fewest_gpus(cfg: K3Config, spec: TrainSpec, hw: Hardware, budget: float) -> int | None:
    """Fewest GPUs (1, 2, 4, then whole nodes) whose per-GPU memory fits `budget`; None if none can
    (the unsharded part alone is too big: shrink the micro-batch)."""
    one = per_gpu_bytes(cfg, spec, 1)
    fixed = one["total"] - one["sharded_state"]
    if fixed >= budget:
        return None
    need = math.ceil(one["sharded_state"] / (budget - fixed))
    node = hw.devices_per_node
    small = [g for g in (1, 2, 4) if g < node and g >= need]
    return small[0] if small else node * math.ceil(need / node)


def plan(cfg: K3Config, hw: Hardware, spec: TrainSpec) -> dict:
    """FLOPs, GPU-hours, cost and memory for pretraining on `hw` (the `train` part of the JSON)."""
    spec.validate()
    fpt = counts.flops_per_token(cfg, spec.seq_len, training=True)
    total = fpt * spec.tokens
    peak, used = hw.flops_for(spec.precision)
    gpu_hours = total / (peak * spec.mfu) / 3600
    budget = hw.memory_bytes * spec.usable_memory
    gpus = spec.gpus
    if gpus is None:
        gpus = fewest_gpus(cfg, spec, hw, budget)
    mem = per_gpu_bytes(cfg, spec, gpus) if gpus else None
    return {
        "tokens": spec.tokens, "seq_len": spec.seq_len, "flops_per_token": fpt, "total_flops": total,
        "precision": used, "mfu": spec.mfu, "gpu_hours": gpu_hours,
        "cost_usd": gpu_hours * hw.price_per_hour, "optimizer": spec.optimizer,
        "optimizer_split": optimizer_split(cfg), "state_bytes": state_bytes(cfg, spec.optimizer),
        "gpus": gpus, "fits": bool(mem and mem["total"] <= budget), "per_gpu_bytes": mem,
        "days": gpu_hours / gpus / 24 if gpus else None, "spec": asdict(spec),
    }
