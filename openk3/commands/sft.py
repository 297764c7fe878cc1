"""`openk3 sft --model BASE --data FILE[,FILE] --out DIR [--max-steps N] [--epochs E] [key=value ...]`.

Supervised fine-tuning of a release-format checkpoint (or a run folder's latest) on JSONL conversations
-- post-training records or plain OpenAI chat lines -- with the loss on the assistant channels only
(`openk3.posttrain.trainers.sft`). Writes checkpoints, metrics.jsonl and loss.png into DIR the way `openk3 train`
does, and resumes from DIR's latest checkpoint. The config is built in layers: DIR/sft_config.json when
DIR holds a run to resume (so `openk3 sft --out DIR` continues it as it was), else the `SFTConfig`
defaults; then the flags; then `key=value` overrides of any `SFTConfig` field (`overflow=truncate`,
`warmup=10`, `optim.weight_decay=0`, `splits=[train,test]`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from openk3.commands.common import add_resume_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="BASE",
                   help="the model to fine-tune: a checkpoint folder (with its tokenizer) or a training run folder "
                        "(its latest checkpoint); required unless --out holds a run to resume")
    p.add_argument("--data", default=None, metavar="FILE[,FILE]",
                   help="comma-separated JSONL files: post-training records or OpenAI chat lines ({\"messages\", "
                        "\"tools\"?, \"thinking_effort\"?}); required unless --out holds a run to resume")
    p.add_argument("--val", default=None, metavar="FILE[,FILE]",
                   help="JSONL files whose assistant-token loss is evaluated (every eval_every steps and at the end)")
    p.add_argument("--out", required=True, help="run folder (created; resumed from if it holds checkpoints)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: --epochs passes)")
    p.add_argument("--epochs", type=int, default=None, help="passes over the data when --max-steps is not given "
                                                             "(default 2)")
    p.add_argument("--batch-size", type=int, default=None, help="packed rows per step (default 8)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per row (default 1024); longer conversations are dropped and counted "
                        "(overflow=truncate keeps their start)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate of Muon and AdamW (default 2e-4)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: $OPENK3_THREADS, else 1 on machines with <= 2 CPUs)")
    p.add_argument("--device", default=None, help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default=None, help="fp32 (default) or bf16 (autocast)")
    add_resume_arguments(p, history_file="sft_config_history.jsonl")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="SFT config overrides, e.g. overflow=truncate optim.weight_decay=0")


def _files(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def run_config(args: argparse.Namespace) -> Path | None:
    """OUT/sft_config.json when this command resumes the run in --out, else None."""
    from openk3.checkpoint.runs import has_checkpoint

    path = Path(args.out) / "sft_config.json"
    return path if args.resume and path.is_file() and has_checkpoint(args.out) else None


def build_config(args: argparse.Namespace):
    """The SFTConfig the arguments describe (module docstring)."""
    from openk3.posttrain.trainers.sft import SFTConfig, apply_overrides

    base = run_config(args)
    cfg = SFTConfig.from_run(base) if base is not None else SFTConfig()
    changes: dict = {}
    for flag, name in (("max_steps", "max_steps"), ("epochs", "epochs"), ("batch_size", "batch_size"),
                       ("seq_len", "seq_len"), ("threads", "threads"), ("device", "device")):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    if args.dtype is not None:
        changes["dtype"] = {"bfloat16": "bf16", "float32": "fp32"}.get(args.dtype, args.dtype)
    if args.model is not None:
        changes["base"] = args.model
    if args.data is not None:
        changes["data"] = _files(args.data)
    if args.val is not None:
        changes["val_data"] = _files(args.val)
    if args.lr is not None:
        changes["optim"] = dataclasses.replace(cfg.optim, lr=args.lr)
    cfg = dataclasses.replace(cfg, **changes)
    return apply_overrides(cfg, args.overrides)


def main(args: argparse.Namespace) -> int:
    from openk3.common import resolve_device
    from openk3.posttrain.trainers.sft import sft

    cfg = build_config(args)
    if run_config(args) is not None:
        print(f"[sft] resuming {args.out}: its sft_config.json is the base config; only the options given here "
              "change it", flush=True)
    resolve_device(cfg.device)
    print("[sft] config: " + json.dumps(cfg.to_dict(), indent=2), flush=True)
    summary = sft(cfg, args.out, resume=args.resume, progress=args.progress,
                  allow_config_change=args.allow_config_change)
    val = "" if summary["val_loss"] is None else f"validation loss {summary['val_loss']:.4f}; "
    print(f"[sft] {summary['steps']} steps, final train loss {summary['final_loss']:.4f}; {val}"
          f"checkpoint {summary['checkpoint']}")
    return 0
