"""How a training step scales with sequence length: KDA layers are linear in T, MLA layers quadratic.

Times forward+backward of a whole model at several sequence lengths with the same number of tokens per
step (B * T constant), and the KDA and MLA token mixers alone on their real inputs, then prints time
per token relative to the shortest length. Linear-time parts stay flat; quadratic ones grow with T.

    python benchmarks/bench_seqlen.py                         # small preset (K3 form), 4096 tokens per step
    python benchmarks/bench_seqlen.py --lengths 256,512,1024,2048,4096 --tokens 8192
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_line, median, setup_threads, time_repeats  # noqa: E402

from openk3.config import preset  # noqa: E402
from openk3.model.kda import KimiDeltaAttention  # noqa: E402
from openk3.model.mla import GatedMLA  # noqa: E402
from openk3.model.model import K3ForCausalLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per step (B = tokens // T)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    threads = setup_threads(args.threads)
    cfg = preset(args.preset)
    model = K3ForCausalLM.build(cfg, dtype=torch.float32, seed=0)
    kda = next(layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, KimiDeltaAttention))
    mla = next(layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, GatedMLA))
    print(machine_line(threads))
    print(f"preset {args.preset}, fp32, {args.tokens} tokens per step, fwd+bwd, median of {args.repeats}")
    print(f"{'T':>6} {'B':>4} {'step ms':>9} {'us/token':>9} {'KDA layer us/tok':>17} {'MLA layer us/tok':>17}")
    base = None
    for T in [int(x) for x in args.lengths.split(",")]:
        B = max(1, args.tokens // T)
        ids = torch.randint(0, cfg.vocab_size, (B, T + 1))
        x = torch.randn(B, T, cfg.hidden_size, requires_grad=True)

        def step(ids=ids):
            logits = model(ids[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()

        def mixer(layer, x=x):
            return lambda: layer(x)[0].square().mean().backward()

        t_step = median(time_repeats(step, repeats=args.repeats))
        t_kda = median(time_repeats(mixer(kda), repeats=args.repeats))
        t_mla = median(time_repeats(mixer(mla), repeats=args.repeats))
        n = B * T
        row = (1e6 * t_step / n, 1e6 * t_kda / n, 1e6 * t_mla / n)
        base = base or row
        print(f"{T:>6} {B:>4} {1e3 * t_step:>9.1f} {row[0]:>6.1f} ({row[0] / base[0]:.2f}x) "
              f"{row[1]:>9.2f} ({row[1] / base[1]:.2f}x) {row[2]:>9.2f} ({row[2] / base[2]:.2f}x)")


if __name__ == "__main__":
    main()
