"""`openk3 tokenizer train --vocab-size 8192 --out DIR [--max-bytes N] [--input FILE...]`.

Trains a byte-level BPE offline and writes it in K3's format (`tiktoken.model` +
`tokenizer_config.json`): vocab_size - 256 ranks, then K3's 256-id special block at the same offsets
as in K3 (`openk3.tokenizer.train`). Default input: the built-in corpus (the Python standard
library's sources and their docstrings/comments, `openk3.data.corpus`); `--input` takes files or
folders (every file below, sorted) read as UTF-8. Progress goes to stderr, the summary to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    t = sub.add_parser("train", help="train a byte-level BPE in K3's file format and special layout",
                       description="Train a byte-level BPE (K3 pre-tokenizer regex) and write tiktoken.model + "
                                   "tokenizer_config.json with K3's 256 special ids after the ranks.")
    t.add_argument("--vocab-size", type=int, default=8192,
                   help="total vocabulary: ranks + 256 special ids (default 8192 = 7936 ranks + 256)")
    t.add_argument("--out", required=True, help="output folder (created if needed)")
    t.add_argument("--max-bytes", type=int, default=None, help="use at most this many bytes of input text")
    t.add_argument("--input", nargs="+", default=None, metavar="FILE",
                   help="text files or folders to train on (default: the built-in stdlib corpus)")
    t.add_argument("--min-frequency", type=int, default=2, help="least count of a pair to merge (default 2)")


def _progress(msg: str) -> None:
    print(f"[tokenizer] {msg}", file=sys.stderr, flush=True)


def _train(args: argparse.Namespace) -> int:
    from openk3.tokenizer.train import read_text_files, train_bpe

    if args.vocab_size < 512:
        raise ValueError(f"--vocab-size must be at least 512 (256 byte ranks + 256 special ids), got {args.vocab_size}")
    if args.max_bytes is not None and args.max_bytes <= 0:
        raise ValueError(f"--max-bytes must be positive, got {args.max_bytes}")
    t0 = time.perf_counter()
    if args.input:
        docs = list(read_text_files(args.input, args.max_bytes))
        source = f"{len(args.input)} input path(s)"
    else:
        from openk3.data.corpus import builtin_corpus

        _progress("building the built-in corpus (Python standard library sources, docstrings, comments)")
        docs = builtin_corpus(args.max_bytes)
        source = "built-in corpus"
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    if n_bytes == 0:
        raise ValueError("no input text")
    _progress(f"{source}: {len(docs)} documents, {n_bytes / 1e6:.2f} MB ({time.perf_counter() - t0:.1f} s)")
    tok = train_bpe(docs, args.vocab_size, args.out, min_frequency=args.min_frequency, progress=_progress)
    sample = docs[: max(1, len(docs) // 8)] if n_bytes > 4e6 else docs
    sample_bytes = sum(len(d.encode("utf-8")) for d in sample)
    n_tokens = sum(len(tok.encode(d)) for d in sample)
    print(f"wrote {args.out}: {tok.n_ranks} ranks + {len(tok.special_ids)} special ids = vocab {tok.vocab_size}; "
          f"{sample_bytes / max(1, n_tokens):.2f} bytes/token on the training text; "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.tokenizer_command == "train":
        return _train(args)
    raise ValueError(f"unknown tokenizer action {args.tokenizer_command!r}")
