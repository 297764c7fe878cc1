"""Effort control on a trained model (issue 18 item 8): the think tokens `openk3.LLM(...).chat(messages,
effort=E)` produces, greedy, on 16 general test prompts, for E = low, high, max and none (thinking off).

    .venv/bin/python scripts/effort_demo.py runs/pt-smoke/student [--n 16] [--max-tokens 400]

The prompts are the user messages of `ProblemSource("general", ..., split="test")`, the problems `openk3 eval`
scores; this goes through the chat API a user calls (XTML render with the effort's system message, engine,
parser), not the evaluation's rollout path. `openk3 chat --effort` and the server's `reasoning_effort` render
the same prompt.
"""

from __future__ import annotations

import statistics
import sys


def main(argv: list[str]) -> dict[str, list[int]]:
    import argparse

    from openk3.common import setup_cpu

    p = argparse.ArgumentParser(description="think tokens per effort through LLM.chat on a trained model")
    p.add_argument("model", help="checkpoint or run folder (with its tokenizer)")
    p.add_argument("--n", type=int, default=16, help="general test prompts (default 16)")
    p.add_argument("--max-tokens", type=int, default=400, help="per reply (default 400)")
    args = p.parse_args(argv)
    setup_cpu(1)
    import openk3
    from openk3.posttrain.trainers.problems import ProblemSource

    llm = openk3.LLM(args.model)
    problems = ProblemSource("general", "max", llm.tokenizer, split="test", seed=0).draw(0, args.n, total_steps=1)
    close = llm.tokenizer.special_ids["<|close|>"]
    out: dict[str, list[int]] = {}
    for effort in ("low", "high", "max", "none"):
        think = out[effort] = []
        for prob in problems:
            user = [m for m in prob.meta["messages"] if m["role"] == "user"]
            reply = llm.chat(user, effort=effort, temperature=0, max_tokens=args.max_tokens)
            # think tokens as the evaluation counts them: sampled ids before the think channel's close marker
            ids = reply.token_ids
            think.append(0 if effort == "none" else ids.index(close) if close in ids else len(ids))
        print(f"effort {effort:>4}: mean think tokens {statistics.mean(think):.1f} (max {max(think)})", flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
