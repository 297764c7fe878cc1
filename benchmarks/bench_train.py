"""Training throughput (forward + backward tokens/s) of openk3 against transformers' KimiLinear.

Both models hold the same weights (`openk3.peers.to_transformers`), see the same batch and compute the
same loss (cross-entropy of the logits against random labels); the two steps are timed in alternation.
Default: `small-kl` (the `small` preset's shapes in Kimi-Linear form, ~40M parameters, 64 experts top-8),
B=1, T=512, fp32, one thread. `--preset small` times the K3-form preset alone (transformers cannot run it).

    python benchmarks/bench_train.py                       # openk3 vs transformers, small-kl
    python benchmarks/bench_train.py --preset small        # K3 form, MFU only
    python benchmarks/bench_train.py --profile             # + where openk3's step spends its time

MFU = tokens/s * `flops_per_token(model, T, training=True)` / (peak per core * threads), with the peaks of
`benchmarks/common.py`. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    DTYPES,
    machine_line,
    median,
    peak_flops,
    setup_threads,
    spread,
    time_interleaved,
    time_repeats,
    write_json,
)

from openk3.config import preset  # noqa: E402
from openk3.model.accounting import count_params, flops_per_token  # noqa: E402
from openk3.model.model import K3ForCausalLM  # noqa: E402


def make_step(forward, params, ids, labels, autocast_dtype=None):
    """One training step minus the optimizer: zero grads, forward, loss, backward (on a GPU: waited for, so the
    timer sees the kernels, and with bf16 as autocast over float32 weights, as `openk3 train dtype=bf16` runs)."""
    cuda = ids.is_cuda

    def step():
        for p in params:
            p.grad = None
        with torch.autocast(ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = forward(ids)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return loss.detach()
    return step


def pick_experts_impl(hf, forward, ids, labels, wanted: str | None) -> str:
    """The requested transformers experts implementation, else the first of grouped_mm / eager that runs."""
    for impl in ([wanted] if wanted else ["grouped_mm", "eager"]):
        try:
            hf.set_experts_implementation(impl)
            make_step(forward, list(hf.parameters()), ids[:, :16], labels[:, :16])()
            return impl
        except Exception as e:  # noqa: BLE001 - report and try the next one
            print(f"transformers experts implementation {impl!r} failed: {type(e).__name__}: {e}")
    raise RuntimeError("no transformers experts implementation works")


# ---- profiling: where does openk3's step go? ------------------------------------------------------------

def _detached(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().clone().requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(y) for y in x)
    return x


def _float_outputs(out):
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (list, tuple)):
        return [t for y in out for t in _float_outputs(y)]
    return []


def _fwd_bwd(fn, args, kwargs):
    def run():
        a, kw = _detached(args), {k: _detached(v) for k, v in kwargs.items()}
        outs = _float_outputs(fn(*a, **kw))
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return run


@contextlib.contextmanager
def _capture_functions(targets, calls):
    """Wrap module-level functions (module, name, label) so their first call per label is recorded."""
    saved = []
    for mod, name, label in targets:
        fn = getattr(mod, name)

        def wrapper(*args, _fn=fn, _label=label, **kwargs):
            calls[_label].append((_fn, _detached(args), {k: _detached(v) for k, v in kwargs.items()}))
            return _fn(*args, **kwargs)
        saved.append((mod, name, fn))
        setattr(mod, name, wrapper)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def module_label(name: str, mod: torch.nn.Module) -> str | None:
    kind = type(mod).__name__
    if kind in ("KimiDeltaAttention", "GatedMLA", "SparseMoE", "ShortConv"):
        return {"KimiDeltaAttention": "KDA layer (all)", "GatedMLA": "MLA layer (all)",
                "SparseMoE": "MoE layer (all)", "ShortConv": "  KDA short conv (q,k,v)"}[kind]
    if kind == "GluMLP":
        return "  MoE shared experts" if name.endswith("shared_experts") else "dense MLP (layer 0)"
    if kind == "RMSNorm":
        if name.endswith(("q_a_layernorm", "kv_a_layernorm")):
            return "  MLA latent norms"
        if name.endswith("routed_expert_norm"):
            return "  MoE latent norm"
        return None if name.endswith("_res_norm") else "RMSNorm (layer + final)"
    if name == "lm_head":
        return "lm_head"
    return None


def profile_openk3(model, ids, labels, step, repeats: int) -> None:
    """Time every component's forward+backward in isolation on the inputs it sees in a real step."""
    from openk3.model import model as model_mod
    from openk3.ops import kda as kda_ops
    from openk3.ops import mla as mla_ops
    from openk3.ops import moe as moe_ops

    calls: dict[str, list] = defaultdict(list)
    hooks = []
    for name, mod in model.named_modules():
        label = module_label(name, mod)
        if label is not None:
            def pre(m, args, kwargs, _label=label):
                calls[_label].append((m, _detached(args), {k: _detached(v) for k, v in kwargs.items()}))
            hooks.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
    targets = [(kda_ops, "kda", "  KDA op (chunked delta rule)"),
               (mla_ops, "mla_attention_causal", "  MLA attention core"),  # fused, or the naive form inside it
               (moe_ops, "route", "  MoE router"), (moe_ops, "experts_grouped", "  MoE routed experts"),
               (model_mod, "attn_res_mix", "AttnRes mix")]
    with _capture_functions(targets, calls):
        model.zero_grad(set_to_none=True)
        logits = model(ids)
        h = logits.detach()
    for hk in hooks:
        hk.remove()
    calls["loss (cross-entropy)"].append(
        (lambda x: F.cross_entropy(x.flatten(0, 1), labels.flatten()), (h.requires_grad_(),), {}))
    # Minimum, not median, of the repeats: on a shared host it is the steadier estimate of the uncontended cost.
    full = min(time_repeats(step, warmup=1, repeats=repeats))
    print(f"\nopenk3 step, components timed alone (fwd+bwd, min of {repeats}, summed over calls); "
          f"full step (min) {1e3 * full:.1f} ms")
    order = ["KDA layer (all)", "  KDA short conv (q,k,v)", "  KDA op (chunked delta rule)", "MLA layer (all)",
             "  MLA attention core", "MoE layer (all)", "  MoE router", "  MoE routed experts", "  MoE shared experts",
             "dense MLP (layer 0)", "RMSNorm (layer + final)", "AttnRes mix", "lm_head", "loss (cross-entropy)"]
    top = 0.0
    for label in order + sorted(set(calls) - set(order)):
        if label not in calls:
            continue
        total = sum(min(time_repeats(_fwd_bwd(fn, a, kw), warmup=1, repeats=repeats)) for fn, a, kw in calls[label])
        if not label.startswith(" "):
            top += total
        print(f"  {label:32s} {len(calls[label]):3d} calls {1e3 * total:8.1f} ms  {100 * total / full:5.1f}%")
    print(f"  {'top-level sum':32s}           {1e3 * top:8.1f} ms  {100 * top / full:5.1f}% "
          f"(rest: residual adds, embedding, autograd overhead)")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    print("\ntorch.profiler, one openk3 step, top ops by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))


# ---- main ------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-kl", help="openk3 preset (default small-kl; 'small' = K3 form)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-peer", action="store_true", help="time openk3 alone")
    ap.add_argument("--hf-experts", default=None, help="transformers experts implementation (default: fastest)")
    ap.add_argument("--profile", action="store_true", help="break openk3's step down by component")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: on a GPU bf16 is autocast over float32 "
                    "weights, and MFU needs --peak-tflops (the transformers peer runs on the CPU only)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's dense matmul peak in the step's dtype, TFLOP/s (on CUDA: for MFU)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)

    threads = setup_threads(args.threads)
    dtype = DTYPES[args.dtype]
    cfg = preset(args.preset)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: this torch has no CUDA device")
        args.no_peer = True  # transformers' KimiLinear would run fla's kernels there: not the reference peer
    torch.manual_seed(0)
    on_gpu = device.type == "cuda"
    # on a GPU: float32 weights and bf16 autocast (training's mixed precision); on the CPU: weights in the dtype
    model = K3ForCausalLM.build(cfg, dtype=torch.float32 if on_gpu else dtype, seed=0, device=device).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(device)
    labels = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(device)
    tokens = args.batch * args.seq
    fpt = flops_per_token(model, args.seq, training=True)
    counts = count_params(model)
    print(f"preset {args.preset}: {counts.total / 1e6:.1f}M params ({counts.active / 1e6:.1f}M active), "
          f"{cfg.num_experts} experts top-{cfg.num_experts_per_token}; B={args.batch} T={args.seq} {args.dtype}")
    if on_gpu:
        peak = None if args.peak_tflops is None else 1e12 * args.peak_tflops
        told = "not given (no MFU)" if peak is None else f"{args.peak_tflops} TFLOP/s"
        print(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}; model FLOPs per token "
              f"(training) {fpt / 1e6:.1f} MFLOP; peak {told}")
    else:
        peak = peak_flops(dtype, threads) if args.peak_tflops is None else 1e12 * args.peak_tflops
        print(machine_line(threads))
        print(f"model FLOPs per token (training) {fpt / 1e6:.1f} MFLOP; peak {args.dtype} "
              f"{1e-9 * peak:.0f} GFLOP/s over {threads} thread(s)")

    fns = {"openk3": make_step(model, list(model.parameters()), ids, labels,
                               autocast_dtype=dtype if on_gpu and dtype != torch.float32 else None)}
    result = {"preset": args.preset, "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "threads": threads,
              "device": args.device, "flops_per_token_training": fpt, "repeats": args.repeats,
              "peak_flops": peak}
    peer = not args.no_peer
    if peer:
        from openk3.peers import check_kimi_linear_form, to_transformers
        try:
            check_kimi_linear_form(cfg)
        except ValueError as e:
            print(f"transformers peer skipped: {e}")
            peer = False
    if peer:
        if dtype != torch.float32:
            raise SystemExit("the transformers comparison runs in fp32 only (use --no-peer for other dtypes)")
        hf = to_transformers(model).train()

        def hf_forward(x):
            return hf(input_ids=x, use_cache=False).logits
        impl = pick_experts_impl(hf, hf_forward, ids, labels, args.hf_experts)
        print(f"transformers: KimiLinearForCausalLM, attn eager, experts implementation {impl!r}, "
              f"KDA/conv through its pure-torch fallbacks")
        fns["transformers"] = make_step(hf_forward, list(hf.parameters()), ids, labels)
        result["transformers_experts_implementation"] = impl
    # The first step of each doubles as warm-up and as a check that both models compute the same loss.
    losses = {name: fn().item() for name, fn in fns.items()}
    print("first-step loss: " + ", ".join(f"{name} {loss:.6f}" for name, loss in losses.items()))
    result["first_step_loss"] = losses
    times = time_interleaved(fns, warmup=max(args.warmup - 1, 0), repeats=args.repeats)
    for name, ts in times.items():
        tps = tokens / median(ts)
        line = f"{name:13s} step {spread(ts)}  {tps:9.1f} tokens/s"
        achieved = None if peak is None else tps * fpt / peak
        line += f"  {tps * fpt / 1e12:.3f} TFLOP/s" + ("" if achieved is None else f"  MFU {100 * achieved:.2f}%")
        print(line)
        result[name] = {"step_s": ts, "tokens_per_s": tps, "model_flops_per_s": tps * fpt, "mfu": achieved}
    if "transformers" in result:
        ratio = result["openk3"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
        result["ratio_openk3_over_transformers"] = ratio
        print(f"ratio openk3 / transformers: {ratio:.2f}x (target >= 5x)")
    if args.profile:
        profile_openk3(model, ids, labels, fns["openk3"], args.repeats)
    return write_json(args.json, result)


if __name__ == "__main__":
    main()
