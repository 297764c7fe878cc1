"""`openk3 parse [--no-thinking] [--deltas]`: read a K3 completion, print the assistant message.

The completion is the model's output after the generation prompt (so with thinking on it starts
inside the think channel), read from stdin (or --input FILE). Prints one JSON object:
{"role", "reasoning_content", "content", "tool_calls", "problems"}; with --deltas, first the
streaming deltas (one JSON object a line, as if the text arrived in --chunk-sized pieces).
A trailing newline after the final marker (as `echo` adds) is ignored.
"""

from __future__ import annotations

import argparse
import json

from openk3.chat.xtml import END_OF_MSG, SEP


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-thinking", dest="thinking", action="store_false",
                   help="the prompt ended in the response channel (thinking off)")
    p.add_argument("--deltas", action="store_true", help="print the streaming deltas (JSON lines) first")
    p.add_argument("--chunk", type=int, default=1, help="characters per feed() with --deltas (default 1)")
    p.add_argument("--input", "-i", default=None, metavar="FILE", help="read the completion from FILE, not stdin")


def main(args: argparse.Namespace) -> int:
    from openk3.chat import StreamParser
    from openk3.commands.common import read_text_input

    text = read_text_input(args.input)
    if text.endswith("\n") and text[:-1].endswith((SEP, END_OF_MSG)):
        text = text[:-1]
    chunk = getattr(args, "chunk", 1)
    if chunk < 1:
        raise ValueError("--chunk must be at least 1")
    parser = StreamParser(thinking=args.thinking)
    if getattr(args, "deltas", False):
        deltas = []
        for i in range(0, len(text), chunk):
            deltas += parser.feed(text[i:i + chunk])
        deltas += parser.finish()
        for d in deltas:
            print(json.dumps(d, ensure_ascii=False))
    else:
        parser.feed(text)
        parser.finish()
    print(json.dumps(parser.message(), ensure_ascii=False, indent=2))
    return 0
