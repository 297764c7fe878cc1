"""`openk3 info [PATH] [--preset P | --config FILE] [--json]`: what a model is and costs.

Counts are read off the model built on the meta device (nothing is allocated). With a checkpoint
folder PATH (or a training run folder: its latest checkpoint) it also reads the safetensors headers
(not the data): tensors and bytes by on-disk dtype, and then reads every tensor once to check that none
holds NaN or inf (`--headers-only` skips that read, for a checkpoint too large to read through). A broken
checkpoint (a missing shard or tensor, no weights, an index entry outside the folder, shapes or dtypes that
do not fit the config, NaN/inf weights, named) is an error: exit code 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json

from openk3.commands.common import add_model_arguments, config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", default=None,
                   help="a checkpoint folder (or its config.json), or a training run folder")
    add_model_arguments(p)
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length for the FLOPs figures")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--headers-only", action="store_true",
                   help="read only the safetensors headers: skip the check that no weight is NaN or inf (which "
                        "reads every tensor once)")


def file_summary(path: str, read_data: bool = False) -> tuple[str, dict, object]:
    """(checkpoint folder, tensors and bytes by on-disk dtype, its K3Config) of a checkpoint or run folder,
    from its safetensors headers, after checking it as `openk3.load` does before reading data (config, index,
    every shard present and readable, every tensor the config needs with its shape and dtype); `read_data`:
    also every tensor's values (none NaN or inf).

    Raises ValueError (one line) for a broken checkpoint; FileNotFoundError for a missing path.
    """
    from openk3.checkpoint import files as checkpoint_files
    from openk3.checkpoint.load import inventory, nonfinite_tensors

    try:
        inv, handles = inventory(path, keep_handles=read_data)
    except ValueError as e:  # the loader lists problems one per line; the CLI prints one line
        raise ValueError("; ".join(line.strip() for line in str(e).splitlines())) from None
    try:
        bad = nonfinite_tensors(inv, handles) if read_data else []
    finally:
        checkpoint_files.close(handles)
    if bad:
        raise ValueError(f"{inv.folder}: {len(bad)} tensor(s) hold NaN or inf values (a diverged run, or a corrupt "
                         f"file): {checkpoint_files.some_names(bad, 8)}")
    by_dtype: dict[str, dict[str, int]] = {}
    for dtype, shape in inv.headers.values():
        numel = 1
        for d in shape:
            numel *= d
        row = by_dtype.setdefault(dtype, {"tensors": 0, "elements": 0})
        row["tensors"] += 1
        row["elements"] += numel
    itemsize = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I32": 4, "I64": 8, "BOOL": 1}
    for dtype, row in by_dtype.items():
        row["bytes"] = row["elements"] * itemsize.get(dtype, 0)
    # missing_shards stays in the JSON for readers of the old form: a missing shard is now an error
    summary = {"files": len(set(inv.weight_map.values())), "tensors": len(inv.headers), "missing_shards": [],
               "experts_format": inv.experts_format, "by_dtype": by_dtype,
               "total_bytes": sum(r["bytes"] for r in by_dtype.values())}
    return str(inv.folder), summary, inv.cfg


def main(args: argparse.Namespace) -> int:
    files = None
    if args.path is not None:
        if args.preset or args.config:
            raise ValueError("give either PATH or --preset/--config, not both")
        name, files, cfg = file_summary(args.path, read_data=not args.headers_only)  # config read once
    else:
        cfg, name = config_from_args(args)  # a mistyped preset or config is refused before torch loads (~2 s)
    import torch

    from openk3.model.accounting import summary
    from openk3.model.model import K3ForCausalLM
    from openk3.plan.report import human_count

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
        rows.append(("routed experts on disk", files["experts_format"]))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
