"""`openk3 merge`: merge fine-tuned checkpoints that share a base (the ablation of issue 18, item 5).

    openk3 merge --base runs/sft --models runs/t-general-low runs/t-general-high ... --method ties \\
        --density 0.5 --lam 1 --out runs/merged-ties
    openk3 merge --base runs/sft --models A B --method linear --weights 3 1 --out runs/soup

`openk3.posttrain.merge.merge_checkpoints` does the work: it reads release-format checkpoints (or training
run folders: their latest checkpoint), checks that every config equals the base's and that all share one
routed-expert format, merges the state dicts in float32/float64 (MXFP4 experts are dequantised, merged and
requantised, with the error recorded), and writes the result (atomic) in the base's expert format, with the
base's other files (tokenizer, templates) and a `merge_report.json`. All N + 1 models are held in memory in
float32 at once: this is for the ablation's model sizes.
"""

from __future__ import annotations

import argparse

from openk3.commands.common import add_dtype_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    from openk3.posttrain.merge import DEFAULT_DENSITY, METHODS  # (torch: this command needs it anyway)

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


def main(args: argparse.Namespace) -> int:
    from openk3.posttrain.merge import merge_checkpoints

    merge_checkpoints(args.base, args.models, args.out, args.method, weights=args.weights, lam=args.lam,
                      density=args.density, seed=args.seed, dtype=args.dtype)
    return 0
