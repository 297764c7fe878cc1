"""`openk3 posttrain --preset P --out DIR [--profile tiny|smoke|full|overnight] [--domains general,agent,coding]`:
the whole post-training pipeline (issue 18 item 7; `openk3.posttrain.pipeline`).

    openk3 posttrain --preset nano --out runs/pt-smoke --profile smoke --domains general
    openk3 posttrain --preset small --out runs/pt-full --profile full --base runs/small   # a pretrained start

Stages: base -> SFT data -> SFT -> per domain the teachers max -> high -> low -> MOPD student -> merged
baseline -> eval; each in its own sub-folder of DIR, skipped when done (a rerun continues a killed run).
Writes DIR/report.json (the issue's contract for the chosen domains' cells) and DIR/pipeline.json (what ran,
with which settings). The agent and coding domains need sandboxes; where they cannot run the command
refuses with the reason (pass --domains general).
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from openk3.config import PRESETS
    from openk3.posttrain.pipeline import PROFILES

    p.add_argument("--preset", required=True,
                   help=f"model preset: {', '.join(PRESETS)} (the base is this preset, randomly initialised, with "
                        "the byte-level tokenizer, unless --base is given)")
    p.add_argument("--out", required=True, help="the run folder (created; a rerun continues it)")
    p.add_argument("--profile", default="smoke",
                   help=f"stage sizes: {', '.join(PROFILES)} (default smoke: one CPU core, ~9.5 minutes for all "
                        "three domains; full: ~2 hours of nano cut to 4 layers on one core; overnight: ~12 hours of "
                        "the whole preset)")
    p.add_argument("--domains", default="general,agent,coding",
                   help="comma-separated domains (default all three: the full report)")
    p.add_argument("--base", default=None,
                   help="start from this pretrained checkpoint or run folder (with its tokenizer) instead of a "
                        "random preset model")
    p.add_argument("--seed", type=int, default=0, help="data, initialisation, problems and sampling (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: $OPENK3_THREADS, else 1 on a 2-CPU machine, else torch's)")


def main(args: argparse.Namespace) -> int:
    from openk3.chat import THINKING_EFFORTS
    from openk3.posttrain.evaluation.report import effort_ordering
    from openk3.posttrain.pipeline import Pipeline, contract_problems, parse_domains

    pipeline = Pipeline(args.out, preset=args.preset, profile=args.profile, domains=parse_domains(args.domains),
                        base=args.base, seed=args.seed, threads=args.threads)
    report = pipeline.run()
    gaps = contract_problems(report, pipeline.domains)
    assert not gaps, gaps  # the eval stage refuses to finish otherwise
    for name in ("sft", "student", "merged"):
        m, ordered = report["models"][name], effort_ordering(report["models"][name])
        for d in pipeline.domains:
            accuracy = ", ".join(f"{e} {m[d][e]['accuracy']:.3f}" for e in THINKING_EFFORTS)
            think = ", ".join(f"{e} {m[d][e]['thinking_tokens']:.1f}" for e in THINKING_EFFORTS)
            print(f"[posttrain] {name} {d}: accuracy {accuracy}; think tokens {think} "
                  f"(ordered low < high < max: {'yes' if ordered[d] else 'no'})")
    print(f"[posttrain] done: {args.out}/report.json, {args.out}/eval/report.md, {args.out}/pipeline.json")
    return 0
