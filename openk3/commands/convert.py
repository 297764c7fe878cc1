"""`openk3 convert SRC DST`: rewrite a checkpoint folder with other expert or config formats.

    openk3 convert runs/k3-bf16 runs/k3-mxfp4 --experts mxfp4     # pack routed experts (RNE, OCP MX)
    openk3 convert ckpt-mxfp4 ckpt-bf16 --experts bf16             # unpack (lossless)
    openk3 convert ckpt ckpt-bare --bare                           # kimi_k3 wrapper -> bare kimi_linear config
    openk3 convert ckpt ckpt-k3 --wrapper                          # and back (tensors gain `language_model.`)
"""

from __future__ import annotations

import argparse

from openk3.commands.common import add_dtype_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="checkpoint folder to read (or a training run folder: its latest checkpoint); "
                               "its other files (tokenizer, templates, code) are copied along")
    p.add_argument("dst", help="folder to write (replaced atomically if it exists)")
    p.add_argument("--experts", choices=["bf16", "mxfp4"], default=None,
                   help="routed-expert format to write (default: as in SRC)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--wrapper", action="store_true", help="write a top-level kimi_k3 config.json")
    form.add_argument("--bare", action="store_true", help="write a bare kimi_linear config.json")
    add_dtype_argument(p, "bf16", "on-disk dtype of the tensors that are not fp32 islands or MXFP4 bytes "
                                  "(auto: as in SRC)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="shard size limit in GiB")



def main(args: argparse.Namespace) -> int:
    import os

    from openk3.checkpoint import resolve_checkpoint, save
    from openk3.checkpoint.load import load_to_rewrite
    from openk3.checkpoint.save import carried_files

    args.src = str(resolve_checkpoint(args.src))  # a run folder converts its latest checkpoint
    if os.path.abspath(args.src) == os.path.abspath(args.dst):
        raise ValueError("SRC and DST must differ (the write is atomic, but reading needs SRC intact)")
    wrapper = True if args.wrapper else False if args.bare else None
    model, experts = load_to_rewrite(args.src, args.experts)
    dtype = args.dtype or model.model.embed_tokens.weight.dtype  # auto: the trunk dtype of SRC (as loaded)
    save(model, args.dst, wrapper=wrapper, experts_format=experts, dtype=dtype,
         max_shard_bytes=int(args.max_shard_gb * 2**30), extra_files=carried_files(args.src))
    print(f"[convert] {args.src} -> {args.dst}: experts {experts}, "
          f"{'kimi_k3 wrapper' if wrapper else 'bare kimi_linear' if wrapper is False else 'config form as before'}, "
          f"{str(dtype).removeprefix('torch.')}")
    return 0
