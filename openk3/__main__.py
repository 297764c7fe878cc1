"""The one door in: `openk3 <command>` (or `python -m openk3 <command>`).

Each command lives in `openk3/commands/<name>.py` as `add_arguments(parser)` + `main(args)` and is
imported only when chosen, so `openk3 info` does not pay for what `openk3 demo` needs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "info": "parameter counts, FLOPs and decode-state sizes of a config",
    "train": "pretrain a K3 model (built-in corpus or your data), resumable, with metrics and samples",
    "demo": "build a model, run it, and decode with the cache (the main job until pretraining lands)",
    "convert": "rewrite a checkpoint: routed experts bf16 <-> MXFP4, kimi_k3 wrapper <-> bare config",
    "tokenizer": "train a small tiktoken-format tokenizer with K3's special tokens",
    "template": "render an OpenAI-style chat request (stdin JSON) in the XTML chat format",
    "parse": "parse a generated completion (stdin) into reasoning, content and tool calls",
    "generate": "continue text prompts with a checkpoint (streams one prompt; batches several)",
    "chat": "chat with a checkpoint in the XTML format: thinking, multi-turn, tool calls (stdin lines)",
    "plan": "memory, devices, speed and $ of serving/training a config on real hardware; --audit of K3 claims",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openk3", description="Kimi K3, open and end to end.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"openk3.commands.{name}").add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(f"openk3.commands.{args.command}")
    try:
        return module.main(args) or 0
    except (ValueError, FileNotFoundError) as e:  # user errors: one clear line, no traceback
        print(f"openk3 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
