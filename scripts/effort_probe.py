"""How far a trained model reads the thinking-effort message (issue 18, docs/posttraining.md "Why not in coding").

    .venv/bin/python scripts/effort_probe.py runs/pt-smoke/student [--domains coding agent] [--n 4] [--chars 80]

For agentic test problems (rendered exactly as the sandbox env renders them: tool declarations, the effort's
system message, the task's instruction as the user message), the total variation distance between the model's
first-think-token distributions at two efforts (low-high, low-max, high-max), for three renderings: as
evaluated; without the tool declarations (a much shorter context, the same distance from the effort message
to the think token); with the tool declarations and the instruction cut to its first `--chars` characters
(the same long context, a short distance); and that cut instruction followed by neutral filler sentences as
long as the rest of the instruction (the cut's content, the original distance: the control that tells distance
from content). A model that reads the effort wherever it is gives large distances in every row; one that reads
it only when it is recent, in the short-instruction row only.
"""

from __future__ import annotations

import sys

EFFORTS = ("low", "high", "max")
FILLER = "Take care to keep the existing behaviour. "  # neutral text: no effort, numbers or task content
RENDERINGS = ("as evaluated", "no tools", "short instruction", "short + filler")
PAIRS = (("low", "high"), ("low", "max"), ("high", "max"))


def main(argv: list[str]) -> list[dict]:
    import argparse

    from openk3.common import setup_cpu

    p = argparse.ArgumentParser(description="first-think-token effort sensitivity of a trained model")
    p.add_argument("model", help="checkpoint or run folder (with its tokenizer)")
    p.add_argument("--domains", nargs="+", default=["coding", "agent"], choices=("coding", "agent"))
    p.add_argument("--n", type=int, default=4, help="test problems per domain (default 4)")
    p.add_argument("--chars", type=int, default=80, help="the cut instruction's length in characters (default 80)")
    args = p.parse_args(argv)
    setup_cpu(1)
    import torch

    import openk3
    from openk3.agent import SandboxEnv
    from openk3.agent.tasks import generate
    from openk3.chat import encode_segments, render
    from openk3.posttrain.domains.agentic import DOMAINS

    llm = openk3.LLM(args.model)
    model, tok = llm.model, llm.tokenizer

    @torch.no_grad()
    def first_think(ids: list[int]) -> torch.Tensor:  # log-probabilities of the token after the prompt
        return torch.log_softmax(model(torch.tensor([ids]))[0, -1].double(), dim=-1)

    rows = []
    for domain in args.domains:
        families = DOMAINS[domain]
        for k in range(args.n):
            task = generate(families[k % len(families)], 1000 + k, 1, "test")
            with SandboxEnv(task, tok, effort="low", max_steps=1) as env:
                obs = env.reset()
            instruction = next(m["content"] for m in obs.messages if m["role"] == "user")
            row = {"domain": domain, "family": task.family}
            cut = instruction[:args.chars]
            filler = (FILLER * (len(instruction) // len(FILLER) + 1))[:max(0, len(instruction) - len(cut) - 1)]
            for name, tools, text in zip(RENDERINGS, (obs.tools, [], obs.tools, obs.tools),
                                         (instruction, instruction, cut, f"{cut} {filler}"), strict=True):
                dist, length = {}, 0
                for effort in EFFORTS:
                    ids = encode_segments(render({"messages": [{"role": "user", "content": text}], "tools": tools,
                                                  "reasoning_effort": effort}), tok).ids
                    if name == "as evaluated" and effort == "low" and ids != list(obs.prompt_ids):
                        raise RuntimeError(f"{task.id}: the rebuilt prompt differs from the env's")
                    dist[effort], length = first_think(ids), len(ids)
                tv = {f"{a}-{b}": 0.5 * (dist[a].exp() - dist[b].exp()).abs().sum().item() for a, b in PAIRS}
                row[name] = {"length": length, "tv": tv}
                print(f"{domain:6s} {task.family:14s} {name:17s} {length:5d} tokens: "
                      + "  ".join(f"TV {pair} {v:.3f}" for pair, v in tv.items()), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
