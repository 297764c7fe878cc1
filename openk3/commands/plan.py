"""`openk3 plan`: memory, devices, speed and cost of serving and training a config on real hardware.

    openk3 plan                                    # K3 as released on H200, 128K context, 1 sequence
    openk3 plan --hardware b300 --concurrency 64 --context 8192 --plot mem.png
    openk3 plan --preset k2 --expert-format int4   # Kimi K2 for comparison
    openk3 plan --audit                            # circulating claims, recomputed
    openk3 plan --audit --evidence runs/exp/k3-vs-k2 runs/exp/attnres   # + the measured multipliers
    openk3 plan --list-hardware                    # the catalogue with its sources
    openk3 plan --experts-on disk --disk-gbps 7 --ram 64GB   # one machine, experts streamed from NVMe

Imports no torch: the whole plan is arithmetic over the config (see openk3/plan/); matplotlib is imported
only to draw --plot.
"""

from __future__ import annotations

import argparse
import json
import os

from openk3.plan.formats import STATE_FORMATS, WEIGHT_FORMATS


def add_arguments(p: argparse.ArgumentParser) -> None:
    from openk3.plan import hardware, models

    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", default=None,
                   help=f"named config: {', '.join(models.PLAN_PRESETS)} (append -kl for the Kimi-Linear form); "
                        "default k3")
    g.add_argument("--config", default=None, help="a config.json (kimi_k3 wrapper or bare kimi_linear)")
    p.add_argument("--set", dest="overrides", action="append", metavar="FIELD=VALUE",
                   help="override a config field (repeatable), e.g. --set num_experts=448")
    p.add_argument("--hardware", default="h200", help=f"device: {', '.join(hardware.CATALOGUE)} (default h200)")
    p.add_argument("--devices", type=int, default=None, help="use this many devices (default: the fewest that fit)")
    p.add_argument("--context", type=int, default=131072, help="tokens per sequence (default 131072)")
    p.add_argument("--concurrency", type=int, default=1, help="sequences decoding at once (default 1)")
    formats = sorted(WEIGHT_FORMATS)
    p.add_argument("--expert-format", default=None, choices=formats,
                   help="routed experts (default: the release's, mxfp4 for K3, fp8 for K2)")
    p.add_argument("--trunk-format", default=None, choices=formats,
                   help="non-routed matrices (default: the release's, bf16 for K3, fp8 for K2)")
    p.add_argument("--embedding-format", default=None, choices=formats, help="embedding and lm_head (default bf16)")
    p.add_argument("--kda-state", default="fp32", choices=sorted(STATE_FORMATS), help="KDA recurrent state")
    p.add_argument("--mla-cache", default="bf16", choices=sorted(STATE_FORMATS), help="MLA latent cache")
    p.add_argument("--attention", default="tp", choices=("tp", "dp"),
                   help="tensor-parallel attention (MLA cache on every TP rank) or data-parallel attention")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per prefill forward")
    p.add_argument("--usable", type=float, default=0.9, help="share of device memory for the model (default 0.9)")
    p.add_argument("--mbu", type=float, default=1.0, help="achieved share of peak bandwidth (default 1 = roofline)")
    p.add_argument("--mfu", type=float, default=1.0, help="achieved share of peak FLOP/s when serving")
    t = p.add_argument_group("training")
    t.add_argument("--train-tokens", type=float, default=1e12, help="pretraining tokens (default 1e12)")
    t.add_argument("--seq-len", type=int, default=8192, help="training sequence length")
    t.add_argument("--train-mfu", type=float, default=0.4, help="training MFU (default 0.4)")
    t.add_argument("--train-precision", default="bf16", choices=("bf16", "fp8"))
    t.add_argument("--optimizer", default="muon", choices=("muon", "adamw"))
    t.add_argument("--train-gpus", type=int, default=None, help="GPUs (default: the fewest that fit)")
    t.add_argument("--micro-batch-tokens", type=int, default=None, help="tokens per GPU per micro-step")
    d = p.add_argument_group("experts on disk (--experts-on disk: one machine, openk3.stream)")
    d.add_argument("--experts-on", default="memory", choices=("memory", "disk"),
                   help="disk: plan one machine that reads the routed experts from NVMe into a per-layer cache")
    d.add_argument("--disk-gbps", type=float, default=7.0, help="GB/s of expert-sized reads (default 7: PCIe 4 NVMe)")
    d.add_argument("--ram", default="64GB", help="the machine's RAM (default 64GB)")
    d.add_argument("--expert-cache", default=None, metavar="SIZE",
                   help="expert cache (default: the RAM the resident set leaves)")
    d.add_argument("--hit-rate", type=float, default=None,
                   help="share of expert requests the cache serves (default: K3's measured curve by slots/layer)")
    d.add_argument("--host-gbps", type=float, default=60.0, help="DRAM GB/s the CPU reads weights at (default 60)")
    d.add_argument("--cpu-gflops", type=float, default=1500.0, help="CPU matmul GFLOP/s for prefill (default 1500)")
    d.add_argument("--gpu", default=None, metavar="HW", help="a GPU of the catalogue holding the trunk (optional)")
    d.add_argument("--trunk-group", type=int, default=32, choices=(32, 64, 128, 256),
                   help="int4 group size of the trunk (default 32; larger groups hold less, docs/inference.md)")
    p.add_argument("--audit", action="store_true", help="recompute circulating K3 claims instead of planning")
    p.add_argument("--evidence", nargs="+", default=None, metavar="DIR",
                   help="with --audit: scaling-lab results (result.json or its folder) whose measured compute "
                        "multipliers are cited beside the published ones")
    p.add_argument("--list-hardware", action="store_true", help="print the hardware catalogue with sources")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw the plan's memory against context (stacked by component) into this PNG file")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def main(args: argparse.Namespace) -> int:
    from openk3.plan import ServeSpec, TrainSpec, audit, hardware, models, plan, report

    if args.evidence and not args.audit:
        raise ValueError("--evidence goes with --audit")
    if args.audit:
        items = audit.audit() + (audit.evidence(args.evidence) if args.evidence else [])
        print(json.dumps(items, indent=2) if args.json else report.audit_text(items), end="\n" if args.json else "")
        return 0
    if args.list_hardware:
        if args.json:
            import dataclasses

            print(json.dumps([dataclasses.asdict(h) for h in hardware.CATALOGUE.values()], indent=2))
        else:
            print(hardware.markdown_table())
        return 0
    if args.plot:  # fail before planning, naming the flag (the writer would report "<path>.tmp")
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder) or os.path.isdir(args.plot):
            raise ValueError(f"--plot {args.plot}: " + ("is a directory" if os.path.isdir(args.plot)
                                                       else f"directory {folder} does not exist"))
    cfg, name = models.resolve(args.preset, args.config, args.overrides)
    if args.experts_on == "disk":
        return _disk(args, cfg, name)
    fmts = models.release_formats(args.preset or ("k3" if not args.config else ""))
    for role in ("expert", "trunk", "embedding"):
        if getattr(args, f"{role}_format") is not None:
            fmts[f"{role}_format"] = getattr(args, f"{role}_format")
    spec = ServeSpec(context=args.context, concurrency=args.concurrency, **fmts,
                     kda_state_format=args.kda_state, mla_cache_format=args.mla_cache, attention=args.attention,
                     prefill_chunk=args.prefill_chunk, usable_memory=args.usable, devices=args.devices,
                     mbu=args.mbu, mfu=args.mfu)
    tspec = TrainSpec(tokens=args.train_tokens, seq_len=args.seq_len, mfu=args.train_mfu,
                      precision=args.train_precision, optimizer=args.optimizer, gpus=args.train_gpus,
                      micro_batch_tokens=args.micro_batch_tokens, usable_memory=args.usable)
    result = plan(cfg, hardware_key=args.hardware, serve_spec=spec, train_spec=tspec, name=name)
    if args.plot:
        try:
            report.plot_memory(result, cfg, hardware.get(args.hardware), spec, args.plot)
        except OSError as e:  # e.g. a read-only folder: one line, not a traceback
            raise ValueError(f"--plot {args.plot}: cannot write it ({e.strerror or e})") from None
    print(json.dumps(result, indent=2) if args.json else report.text(result), end="\n" if args.json else "")
    if args.plot and not args.json:
        print(f"wrote {args.plot}")
    return 0


def _disk(args: argparse.Namespace, cfg, name: str) -> int:
    """--experts-on disk: `openk3.plan.stream`."""
    from openk3.config_types import parse_bytes
    from openk3.plan import hardware
    from openk3.plan.stream import DiskSpec, plan_disk, text

    def gb(value: str, what: str) -> int:  # a bare number is GB here
        return parse_bytes(value, what, bare_unit=10**9)

    spec = DiskSpec(disk_gbps=args.disk_gbps, ram_bytes=gb(args.ram, "--ram"),
                    trunk_format=args.trunk_format or "int4", trunk_group=args.trunk_group,
                    cache_bytes=gb(args.expert_cache, "--expert-cache") if args.expert_cache else None,
                    hit_rate=args.hit_rate, host_gbps=args.host_gbps, cpu_gflops=args.cpu_gflops,
                    context=args.context, gpu=hardware.get(args.gpu) if args.gpu else None)
    result = plan_disk(cfg, spec)
    print(json.dumps(result, indent=2) if args.json else text(result, name), end="\n" if args.json else "")
    return 0
