"""`openk3 info [PATH] [--preset P | --config FILE] [--json]`: what a model is and costs.

Counts are read off the model built on the meta device (nothing is allocated). With a checkpoint
folder PATH it also reads the safetensors headers (not the data): tensors and bytes by on-disk dtype,
and the shards the index names that are missing.
"""

from __future__ import annotations

import argparse
import json
import os

from openk3.commands.common import add_model_arguments, config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", default=None, help="a checkpoint folder (or its config.json)")
    add_model_arguments(p)
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length for the FLOPs figures")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def file_summary(folder: str) -> dict:
    """Tensors and bytes by dtype from the safetensors headers of a checkpoint folder."""
    from safetensors import safe_open

    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_path):
        try:
            with open(index_path) as fh:
                weight_map = json.load(fh)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    by_dtype: dict[str, dict[str, int]] = {}
    missing, count = [], 0
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            missing.append(name)
            continue
        try:
            with safe_open(path, framework="pt") as fh:
                for key in fh.keys():
                    sl = fh.get_slice(key)
                    dtype, shape = sl.get_dtype(), sl.get_shape()
                    numel = 1
                    for d in shape:
                        numel *= d
                    row = by_dtype.setdefault(dtype, {"tensors": 0, "elements": 0})
                    row["tensors"] += 1
                    row["elements"] += numel
                    count += 1
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"{path}: unreadable safetensors file ({e})") from None
    itemsize = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I32": 4, "I64": 8, "BOOL": 1}
    for dtype, row in by_dtype.items():
        row["bytes"] = row["elements"] * itemsize.get(dtype, 0)
    return {"files": len(files), "tensors": count, "missing_shards": missing, "by_dtype": by_dtype,
            "total_bytes": sum(r["bytes"] for r in by_dtype.values())}


def main(args: argparse.Namespace) -> int:
    import torch

    from openk3.model.accounting import summary
    from openk3.model.model import K3ForCausalLM
    from openk3.plan.report import human_count

    files = None
    if args.path is not None:
        if args.preset or args.config:
            raise ValueError("give either PATH or --preset/--config, not both")
        from openk3.checkpoint import read_config

        cfg, name = read_config(args.path), args.path
        folder = args.path if os.path.isdir(args.path) else os.path.dirname(os.path.abspath(args.path))
        files = file_summary(folder)
    else:
        cfg, name = config_from_args(args)
    model = K3ForCausalLM.build(cfg, device="meta", dtype=torch.bfloat16)
    info = {"config": name, **summary(model, seq_len=args.seq_len)}
    if files is not None:
        info["files"] = files
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    p = info["params"]
    mib = 2**20
    rows = [
        ("config", name),
        ("layers", f"{cfg.num_hidden_layers} ({info['num_kda_layers']} KDA + {info['num_mla_layers']} MLA)"),
        ("total parameters", f"{info['total_params']:,} ({human_count(info['total_params'])})"),
        ("active parameters / token", f"{info['active_params']:,} ({human_count(info['active_params'])}, "
                                      "excluding the embedding lookup)"),
        ("active incl. embedding", f"{info['active_params_with_embedding']:,}"),
        ("routed experts (all)", f"{p['routed_experts']:,}"),
        ("embedding / lm_head", f"{p['embedding']:,} / {p['lm_head']:,}"),
        (f"FLOPs/token fwd @ {args.seq_len}", human_count(info["flops_per_token"]["forward"])),
        (f"FLOPs/token train @ {args.seq_len}", human_count(info["flops_per_token"]["training"])),
        ("KDA state / sequence (fp32)", f"{info['kda_state_bytes_per_sequence'] / mib:,.1f} MiB "
                                        f"(+ {info['kda_conv_bytes_per_sequence'] / mib:,.1f} MiB conv windows)"),
        ("MLA cache / token (bf16)", f"{info['mla_cache_bytes_per_token']:,} bytes"),
    ]
    if files is not None:
        rows.append(("files", f"{files['files']} safetensors, {files['tensors']:,} tensors, "
                              f"{files['total_bytes']:,} bytes"))
        for dtype, row in sorted(files["by_dtype"].items()):
            rows.append((f"  {dtype}", f"{row['tensors']:,} tensors, {row['bytes']:,} bytes"))
        rows.append(("missing shards", ", ".join(files["missing_shards"]) or "none"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
