"""`openk3 merge`: merge fine-tuned checkpoints that share a base (the ablation of issue 18, item 5).

    openk3 merge --base runs/sft --models runs/t-general-low runs/t-general-high ... --method ties \\
        --density 0.5 --lam 1 --out runs/merged-ties
    openk3 merge --base runs/sft --models A B --method linear --weights 3 1 --out runs/soup

Reads release-format checkpoints (or training run folders: their latest checkpoint) with `openk3.load`,
checks that every config equals the base's and that all share one routed-expert format, merges the
state dicts in float32/float64 (`openk3.posttrain.merge`; MXFP4 experts are dequantised, merged and
requantised, with the error recorded), and writes the result with `openk3.save` (atomic) in the base's
expert format, with the base's other files (tokenizer, templates) and a `merge_report.json`.
All N + 1 models are held in memory in float32 at once: this is for the ablation's model sizes.
"""

from __future__ import annotations

import argparse

from openk3.commands.common import add_dtype_argument

METHODS = ("linear", "task_arithmetic", "ties", "dare_ties", "dare_task_arithmetic", "model_stock")
DEFAULT_DENSITY = {"ties": 0.5, "dare_ties": 0.3, "dare_task_arithmetic": 0.3}  # inside §3.7's tuning ranges
REPORT_FILE = "merge_report.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", required=True, help="the models' common starting point (the SFT checkpoint)")
    p.add_argument("--models", required=True, nargs="+", metavar="DIR", help="the fine-tuned checkpoints to merge")
    p.add_argument("--method", required=True, choices=METHODS,
                   help="linear (weighted average), task_arithmetic (base + lam * mean task vector), ties, "
                        "dare_ties, dare_task_arithmetic (mergekit's dare_linear), model_stock")
    p.add_argument("--weights", type=float, nargs="+", default=None,
                   help="relative weight per model (normalised to sum 1); default uniform")
    p.add_argument("--lam", type=float, default=1.0, help="scale of the merged task vector (default 1)")
    p.add_argument("--density", type=float, default=None,
                   help="share of each task vector kept: top magnitudes (ties) or at random (dare_*); "
                        f"default {', '.join(f'{k} {v}' for k, v in DEFAULT_DENSITY.items())}")
    p.add_argument("--seed", type=int, default=0, help="DARE's drop masks (default 0)")
    p.add_argument("--out", required=True, help="folder to write (replaced atomically if it exists)")
    add_dtype_argument(p, "auto", "on-disk dtype of the tensors that are not fp32 islands or MXFP4 bytes "
                                  "(auto: as in the base)")


def config_difference(base, other) -> str | None:
    """The first architecture field (name = base value vs other value) in which two configs differ, or
    None. Metadata kept in `extra` (wrapper fields, quantization_config, ...) is not compared."""
    import dataclasses

    a, b = dataclasses.asdict(base), dataclasses.asdict(other)
    for key in a:
        if key != "extra" and a[key] != b[key]:
            return f"{key} = {a[key]!r} in the base, {b[key]!r} here"
    return None


def main(args: argparse.Namespace) -> int:
    import json
    import os
    import tempfile

    import torch

    from openk3.checkpoint import load, read_config, resolve_checkpoint, save
    from openk3.commands.convert import carried_files
    from openk3.posttrain.merge import merge

    base = resolve_checkpoint(args.base)
    models = [resolve_checkpoint(m) for m in args.models]
    out = os.path.abspath(args.out)
    for p in (base, *models):
        if os.path.abspath(p) == out:
            raise ValueError(f"--out {args.out} is one of the inputs ({p}); write the merge elsewhere")
    if args.weights is not None and len(args.weights) != len(models):
        raise ValueError(f"--weights: {len(args.weights)} weights for {len(models)} models")
    density = args.density if args.density is not None else DEFAULT_DENSITY.get(args.method, 1.0)

    def experts_format(cfg) -> str:
        return "mxfp4" if "quantization_config" in cfg.extra else "float"

    base_cfg = read_config(base)
    packed = experts_format(base_cfg) == "mxfp4"
    for m in models:
        cfg = read_config(m)
        diff = config_difference(base_cfg, cfg)
        if diff is not None:
            raise ValueError(f"{m / 'config.json'}: config differs from the base {base}: {diff}")
        if experts_format(cfg) != experts_format(base_cfg):
            raise ValueError(f"{m}: routed experts are {experts_format(cfg)}, the base's are "
                             f"{experts_format(base_cfg)}; convert one side first (openk3 convert --experts)")

    # the base, as the output's container, in the output dtype (auto: as on disk); MXFP4 experts stay
    # packed so that merge.py dequantises, merges and requantises them and records the error
    model = load(base, dtype=args.dtype, keep_packed=packed)
    out_dtype = model.model.embed_tokens.weight.dtype

    def fp32(sd):
        return {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}

    base_sd = fp32(model.state_dict())
    model_sds = [load(m, dtype=torch.float32, keep_packed=packed).state_dict() for m in models]
    result = merge(base_sd, model_sds, args.method, weights=args.weights, lam=args.lam, density=density,
                   seed=args.seed)
    del model_sds
    model.load_state_dict(result.state_dict)

    report = {"base": str(base), "models": [str(m) for m in models], "dtype": str(out_dtype).removeprefix("torch."),
              "experts": "mxfp4" if packed else "float", **result.report}
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, REPORT_FILE)
        with open(report_path, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
        save(model, args.out, dtype=out_dtype, extra_files={**carried_files(str(base)), REPORT_FILE: report_path})
    worst = max((e["rel_rms"] for e in result.report["quant_error"].values()), default=None)
    quant = f"; MXFP4 requantisation error <= {worst:.2e} relative RMS" if worst is not None else ""
    print(f"[merge] {args.method} of {len(models)} models onto {base} -> {args.out} "
          f"(lam {args.lam}, density {density}, {report['dtype']}{quant})")
    return 0
