"""The deployment and training planner behind `openk3 plan` (no torch; answers in milliseconds).

    from openk3.plan import plan, ServeSpec, TrainSpec
    result = plan("k3", hardware="b300", serve=ServeSpec(context=131072, concurrency=16))

Modules: `counts` (parameters, FLOPs, decode state from a config), `formats` (bytes per value),
`hardware` (the catalogue with sources), `serve` (memory, layout, roofline, cost), `train` (FLOPs,
GPU-hours, memory under sharding), `audit` (circulating claims recomputed), `report` (tables, PNG).
"""

from __future__ import annotations

import dataclasses

from openk3.config import K3Config
from openk3.plan import counts, hardware, models, serve, train
from openk3.plan.serve import ServeSpec
from openk3.plan.train import TrainSpec

__all__ = ["ServeSpec", "TrainSpec", "plan"]


def plan(model: str | K3Config = "k3", *, hardware_key: str = "h200", serve_spec: ServeSpec | None = None,
         train_spec: TrainSpec | None = None, name: str | None = None) -> dict:
    """The whole plan as one JSON-able dict (what `openk3 plan --json` prints)."""
    cfg, name = (models.resolve(model) if isinstance(model, str) else (model, name or "config"))
    hw = hardware.get(hardware_key)
    serve_spec = serve_spec or ServeSpec(**models.release_formats(name))
    train_spec = train_spec or TrainSpec()
    p = counts.params(cfg)
    st = counts.state_sizes(cfg)
    s = serve.plan(cfg, hw, serve_spec)
    t = train.plan(cfg, hw, train_spec)
    dec = counts.decode_flops_per_token(cfg, serve_spec.context, p)
    return {
        "model": name, "published": models.PUBLISHED.get(name),
        "total_params": p.total, "active_params": p.active, "active_params_with_embedding": p.active_with_embedding,
        "params": p.to_dict(), "num_hidden_layers": cfg.num_hidden_layers,
        "num_kda_layers": st["num_kda_layers"], "num_mla_layers": st["num_mla_layers"],
        "formats": {"experts": serve_spec.expert_format, "trunk": serve_spec.trunk_format,
                    "embeddings": serve_spec.embedding_format, "kda_state": serve_spec.kda_state_format,
                    "mla_cache": serve_spec.mla_cache_format, "conv_state": serve_spec.conv_state_format},
        "memory": s["memory"],
        "flops_per_token": {
            "context": serve_spec.context,
            "prefill": counts.prefill_flops_per_token(cfg, serve_spec.context, p)["total"],
            "decode": dec["total"], "decode_mla_attention": dec["mla_attention"],
            "decode_kda_attention": dec["kda_attention"],
            "forward_at_seq_len": counts.flops_per_token(cfg, train_spec.seq_len),
            "training": counts.flops_per_token(cfg, train_spec.seq_len, training=True)},
        "hardware": dataclasses.asdict(hw),
        "serve": s["spec"], "deployment": s["deployment"],
        **({"performance": s["performance"], "cost": s["cost"]} if "performance" in s else {}),
        "train": t,
    }
