"""`openk3 train [--config FILE] [--preset P] --out DIR [--max-steps N] [--data SOURCE] [key=value ...]`.

Pretrains a model from scratch on the built-in corpus (default) or text files, with Per-Head Muon +
AdamW, warmup + cosine, Quantile Balancing; logs metrics.jsonl and loss.png, saves release-format
checkpoints, and resumes automatically from the latest one in DIR. The config is built in layers:
a base -- `--config FILE` (a train_config.json, e.g. a previous run's, or any JSON object with the
same sections); else, when DIR holds a run to resume, DIR/train_config.json; else the `TrainConfig`
defaults -- then `--preset` (replaces the model section), then the flags, then `key=value`
overrides, which reach every field of the run config (`openk3.train.config.TrainConfig`): loop fields
(`batch_size=4`), and the sections `model.*`, `optim.*`, `data.*` (`optim.lr=1e-3`,
`model.hidden_size=64`, `data.max_bytes=300000`). Overrides may sit anywhere among the flags. So
`openk3 train --out RUN` resumes RUN as it was, and a resume refuses only the maths changes given
here. The resolved config is printed and written to DIR/train_config.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from openk3.commands.common import add_resume_arguments
from openk3.config import PRESETS

SMALL_MODEL_LR = {"nano": 3e-3, "small": 2e-3}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help="start from this train config JSON (e.g. a run's train_config.json); flags and "
                        "key=value overrides apply on top")
    p.add_argument("--preset", default=None,
                   help=f"model preset: {', '.join(PRESETS)} (append -kl for the Kimi-Linear form), or a "
                        "scaling-lab family at a width, FAMILY@WIDTH[xLAYERS] (e.g. k2-style@64: its training options "
                        "too, e.g. balance=sign); default nano, or the --config file's / the resumed run's model")
    p.add_argument("--out", required=True, help="run folder (created; resumed from if it holds checkpoints)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: the config's 1000)")
    p.add_argument("--data", default=None,
                   help="'builtin' (the stdlib corpus, default) or comma-separated .txt/.jsonl/.parquet "
                        "files or folders")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: train one into OUT/tokenizer)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: $OPENK3_THREADS or $OMP_NUM_THREADS, else auto: all CPUs or one, "
                        "whichever trains faster, measured every 200 steps; the choice is printed)")
    p.add_argument("--device", default=None, help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default=None, help="fp32/float32 (default) or bf16/bfloat16 (autocast)")
    add_resume_arguments(p, history_file="train_config_history.jsonl (docs/training.md)",
                         maths="(optim.*, model.*, data.*, batch_size, seq_len, seed, ...) ")
    # key=value overrides may sit anywhere among the flags: `openk3.__main__.parse_args` collects the later ones
    p.add_argument("--dry-run", action="store_true",
                   help="print the layout this launch would get (mesh, each rank's rows, memory per rank, experts) "
                        "and exit; the world size is the product of the parallel.* degrees")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optim.lr=1e-3")


def run_config(args: argparse.Namespace) -> Path | None:
    """`OUT/train_config.json` when this command resumes the run in --out (no --config; OUT holds a
    checkpoint and its config), else None."""
    from openk3.checkpoint.runs import has_checkpoint

    if args.config is not None or not args.resume:
        return None
    path = Path(args.out) / "train_config.json"
    return path if path.is_file() and has_checkpoint(args.out) else None


def build_config(args: argparse.Namespace):
    """The TrainConfig the arguments describe: a base (--config FILE; else, when --out holds a run to
    resume, that run's train_config.json; else the defaults), then --preset, the flags and the key=value
    overrides. Only what the command line gives is layered on the base, so `openk3 train --out RUN`
    resumes RUN as it was, and a resume compares only what the user changed."""
    import dataclasses

    from openk3.commands.common import model_preset
    from openk3.train.config import TrainConfig, apply_overrides

    base = args.config if args.config is not None else run_config(args)
    if base is not None:
        cfg = TrainConfig.from_json(base)
    else:
        cfg = TrainConfig(model=model_preset(args.preset or "nano")[0], preset=args.preset or "nano")
    changes = {}
    family_overrides: list[str] = []
    if args.preset is not None:
        changes["model"], family = model_preset(args.preset)
        changes["preset"] = args.preset
        # the family's own training options (k2-style: balance=sign), before the user's overrides, which win
        family_overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in family.items()]
    name = (args.preset or ("nano" if base is None else "")).removesuffix("-kl")
    if "@" in name:  # scaling-lab families are nano-sized or a little larger
        name = "nano"
    if base is None and name in SMALL_MODEL_LR:
        # Muon's default lr (2e-4) is a large-model value; these widths learn ~2x faster per step at 3e-3
        # (nano, 40 steps: 4.1 vs 8.4 bits/byte). `optim.lr=...` still overrides; a --config file's or
        # a resumed run's lr is that config's choice and is kept.
        changes["optim"] = dataclasses.replace(cfg.optim, lr=SMALL_MODEL_LR[name])
    if args.max_steps is not None:
        changes["max_steps"] = args.max_steps
    if args.tokenizer is not None:
        changes["tokenizer"] = args.tokenizer
    if args.threads is not None:
        changes["threads"] = args.threads
    if args.device is not None:
        changes["device"] = args.device
    if args.dtype is not None:
        changes["dtype"] = args.dtype
    if args.data is not None:
        changes["data"] = dataclasses.replace(cfg.data, source=args.data)
    from openk3.parallel.mesh import ParallelConfig, world_from_env

    world = world_from_env()[0]
    if cfg.parallel.world_size != world and \
            not any(o.split("=", 1)[0].strip().startswith("parallel.") for o in args.overrides):
        # The degrees describe a launch, not the run: a base config (a --config file, or the run resumed) made
        # for another number of processes gets every process torchrun started as a shard (FSDP2), so a run
        # resumes on any world size and `torchrun -m openk3 train` needs no override; degrees that fit this
        # world (an HSDP layout in a --config file) are kept
        changes["parallel"] = ParallelConfig(dp_shard=world)
    cfg = apply_overrides(dataclasses.replace(cfg, **changes), family_overrides + list(args.overrides))
    par = cfg.parallel
    others = par.dp_replicate * par.pp * par.cp
    if par.world_size != world and world % others == 0 and \
            not any(o.split("=", 1)[0].strip() == "parallel.dp_shard" for o in args.overrides):
        # other degrees given without dp_shard (`parallel.ep=2` under a 2-process torchrun): the processes
        # left over are the shards
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(par, dp_shard=world // others))
    return cfg


def main(args: argparse.Namespace) -> int:
    from openk3.common import resolve_device
    from openk3.train.trainer import train

    cfg = build_config(args)
    quiet = os.environ.get("RANK", "0") != "0"  # under torchrun rank 0 speaks for the run
    if args.dry_run:
        from openk3.parallel.layout import describe

        print(describe(cfg), flush=True)
        return 0
    if (base := run_config(args)) is not None and not quiet:
        print(f"[train] resuming {args.out}: its {base.name} is the base config; only the options given here "
              "change it", flush=True)
    resolve_device(cfg.device)  # refuse a missing device before printing the config (train checks it too)
    if not quiet:
        print("[train] config: " + json.dumps(cfg.to_dict(), indent=2), flush=True)
    summary = train(cfg, args.out, resume=args.resume, progress=args.progress,
                    allow_config_change=args.allow_config_change)
    if not quiet:
        print(f"[train] validation bits per byte: {summary['val_bpb']:.4f} (loss {summary['val_loss']:.4f}); "
              f"checkpoint {summary['checkpoint']}")
    return 0
