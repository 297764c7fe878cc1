"""Arguments and input helpers shared by commands."""

from __future__ import annotations

import argparse
import sys

from openk3.config import PRESETS, K3Config, preset


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", default=None,
                   help=f"named config: {', '.join(PRESETS)} (append -kl for the Kimi-Linear form)")
    g.add_argument("--config", default=None, help="a config.json (kimi_k3 wrapper or bare kimi_linear)")


def parse_dtype(value: str):
    """`--dtype` through `openk3.common.resolve_dtype` (its table is the one list of spellings): a torch
    dtype, or None for "auto". A spelling it does not know is an argparse error naming the value."""
    from openk3.common import resolve_dtype

    try:
        return resolve_dtype(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_dtype_argument(p: argparse.ArgumentParser, default: str, what: str) -> None:
    """`--dtype` (generate, chat, convert): auto, bf16/bfloat16, fp32/float32, fp16/float16, fp64/float64."""
    p.add_argument("--dtype", type=parse_dtype, default=default, metavar="DTYPE",
                   help=f"{what}: auto, bf16 (bfloat16), fp32 (float32), fp16 (float16) or fp64 (float64); "
                        f"default {default}")


def config_from_args(args: argparse.Namespace, default: str = "nano") -> tuple[K3Config, str]:
    if args.config:
        return K3Config.from_json(args.config), args.config
    name = args.preset or default
    return preset(name), name


def read_text_input(path: str | None) -> str:
    """The text of `path`, or of stdin when `path` is None or "-"; an unreadable file is a ValueError."""
    try:
        if path is None or path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
