"""What structured outputs cost (issue 28): the engine's decode tokens/s with no grammar and with every row under
a JSON-schema grammar, and the per-token cost of the grammar mask (llguidance's next-token mask plus applying it
to the logits), at the `nano` preset's vocabulary (512 ids: the tests' byte tokenizer) and at K3's (163,840 ids:
a synthetic tokenizer of that size with the nano trunk, since the release's tokenizer is not shipped).

    python benchmarks/bench_structured.py                     # ~1-2 min
    python benchmarks/bench_structured.py --no-grammar        # unconstrained decode only (runs on a tree without
                                                              # structured outputs: the "before" figure)

Decode: `Engine(model, tok, max_num_seqs=B)` with B prompts of 16 random ids, greedy, `ignore_eos`, N new tokens
each; tokens/s = tokens of the steps after the first / their wall time (as `bench_decode.py`), median of
`--repeats` after one warm-up. The grammar (an array of at least 40 objects) cannot end within N tokens, so the
batch stays B throughout. Mask cost: the time spent in `Grammars.mask` over the rows it masked. One thread.
Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, setup_threads  # noqa: E402

import openk3  # noqa: E402
from openk3.infer.engine import Engine  # noqa: E402
from openk3.infer.sample import SamplingParams  # noqa: E402
from openk3.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"], "additionalProperties": False}}


def byte_tokenizer() -> Tokenizer:
    return Tokenizer({bytes([b]): b for b in range(256)})


def synthetic_tokenizer(n_ranks: int = 163_584, seed: int = 0) -> Tokenizer:
    """K3's size: 256 bytes + tokens joining two earlier ones (as tests/test_tokenizer.py), K3's 256 specials."""
    rnd = random.Random(seed)
    ranks = {bytes([b]): b for b in range(256)}
    toks = list(ranks)
    while len(toks) < n_ranks:
        t = toks[int(len(toks) * rnd.random() ** 3)] + toks[int(len(toks) * rnd.random() ** 3)]
        if len(t) <= 12 and t not in ranks:
            ranks[t] = len(toks)
            toks.append(t)
    return Tokenizer(ranks)


def decode_rate(engine: Engine, batch: int, new_tokens: int, structured) -> float:
    """Decode tokens/s of one run (the steps after the first)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(batch):
        prompt = torch.randint(0, 256, (16,), generator=gen).tolist()
        extra = {"structured": structured} if structured is not None else {}
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, **extra), ignore_eos=True)
    engine.step()
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.delta_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0)


class MaskTimer:
    """Wraps `Grammars.mask` of an engine: total seconds and masked rows."""

    def __init__(self, engine: Engine) -> None:
        self.seconds, self.rows = 0.0, 0
        grammars = engine.grammars()
        inner = grammars.mask

        def timed(logits, rows, constraints):
            t0 = time.perf_counter()
            out = inner(logits, rows, constraints)
            self.seconds += time.perf_counter() - t0
            self.rows += len(rows)
            return out

        grammars.mask = timed


def run(name: str, model, tok, args) -> list[dict]:
    """One vocabulary's rows: decode tok/s per batch size with no grammar and with one (and its mask cost)."""
    engine = Engine(model, tok, max_num_seqs=max(args.batch))
    rows = []
    structured = None
    if not args.no_grammar:
        from openk3.infer.structured import Structured

        structured = Structured.of({"json": SCHEMA})
        timer = MaskTimer(engine)
    for b in args.batch:
        for grammar in ([None] if args.no_grammar else [None, structured]):
            decode_rate(engine, b, args.new_tokens, grammar)  # warm-up (and the grammar's compile)
            if grammar is not None:
                timer.seconds, timer.rows = 0.0, 0
            rates = [decode_rate(engine, b, args.new_tokens, grammar) for _ in range(args.repeats)]
            row = {"vocabulary": name, "batch": b, "grammar": "JSON schema" if grammar else "none",
                   "decode_tok_s": statistics.median(rates),
                   "mask_us_per_row_token": timer.seconds / timer.rows * 1e6 if grammar is not None else None}
            rows.append(row)
            mask = "-" if row["mask_us_per_row_token"] is None else f"{row['mask_us_per_row_token']:.0f}"
            print(f"| {name} | {b} | {row['grammar']} | {row['decode_tok_s']:.0f} | {mask} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-grammar", action="store_true", help="unconstrained decode only")
    ap.add_argument("--skip-k3-vocab", action="store_true", help="nano's 512-id vocabulary only")
    args = ap.parse_args(argv)
    setup_threads(1)
    print(machine_line(1))
    print("| vocabulary | batch | grammar | decode tok/s | mask us per row-token |")
    print("| --- | --- | --- | --- | --- |")
    torch.manual_seed(0)
    cfg = openk3.preset("nano")
    rows = run("nano, 512", openk3.K3ForCausalLM.build(cfg, seed=0).eval(), byte_tokenizer(), args)
    if not args.skip_k3_vocab:
        tok = synthetic_tokenizer()
        model = openk3.K3ForCausalLM.build(dataclasses.replace(cfg, vocab_size=tok.vocab_size), seed=0).eval()
        rows += run("nano trunk, 163,840 (synthetic)", model, tok, args)
    return {"rows": rows}


if __name__ == "__main__":
    main()
