"""`openk3 info --preset k3 [--json]`: counts read off the model built on the meta device."""

from __future__ import annotations

import argparse
import json

from openk3.commands.common import add_model_arguments, config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length for the FLOPs figures")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def main(args: argparse.Namespace) -> int:
    import torch

    from openk3.model.accounting import summary
    from openk3.model.model import K3ForCausalLM

    cfg, name = config_from_args(args)
    model = K3ForCausalLM.build(cfg, device="meta", dtype=torch.bfloat16)
    info = summary(model, seq_len=args.seq_len)
    info = {"config": name, **info}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    p = info["params"]
    mib = 2**20
    rows = [
        ("config", name),
        ("layers", f"{cfg.num_hidden_layers} ({info['num_kda_layers']} KDA + {info['num_mla_layers']} MLA)"),
        ("total parameters", f"{info['total_params']:,} ({_human(info['total_params'])})"),
        ("active parameters / token", f"{info['active_params']:,} ({_human(info['active_params'])}, "
                                      "excluding the embedding lookup)"),
        ("active incl. embedding", f"{info['active_params_with_embedding']:,}"),
        ("routed experts (all)", f"{p['routed_experts']:,}"),
        ("embedding / lm_head", f"{p['embedding']:,} / {p['lm_head']:,}"),
        (f"FLOPs/token fwd @ {args.seq_len}", _human(info["flops_per_token"]["forward"])),
        (f"FLOPs/token train @ {args.seq_len}", _human(info["flops_per_token"]["training"])),
        ("KDA state / sequence (fp32)", f"{info['kda_state_bytes_per_sequence'] / mib:,.1f} MiB "
                                        f"(+ {info['kda_conv_bytes_per_sequence'] / mib:,.1f} MiB conv windows)"),
        ("MLA cache / token (bf16)", f"{info['mla_cache_bytes_per_token']:,} bytes"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
