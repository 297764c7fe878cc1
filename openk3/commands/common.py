"""Arguments shared by commands that need a model config."""

from __future__ import annotations

import argparse

from openk3.config import PRESETS, K3Config, preset


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", default=None,
                   help=f"named config: {', '.join(PRESETS)} (append -kl for the Kimi-Linear form)")
    g.add_argument("--config", default=None, help="a config.json (kimi_k3 wrapper or bare kimi_linear)")


def config_from_args(args: argparse.Namespace, default: str = "nano") -> tuple[K3Config, str]:
    if args.config:
        return K3Config.from_json(args.config), args.config
    name = args.preset or default
    return preset(name), name
