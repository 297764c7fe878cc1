"""The one door in: `openk3 <command>` (or `python -m openk3 <command>`).

Each command lives in `openk3/commands/<name>.py` as `add_arguments(parser)` + `main(args)` and is
imported only when chosen, so `openk3 info` does not pay for what `openk3 demo` needs.

An expected failure -- a ValueError (bad input, named by the code that found it) or an OSError (a
missing or unreadable file, a full or read-only disk, a file where a folder goes) -- ends the command
with one `openk3 CMD: error: ...` line on stderr and exit code 2. Anything else is a bug and keeps its
traceback; `OPENK3_DEBUG=1` shows the traceback of expected failures too.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import logging
import os
import sys
import warnings
from pathlib import Path

COMMANDS = {
    "info": "parameter counts, FLOPs and decode-state sizes of a config",
    "train": "pretrain a K3 model (built-in corpus or your data), resumable, with metrics and samples",
    "rl": "on-policy RL of one (domain, effort) teacher: engine rollouts, think budgets, kimi/grpo losses, resumable",
    "distill": "multi-teacher on-policy distillation (MOPD) of the (domain, effort) teachers into one student",
    "eval": "evaluate models on every (domain, effort) cell: accuracy, think tokens, compliance; report and plots",
    "sft": "fine-tune a checkpoint on chat JSONL (loss on assistant channels only), resumable, with checkpoints",
    "demo": "quick smoke test: build a model, train it on a counting task, check cached decode against full forwards",
    "convert": "rewrite a checkpoint: routed experts bf16 <-> MXFP4, kimi_k3 wrapper <-> bare config",
    "export": "write a checkpoint for other tools: transformers (hf: auto_map + tokenizer.json) or vLLM (vllm)",
    "tokenizer": "train a small tiktoken-format tokenizer with K3's special tokens",
    "template": "render an OpenAI-style chat request (stdin JSON) in the XTML chat format",
    "parse": "parse a generated completion (stdin) into reasoning, content and tool calls",
    "generate": "continue text prompts with a checkpoint (streams one prompt; batches several)",
    "chat": "chat with a checkpoint in the XTML format: thinking, multi-turn, tool calls (stdin lines)",
    "serve": "OpenAI-compatible HTTP server over a checkpoint: chat and completions, streaming, tool calls",
    "posttrain": "the whole post-training pipeline: SFT, RL teachers per domain x effort, MOPD student, merge, eval",
    "experiment": "run a claim of the project as an experiment with a control: result.json with 95-percent intervals",
    "merge": "merge fine-tuned checkpoints that share a base: linear, task arithmetic, TIES, DARE, Model Stock",
    "plan": "memory, devices, speed and $ of serving/training a config on real hardware; --audit of K3 claims",
}


def version() -> str:
    """The installed distribution's version; openk3.__version__ when openk3 runs from a source tree."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("openk3")
    except PackageNotFoundError:
        import openk3

        return openk3.__version__


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with `only` (a command name) just that command's arguments filled in: a command
    module may import heavy libraries (torch) to describe its defaults, and `openk3 plan` must not pay
    for `openk3 rl`'s. Every command is still listed with its help."""
    parser = argparse.ArgumentParser(prog="openk3", description="Kimi K3, open and end to end.")
    parser.add_argument("--version", action="version", version=f"openk3 {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or name == only:
            importlib.import_module(f"openk3.commands.{name}").add_arguments(p)
    return parser


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one `[openk3] warning: ...` line (the message names the file or field it is about), not
    Python's default of the warning's source path plus a line of openk3's code."""
    print(f"[openk3] warning: {message}", file=sys.stderr if file is None else file, flush=True)


@contextlib.contextmanager
def notes_on_stderr(debug: bool = False):
    """The library's notes and warnings go to stderr as one-line notes while a command runs; the `openk3`
    logger and the warnings machinery are restored after (main() may run many times in one process: tests,
    scripts). `debug` (OPENK3_DEBUG) keeps Python's full warning format."""
    from openk3.log import TaggedLines

    log, handler = logging.getLogger("openk3"), TaggedLines(notes_to_stderr=True)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():  # restores showwarning on exit
            if not debug:
                warnings.showwarning = _warning_line
            yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def describe(e: BaseException) -> str:
    """An expected failure as one line: an OSError as `FILE: reason` (its str is `[Errno N] reason: 'FILE'`),
    naming the file that stands where a folder is needed when that is the cause ("File exists" and "Not a
    directory" alone leave the user to guess)."""
    if not (isinstance(e, OSError) and e.strerror):
        return str(e)
    files = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    line = f"{files}: {e.strerror}" if files else e.strerror
    if e.errno in (errno.EEXIST, errno.ENOTDIR) and isinstance(e.filename, str):
        path = Path(e.filename)
        blocker = next((p for p in (path, *path.parents) if p.is_file()), None)
        if blocker is not None:
            line += f" ({blocker} is a file, not a folder)"
    return line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with a command's `key=value` overrides (a positional list, `openk3 train`) allowed
    anywhere among its flags: argparse fills a positional list from its first stretch only, so the later
    ones come back unrecognised and are appended here, in order; anything else unrecognised is the usual
    usage error."""
    words = sys.argv[1:] if argv is None else list(argv)
    command = next((w for w in words if not w.startswith("-")), None)
    # no command (`--version`, `--help`, a typo): no command module is imported (they may import torch)
    parser = build_parser(command if command in COMMANDS else "")
    args, rest = parser.parse_known_args(argv)
    overrides = getattr(args, "overrides", None)
    if args.command in ("train", "sft") and isinstance(overrides, list):
        overrides += [a for a in rest if "=" in a and not a.startswith("-")]
        rest = [a for a in rest if not ("=" in a and not a.startswith("-"))]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    module = importlib.import_module(f"openk3.commands.{args.command}")
    debug = os.environ.get("OPENK3_DEBUG", "") not in ("", "0")
    try:
        with notes_on_stderr(debug):
            return module.main(args) or 0
    # expected failures: one clear line, no traceback (FloatingPointError: a training loss that went non-finite;
    # the run's last checkpoint is intact)
    except (ValueError, OSError, FloatingPointError) as e:
        if debug:
            raise
        print(f"openk3 {args.command}: error: {describe(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
