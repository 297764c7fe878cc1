"""The quality gate of the integer trunks: teacher-forced logits of each trunk format against the bf16 model, on
held-out real text, with a trained openk3 checkpoint; plus the same arithmetic on a release-shaped checkpoint.

    openk3 train --preset nano --out runs/nano --max-steps 480
    python benchmarks/bench_trunk_quality.py runs/nano [--docs 64] [--tokens 256] [--json out.json]
    python benchmarks/bench_trunk_quality.py --release-shaped /data/k3synth   # scripts/synth_release.py output

The reference is the checkpoint with its floating weights rounded to bf16 (the release's trunk dtype; fp32
islands kept), computed in float32. Each arm quantises that model's trunk (`openk3.quant.trunk`): int8
everywhere; int4 with the default promotions (groups of 32, 64, 128 inputs); int4 everywhere; and int4 on one
group at a time with the rest bf16 (which group int4 hurts). Text: the built-in corpus' validation split (the
training run's own held-out 1 %, by hash: 8 long documents), cut into `--docs` non-overlapping windows of
`--tokens` tokens. Per arm, over every predicted token: KL(ref || arm) in nats, top-1 agreement with the
reference, and the arm's bits/byte minus the reference's; 95 % intervals by bootstrap over windows (a window's
tokens move together; `openk3.stats.mean_ci`).

`--release-shaped DIR`: K3's real widths with random weights (they say nothing about quality): the bytes each
format holds against the planner's per-parameter figures, and the relative error of the logits, to check the
arithmetic at full width.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import setup_threads  # noqa: E402


def held_out_docs(tokenizer, n: int, tokens: int, val_fraction: float = 0.01, min_tokens: int = 64):
    """[(ids, bytes per predicted token)] of the first `n` windows of `tokens` tokens (non-overlapping, the last
    one of a document kept if >= `min_tokens`) of the validation documents (the built-in corpus' held-out 1 %: 8
    long documents, so windows, not documents, are the unit the intervals resample)."""
    from openk3.data.corpus import iter_documents
    from openk3.data.shards import _is_val, token_byte_lengths

    nbytes = token_byte_lengths(tokenizer)
    out = []
    for doc in iter_documents():
        if not _is_val(doc.text, val_fraction)[0]:
            continue
        ids = tokenizer.encode(doc.text)
        for i in range(0, len(ids), tokens):
            w = ids[i:i + tokens]
            if len(w) >= min_tokens:
                out.append((w, [int(nbytes[t]) for t in w[1:]]))
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} held-out windows of >= {min_tokens} tokens")


def bf16_reference(path):
    from openk3.checkpoint import load

    model = load(path, dtype=torch.bfloat16)  # islands stay fp32, as released
    return model.cast(torch.float32).eval()


@torch.inference_mode()
def per_token(model, docs) -> list[torch.Tensor]:
    """Log-probabilities [T-1, V] (float64) of each document's next tokens."""
    return [torch.log_softmax(model(torch.tensor([ids]))[0, :-1].double(), -1) for ids, _ in docs]


def compare(ref_lp, arm_lp, docs) -> dict:
    from openk3.stats import mean_ci

    kl, agree, dce, groups = [], [], [], []
    total_bytes = sum(sum(b) for _, b in docs)
    total_tokens = sum(len(b) for _, b in docs)
    for d, ((ids, _), r, a) in enumerate(zip(docs, ref_lp, arm_lp, strict=True)):
        tgt = torch.tensor(ids[1:])
        kl += (r.exp() * (r - a)).sum(-1).tolist()
        agree += (r.argmax(-1) == a.argmax(-1)).double().tolist()
        dce += (r.gather(1, tgt[:, None])[:, 0] - a.gather(1, tgt[:, None])[:, 0]).tolist()  # CE(arm) - CE(ref)
        groups += [d] * len(tgt)
    to_bpb = total_tokens / total_bytes / math.log(2)  # mean nats per token -> bits per byte
    out = {}
    for name, vals, scale in (("kl_nats", kl, 1.0), ("top1_agreement", agree, 1.0), ("delta_bpb", dce, to_bpb)):
        lo, hi = mean_ci(vals, groups)
        out[name] = (sum(vals) / len(vals) * scale, lo * scale, hi * scale)
    return out


def bits_per_byte(lp, docs) -> float:
    nats = sum(-float(r.gather(1, torch.tensor(ids[1:])[:, None]).sum()) for r, (ids, _) in zip(lp, docs, strict=True))
    return nats / sum(sum(b) for _, b in docs) / math.log(2)


def arms():
    from openk3.quant.trunk import GROUPS

    yield "int8", "int8", {}
    yield "int4 (lm_head int8, default)", "int4", {}
    yield "int4 group 64 (lm_head int8)", "int4", {"group": 64}
    yield "int4 group 128 (lm_head int8)", "int4", {"group": 128}
    yield "int4 everywhere", "int4", {"promote": ()}
    for g in GROUPS:
        yield f"int4 on {g} only", "int4", {"promote": (), "only": (g,)}


def quality(path: Path, n_docs: int, tokens: int) -> dict:
    from openk3.checkpoint.load import resolve_checkpoint
    from openk3.infer.llm import _load_tokenizer
    from openk3.quant.trunk import quantize_trunk_

    path = resolve_checkpoint(path)  # a run folder: its latest checkpoint (which carries the tokenizer)
    tok = _load_tokenizer(path, "")
    docs = held_out_docs(tok, n_docs, tokens)
    ref = bf16_reference(path)
    ref_lp = per_token(ref, docs)
    rows = {"reference bf16": {"bits_per_byte": bits_per_byte(ref_lp, docs)}}
    for name, fmt, kw in arms():
        model = copy.deepcopy(ref)
        done = quantize_trunk_(model, fmt, **kw)
        lp = per_token(model, docs)
        rows[name] = {**compare(ref_lp, lp, docs), "bits_per_byte": bits_per_byte(lp, docs),
                      "int4_linears": sum(v == "int4" for v in done.values()),
                      "int8_linears": sum(v == "int8" for v in done.values())}
        print(_row(name, rows[name]), flush=True)
    return {"checkpoint": str(path), "docs": n_docs, "tokens_per_doc": tokens,
            "predicted_tokens": sum(len(b) for _, b in docs), "bytes": sum(sum(b) for _, b in docs), "arms": rows}


def _row(name: str, r: dict) -> str:
    f = lambda t, p: f"{t[0]:.{p}f} [{t[1]:.{p}f}, {t[2]:.{p}f}]"  # noqa: E731
    return (f"| {name} | {f(r['kl_nats'], 5)} | {f(r['top1_agreement'], 4)} | {f(r['delta_bpb'], 4)} | "
            f"{r['bits_per_byte']:.4f} |")


def release_shaped(path: Path, tokens: int) -> dict:
    """Full-width arithmetic: trunk bytes per format against the planner, logits' relative error vs bf16 weights."""
    from openk3.checkpoint import load
    from openk3.plan.stream import trunk_bytes
    from openk3.quant import trunk as tq

    ids = torch.randint(3, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.inference_mode():
        ref = load(path, dtype=torch.float32, experts="stream", expert_cache="2GB")
        linear_params = sum(m.weight.numel() for n, m in ref.named_modules()
                            if type(m) is torch.nn.Linear and tq.group_of(n, ref) is not None)
        want = ref(ids).double()
        del ref
        for fmt in ("int8", "int4"):
            model = load(path, dtype=torch.float32, experts="stream", expert_cache="2GB", trunk=fmt)
            got = model(ids).double()
            held = tq.nbytes(model)
            out[fmt] = {"linear_params": linear_params, "bytes": held, "bytes_per_param": held / linear_params,
                        "planner_bytes_per_param": trunk_bytes(fmt),
                        "logits_rel_error": float((got - want).norm() / want.norm())}
            print(f"{fmt}: {held / 1e9:.3f} GB for {linear_params / 1e9:.3f} B linear weights "
                  f"({held / linear_params:.4f} B/param; planner {trunk_bytes(fmt):.4f}); "
                  f"logits rel. error {out[fmt]['logits_rel_error']:.4f}", flush=True)
            del model
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, nargs="?")
    p.add_argument("--docs", type=int, default=64, help="windows of held-out text (default 64)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--release-shaped", type=Path, default=None, metavar="DIR")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import os

    setup_threads(args.threads or os.cpu_count() or 1)
    result = {}
    if args.checkpoint is not None:
        print("| trunk | KL(ref ‖ arm), nats/token [95 % CI] | top-1 agreement | Δ bits/byte | bits/byte |")
        print("|---|---|---|---|---|")
        result["quality"] = quality(args.checkpoint, args.docs, args.tokens)
        print(f"reference bits/byte {result['quality']['arms']['reference bf16']['bits_per_byte']:.4f}")
    if args.release_shaped is not None:
        result["release_shaped"] = release_shaped(args.release_shaped, min(args.tokens, 16))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
