"""Samples at the end of a training run: continuations of validation documents' first tokens, greedy then sampled.

What `openk3 train` prints and returns as `summary["samples"]`: a quick look at what the model learnt, from the
decode cache (no engine: the training model as it is, under the run's autocast).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.nn as nn


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], n: int, *, temperature: float = 0.0,
             generator: torch.Generator | None = None, device: torch.device | str = "cpu",
             banned: list[int] | None = None, stop: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Greedy (temperature 0) or sampled continuation with the decode cache; returns the new ids
    (ending at the first id in `stop`). `banned` ids are never produced."""
    was = model.training
    model.eval()
    try:
        cache = model.new_cache()
        logits = model(torch.tensor([prompt], device=device), cache=cache)
        out = []
        for _ in range(n):
            last = logits[0, -1].float()
            if banned:
                last[banned] = float("-inf")
            if temperature > 0:
                probs = torch.softmax(last / temperature, dim=-1).cpu()
                nxt = int(torch.multinomial(probs, 1, generator=generator))
            else:
                nxt = int(last.argmax())
            out.append(nxt)
            if nxt in stop:
                break
            logits = model(torch.tensor([[nxt]], device=device), cache=cache)
        return out
    finally:
        model.train(was)


def val_samples(model: nn.Module, tok, val, count: int, tokens: int, *, seed: int, device, say: Callable) -> list[dict]:
    """`count` continuations of `tokens` ids: the first greedy, the rest at temperature 0.8, each from the first
    (up to 16) tokens of a validation document; untrained reserved ids are never produced. Each is `say`-ed."""
    gen = torch.Generator().manual_seed(seed)
    stop = set(tok.stop_ids)
    banned = sorted(set(tok.special_ids.values()) - stop)  # untrained reserved ids: noise in a sample
    samples = []
    for i in range(count):
        doc = [int(t) for t in val.document(i % val.num_docs)]
        prompt = doc[: max(1, min(16, len(doc) - 1))]
        temp = 0.0 if i == 0 else 0.8
        new = generate(model, prompt, tokens, temperature=temp, generator=gen, device=device, banned=banned,
                       stop=stop)
        text = {"temperature": temp, "prompt": tok.decode(prompt), "completion": tok.decode(new)}
        samples.append(text)
        say(f"sample (T={temp}): {json.dumps(text['prompt'])} -> {json.dumps(text['completion'])}")
    return samples
