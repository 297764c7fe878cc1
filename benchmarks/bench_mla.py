"""Causal MLA attention in training (forward + backward): the forms openk3 can run, side by side.

At each sequence length, on the preset's MLA shapes (heads, query/key width, value width, latent), one
thread, float32, contenders timed in alternation:

* `naive`: `mla_attention_naive` with the causal mask (the eager reference: einsum scores, fp32 softmax,
  einsum with the values; what transformers' eager attention computes);
* `sdpa, values as they are`: torch's `scaled_dot_product_attention(is_causal=True)` on MLA's narrower value
  heads, for which CPU torch takes its math kernel (what `mla_attention_causal` ran before 2026-12-02);
* `openk3` (`mla_attention_causal`): the values zero-padded to the key width, so the flash kernel runs.

Checks first that the three agree (forward, 1e-4), then prints ms per call and the ratio of each contender to
`openk3`. Nothing asserts on time.

    python benchmarks/bench_mla.py                          # nano and small-kl, T = 256 ... 2048
    python benchmarks/bench_mla.py --presets small --lengths 512,4096 --batch 2
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_line, median, setup_threads, time_interleaved, write_json  # noqa: E402

from openk3.config import preset  # noqa: E402
from openk3.ops.mla import attention_mask, expand_kv, mla_attention_causal, mla_attention_naive  # noqa: E402


def contenders(cfg, B: int, T: int) -> dict:
    """name -> a fwd + bwd closure on fresh random inputs of the preset's MLA shapes."""
    H, Dn, Dr, Dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    C = cfg.kv_lora_rank
    g = torch.Generator().manual_seed(T)
    q = torch.randn(B, T, H, Dn + Dr, generator=g, requires_grad=True)
    ckv = torch.randn(B, T, C, generator=g, requires_grad=True)
    kpe = torch.randn(B, T, Dr, generator=g, requires_grad=True)
    w = (torch.randn(H * (Dn + Dv), C, generator=g) / C**0.5).requires_grad_()
    scale = (Dn + Dr) ** -0.5
    mask = attention_mask(T, T)

    def unpadded():
        k, v = expand_kv(ckv, kpe, w, num_heads=H, v_head_dim=Dv)
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale).transpose(1, 2)

    forms = {
        "naive": lambda: mla_attention_naive(q, ckv, kpe, w, v_head_dim=Dv, scale=scale, mask_BTS=mask),
        "sdpa, values as they are": unpadded,
        "openk3": lambda: mla_attention_causal(q, ckv, kpe, w, v_head_dim=Dv, scale=scale),
    }
    with torch.no_grad():  # the three compute one function: a benchmark of a wrong one would mean nothing
        outs = {name: f() for name, f in forms.items()}
    for name, o in outs.items():
        err = (o - outs["naive"]).abs().max().item()
        if err > 1e-4:
            raise RuntimeError(f"{name} differs from the naive form by {err:.2e} at T = {T}")
    return {name: (lambda f=f: f().square().mean().backward()) for name, f in forms.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["nano", "small-kl"])
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    threads = setup_threads(args.threads)
    print(machine_line(threads))
    print(f"causal MLA attention, fp32, B = {args.batch}, fwd + bwd, median of {args.repeats} (alternated)")
    result: dict = {"batch": args.batch, "threads": threads, "runs": []}
    for name in args.presets:
        cfg = preset(name)
        print(f"\n{name}: {cfg.num_attention_heads} heads, q/k {cfg.qk_nope_head_dim + cfg.qk_rope_head_dim}, "
              f"v {cfg.v_head_dim}, latent {cfg.kv_lora_rank}")
        for T in [int(x) for x in args.lengths.split(",")]:
            times = time_interleaved(contenders(cfg, args.batch, T), repeats=args.repeats)
            ms = {k: 1e3 * median(v) for k, v in times.items()}
            line = "  ".join(f"{k} {v:8.1f} ms ({v / ms['openk3']:.2f}x)" for k, v in ms.items() if k != "openk3")
            print(f"  T {T:5d}  openk3 {ms['openk3']:8.1f} ms   {line}")
            result["runs"].append({"preset": name, "T": T, "ms": ms})
    return write_json(args.json, result)


if __name__ == "__main__":
    main()
