"""`openk3 generate --model DIR --prompt TEXT [--prompt TEXT ...] [--max-tokens N] [--temperature T] ...`

Plain text continuation with `openk3.LLM` (no chat template; see `openk3 chat` for that). One prompt:
the completion streams to stdout as it is generated. Several (`--prompt` repeated, or
`--prompts-file FILE`, one prompt a line, `-` = stdin): decoded together, each printed under a
`--- k/n (finish_reason, tokens) ---` header. `--json`: one JSON object a line instead
({"prompt", "text", "token_ids", "finish_reason", "stop_reason"}). Timing goes to stderr.

    openk3 generate --model runs/nano --prompt "Once upon a time" --max-tokens 64 --temperature 0.8 --seed 1
    openk3 generate --model ckpt --prompts-file prompts.txt --temperature 0 --stop "\\n\\n" --json
"""

from __future__ import annotations

import argparse
import json
import sys

from openk3.commands.common import add_dtype_argument, positive_int


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --tokenizer, --dtype, --device, --max-model-len, --threads, --compile, --keep-packed (shared with
    `openk3 chat`)."""
    p.add_argument("--model", "-m", required=True, metavar="DIR",
                   help="checkpoint folder, or a training run folder (its checkpoints/latest is used)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer folder (default: the checkpoint's own tiktoken.model)")
    add_dtype_argument(p, "auto", "compute dtype of the weights (auto: float32 on CPU, where it decodes "
                                  "1.5-2x faster than bf16, as stored on a GPU; fp32 islands stay fp32)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="prompt + generated tokens per request (default: the config's max_position_embeddings)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: $OPENK3_THREADS, else 1 on machines with <= 2 CPUs)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step (torch.compile): about 40-90 s per graph on one CPU core when "
                        "first needed (a graph for batch 1, one for larger batches, one per MoE form used; "
                        "cached on disk for later runs), then about 2-4x fewer ms/token (docs/benchmarks.md)")
    p.add_argument("--keep-packed", action="store_true",
                   help="keep MXFP4 experts packed in memory (4.25 bits/weight; decode reads them directly)")
    add_stream_arguments(p)


def add_stream_arguments(p: argparse.ArgumentParser, stats: bool = True) -> None:
    """--experts, --expert-cache, --io-threads, --io and (`stats`) --stats (shared with `openk3 chat` and
    `openk3 serve`)."""
    g = p.add_argument_group("streamed experts (a checkpoint larger than memory, e.g. the release)")
    g.add_argument("--experts", default="memory", choices=("memory", "stream"),
                   help="stream: leave the MXFP4 routed experts on disk and read those a layer needs into a "
                        "per-layer cache (CPU; the same tokens as --keep-packed; docs/inference.md)")
    g.add_argument("--expert-cache", default=None, metavar="SIZE",
                   help="bytes of that cache, e.g. 22GB or 1.5GiB (default: half the available memory, at most "
                        "every expert)")
    g.add_argument("--io-threads", type=positive_int, default=4, metavar="N",
                   help="reads in flight (default 4; 2-4 fill one NVMe drive)")
    g.add_argument("--trunk", default="bf16", choices=("bf16", "int8", "int4"),
                   help="the non-routed linears: as stored (bf16, default), or weight-only int8 / int4 quantised while "
                        "loading (CPU; docs/inference.md measures their quality)")
    g.add_argument("--trunk-group", type=int, default=32, choices=(32, 64, 128, 256),
                   help="int4's group size (default 32; 64/128 hold 17/25 %% less, at some quality: docs/inference.md)")
    g.add_argument("--io", default="auto", choices=("auto", "direct", "buffered"),
                   help="O_DIRECT reads (auto: where the filesystem allows them; default auto)")
    if stats:
        g.add_argument("--stats", action="store_true",
                       help="print the expert cache's counters (requests, reads, bytes, hit rate, stall) at the end")


def stream_kwargs(args: argparse.Namespace) -> dict:
    """LLM keyword arguments from `add_stream_arguments`' flags (ValueError for stream flags without --experts
    stream)."""
    trunk = {} if args.trunk == "bf16" else {"trunk": args.trunk, "trunk_group": args.trunk_group}
    if args.experts != "stream":
        if args.expert_cache is not None or args.io != "auto":
            raise ValueError("--expert-cache and --io apply to --experts stream")
        return trunk
    return {"experts": "stream", "expert_cache": args.expert_cache, "io_threads": args.io_threads,
            "direct_io": {"auto": None, "direct": True, "buffered": False}[args.io], **trunk}


def format_stream_stats(st: dict) -> str:
    """One line of `openk3.stream.stats` for --stats."""
    return (f"[experts] {st['requests']} requests, {st['reads']} reads ({st['bytes_read'] / 1e9:.3f} GB), hit rate "
            f"{st['hit_rate']:.3f}, stalled {st['stall_seconds']:.2f} s, reading {st['read_seconds']:.2f} s "
            f"(summed over {st['io_threads']} threads, {'direct' if st['direct_io'] else 'buffered'} I/O); cache "
            f"{st['slots']} experts ({st['cache_bytes'] / 1e9:.2f} GB)")


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The `SamplingParams` flags (shared with `openk3 chat`)."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"tokens to generate at most (default {max_tokens})")
    g.add_argument("--temperature", "-t", type=float, default=1.0, help="0 = greedy (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep the smallest set with this mass (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL/HF repetition penalty (1 = off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop string (repeatable; not part of the output); backslash escapes such as \\n work")


def sampling_params(args: argparse.Namespace):
    from openk3.infer.sample import SamplingParams

    stop = tuple(_unescape(s) for s in args.stop)
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
                          stop=stop)


def _unescape(s: str) -> str:
    """`\\n`, `\\t`, `\\\\` ... as typed on a command line -> the characters."""
    if "\\" not in s:
        return s
    try:
        return s.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:
        return s


def build_llm(args: argparse.Namespace):
    """setup_cpu(--threads), then `openk3.LLM` from the model flags. (Callers build their SamplingParams
    first, so a bad sampling flag fails before the weights are read.)"""
    from openk3.common import setup_cpu
    from openk3.infer.llm import LLM

    setup_cpu(args.threads)
    return LLM(args.model, args.tokenizer, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               compile=args.compile, keep_packed=args.keep_packed, **stream_kwargs(args))


def print_stream_stats(args: argparse.Namespace, llm) -> None:
    """--stats: the expert cache's counters on stderr (nothing for a model without streamed experts)."""
    from openk3.stream import stats

    st = stats(llm.model) if getattr(args, "stats", False) else None
    if st is not None:
        print(format_stream_stats(st), file=sys.stderr)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_arguments(p)
    src = p.add_argument_group("prompts")
    src.add_argument("--prompt", "-p", action="append", default=[], metavar="TEXT",
                     help="a prompt (repeat for a batch)")
    src.add_argument("--prompts-file", default=None, metavar="FILE",
                     help="one prompt a line (blank lines skipped); - reads stdin")
    add_sampling_arguments(p, max_tokens=128)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at [EOS] / <|end_of_msg|>")
    p.add_argument("--echo", action="store_true", help="print each prompt before its completion")
    p.add_argument("--json", action="store_true", help="one JSON object a line: prompt, text, token_ids, finish_reason")


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        from openk3.commands.common import read_text_input

        text = read_text_input(args.prompts_file)
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompt: give --prompt TEXT (repeatable) or --prompts-file FILE")
    if any(not p for p in prompts):
        raise ValueError("empty prompt")
    return prompts


def _json_line(prompt: str, out) -> str:
    return json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                       "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}, ensure_ascii=False)


def main(args: argparse.Namespace) -> int:
    import contextlib
    import time

    prompts = read_prompts(args)
    params = sampling_params(args)
    llm = build_llm(args)
    kw = {"ignore_eos": args.ignore_eos}
    t0 = time.perf_counter()
    if len(prompts) == 1 and not args.json:
        if args.echo:
            sys.stdout.write(prompts[0])
        last = None
        try:
            with contextlib.closing(llm.stream(prompts[0], params, **kw)) as outputs:
                for out in outputs:
                    last = out
                    if out.delta_text:
                        sys.stdout.write(out.delta_text)
                        sys.stdout.flush()
        except KeyboardInterrupt:
            print("\n[generate] interrupted", file=sys.stderr)
            return 130
        sys.stdout.write("\n")
        sys.stdout.flush()
        outs = [last]
    else:
        outs = llm.generate(prompts, params, **kw)
        for k, (prompt, out) in enumerate(zip(prompts, outs, strict=True), start=1):
            if args.json:
                print(_json_line(prompt, out))
            else:
                print(f"--- {k}/{len(prompts)} ({out.finish_reason}, {len(out.token_ids)} tokens) ---")
                print((prompt if args.echo else "") + out.text)
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    reasons = ", ".join(sorted({str(o.finish_reason) for o in outs}))
    print(f"[generate] {len(outs)} prompt(s), {n} tokens in {dt:.2f} s ({n / max(dt, 1e-9):.1f} tok/s); "
          f"finish: {reasons}", file=sys.stderr)
    print_stream_stats(args, llm)
    return 0
