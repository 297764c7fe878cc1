"""`openk3 template [--segments|--ids --tokenizer DIR] [--mask]`: render a chat request as K3 sees it.

Reads an OpenAI-style chat request (JSON: messages, tools, thinking / enable_thinking,
thinking_effort / reasoning_effort, tool_choice, response_format, add_generation_prompt, or the
same options under chat_template_kwargs) from stdin (or --input FILE) and prints

* the rendered prompt text, exactly (no trailing newline added);
* --segments: a JSON list of [text, is_structural] (with --mask: [text, is_structural, train]);
* --ids --tokenizer DIR: a JSON list of token ids, each segment tokenised on its own (with --mask:
  {"ids": [...], "mask": [0/1 per token]}; 1 = trained-on assistant output).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--segments", action="store_true", help="print the segments as JSON [text, is_structural]")
    g.add_argument("--ids", action="store_true", help="print token ids (needs --tokenizer)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer folder (tiktoken.model + config)")
    p.add_argument("--mask", action="store_true", help="also print the training loss mask")
    p.add_argument("--input", "-i", default=None, metavar="FILE", help="read the request from FILE, not stdin")


def source_name(path: str | None) -> str:
    return path if path not in (None, "-") else "the request on stdin"


def read_request(path: str | None) -> dict:
    from openk3.commands.common import read_text_input
    from openk3.fsutil import parse_json

    request = parse_json(read_text_input(path, source_name(path)), source_name(path))
    if not isinstance(request, dict):
        raise ValueError(f"{source_name(path)}: the request must be a JSON object with a 'messages' list")
    return request


def load_tokenizer(path: str | None):
    if path is None:
        raise ValueError("--ids needs --tokenizer DIR")
    try:
        from openk3.tokenizer import Tokenizer
    except ImportError as e:
        raise ValueError(f"--ids needs openk3.tokenizer, which is not available here ({e})") from None
    try:
        return Tokenizer.from_dir(path)
    except (OSError, KeyError) as e:
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from None


def main(args: argparse.Namespace) -> int:
    from openk3.chat import encode_segments, render, render_text

    if args.tokenizer and not args.ids:
        raise ValueError("--tokenizer is only used with --ids")
    try:
        segments = render(read_request(args.input))
    except ValueError as e:  # the renderer names the field (`messages[1].tool_calls`); say where it came from
        source = source_name(args.input)
        raise ValueError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None
    if args.ids:
        tok = load_tokenizer(args.tokenizer)
        ids, mask = encode_segments(segments, tok)
        print(json.dumps({"ids": ids, "mask": [int(m) for m in mask]} if args.mask else ids))
    elif args.segments:
        rows = [[s.text, s.structural, s.train] if args.mask else [s.text, s.structural] for s in segments]
        print(json.dumps(rows, ensure_ascii=False))
    else:
        if args.mask:
            raise ValueError("--mask goes with --segments or --ids")
        sys.stdout.write(render_text(segments))
        sys.stdout.flush()
    return 0
