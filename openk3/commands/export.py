"""`openk3 export hf|vllm SRC OUT`: a checkpoint folder for transformers or for vLLM (needs the `hf` extra).

    openk3 export hf runs/x out-hf        # AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True),
                                          # AutoTokenizer.from_pretrained(out): tokenizer.json from our ranks
    openk3 export vllm runs/x out-vllm    # the release's layout with every field vLLM's kimi_k3 reads

The tokenizer comes from SRC (or --tokenizer DIR). See docs/ecosystem.md.
"""

from __future__ import annotations

import argparse

from openk3.commands.common import add_dtype_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", choices=["hf", "vllm"], help="hf: transformers (auto_map to openk3.hf shims); "
                                                         "vllm: vLLM's native kimi_k3 (no remote code)")
    p.add_argument("src", help="checkpoint folder (or a training run folder: its latest checkpoint)")
    p.add_argument("out", help="folder to write (replaced atomically if it exists)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (tiktoken.model + tokenizer_config.json); "
                                                     "default: the one in SRC")
    p.add_argument("--experts", choices=["bf16", "mxfp4"], default=None,
                   help="routed-expert format to write (default: as in SRC)")
    add_dtype_argument(p, "auto", "on-disk dtype of the tensors that are not fp32 islands or MXFP4 bytes "
                                  "(auto: as in SRC)")


def main(args: argparse.Namespace) -> int:
    try:
        from openk3.hf.export import export_hf, export_vllm
    except ImportError as e:
        raise ValueError(f"openk3 export needs the hf extra (pip install 'openk3[hf]'): {e}") from None
    if args.target == "hf":
        out = export_hf(args.src, args.out, tokenizer=args.tokenizer, experts_format=args.experts, dtype=args.dtype)
        print(f"[export] {out}: transformers folder (AutoModelForCausalLM/AutoTokenizer; trust_remote_code=True, "
              f"or `import openk3.hf` first)")
    else:
        out, notes = export_vllm(args.src, args.out, tokenizer=args.tokenizer, experts_format=args.experts,
                                 dtype=args.dtype)
        print(f"[export] {out}: vLLM folder (vllm serve {out})")
        for note in notes:
            print(f"[export] note: {note}")
    return 0
