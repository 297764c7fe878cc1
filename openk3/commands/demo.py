"""`openk3 demo`: build a K3-architecture model, train it for a few steps on a repeating pattern,
then decode with the cache and check the cached decode against full forwards.

A quick smoke test of the architecture (no tokenizer, no corpus, nothing saved): it exercises every
part of the model end to end on CPU in well under a minute for the `nano` preset. Real pretraining is
`openk3 train` (README: the main job).
"""

from __future__ import annotations

import argparse
import time

from openk3.commands.common import add_model_arguments, config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=30, help="training steps on the toy pattern")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=24, help="tokens to decode with the cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: $OPENK3_THREADS, else 1 on machines with <= 2 CPUs)")


def main(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from openk3.common import seed_everything, setup_cpu
    from openk3.model.accounting import count_params, flops_per_token
    from openk3.model.model import K3ForCausalLM

    threads = setup_cpu(args.threads)
    cfg, name = config_from_args(args)
    if args.seq_len < 2 or args.batch < 1 or args.steps < 0 or args.new_tokens < 1:
        raise ValueError("--seq-len >= 2, --batch >= 1, --steps >= 0 and --new-tokens >= 1 are required")
    gen = seed_everything(args.seed)
    model = K3ForCausalLM.build(cfg, seed=args.seed)
    counts = count_params(model)
    print(f"[demo] preset {name}: {counts.total:,} parameters, {counts.active:,} active per token; "
          f"{cfg.num_hidden_layers} layers, MLA at 0-idx {cfg.mla_layers}; {threads} thread(s)")

    # A learnable toy task: each row counts upward from a random start (mod vocab).
    V, T, B = cfg.vocab_size, args.seq_len, args.batch
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    fpt = flops_per_token(model, T, training=True)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        start = torch.randint(0, V, (B, 1), generator=gen)
        ids = (start + torch.arange(T + 1)) % V
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 1 or step % 10 == 0 or step == args.steps:
            dt = time.perf_counter() - t0
            tps = step * B * T / dt
            print(f"[demo] step {step:4d}  loss {loss.item():.4f}  {tps:,.0f} tok/s  "
                  f"{tps * fpt / 1e9:.1f} GFLOP/s")

    model.eval()
    prompt = (torch.randint(0, V, (1, 1), generator=gen) + torch.arange(8)) % V
    with torch.no_grad():
        cache = model.new_cache()
        logits = model(prompt, cache=cache)
        out = prompt
        t1 = time.perf_counter()
        for _ in range(args.new_tokens):
            nxt = logits[:, -1:].argmax(-1)
            out = torch.cat([out, nxt], dim=1)
            logits = model(nxt, cache=cache)
        dt = time.perf_counter() - t1
        full = model(out).argmax(-1)[:, prompt.shape[1] - 1:-1]
    agree = (full == out[:, prompt.shape[1]:]).float().mean().item()
    state = cache.nbytes()
    print(f"[demo] prompt   {prompt[0].tolist()}")
    print(f"[demo] decoded  {out[0, prompt.shape[1]:].tolist()}")
    print(f"[demo] cached decode {args.new_tokens / dt:,.1f} tok/s; agrees with full forwards on "
          f"{agree:.0%} of tokens; KDA state {state['kda_state']:,} B (constant), MLA cache {state['mla_cache']:,} B")
    return 0
