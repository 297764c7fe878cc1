"""The post-training pipeline's own BPE tokenizer: trained on rendered XTML conversations of its domains.

    tok = train_posttrain_tokenizer(("general", "agent", "coding"), vocab_size=2048, seed=0)

Why: with the byte-level tokenizer an agent or coding conversation is 3-10k tokens (the tool declarations
alone are 1.7-5.6k bytes), which makes every stage that reads them (SFT, RL rollouts, MOPD, eval) slow on a
CPU and longer than nano's 4,096 positions. A 2,048-id BPE trained on text of the same families cuts them
about 4x (coding 2.1-2.8k tokens, agent 0.9-1.2k, general prompts ~130; measured on seed 0).

The corpus is drawn from its own seed stream (`tokenizer|SEED`), train split only, so it is not the SFT data
nor any test problem: general problems of every family and level at all three verbosities, and for agent /
coding one scripted expert episode per effort for `agentic_problems` tasks per family (the tool messages are
what the sandbox returned). Control markers are cut out of the text before training: they are special ids,
never merged. A corpus too small for `vocab_size` gives the ranks it supports (`train_bpe(allow_fewer=True)`),
so the vocabulary can come out smaller than asked; the model is built with the tokenizer's size.
"""

from __future__ import annotations

import random
import re

from openk3.chat import THINKING_EFFORTS
from openk3.posttrain.domains.records import byte_tokenizer, render_request

#: corpus sizes per domain (measured: 2,048 ids need the three domains; general alone supports ~1,100)
GENERAL_PROBLEMS = 60
AGENTIC_PROBLEMS = 2


def _render(record: dict) -> str:
    from openk3.chat import render, render_text

    return render_text(render(render_request(record)))


def tokenizer_corpus(domains: tuple[str, ...], seed: int, *, general_problems: int = GENERAL_PROBLEMS,
                     agentic_problems: int = AGENTIC_PROBLEMS) -> list[str]:
    """Rendered conversations (XTML text, markers included) of `domains` from the tokenizer's seed stream."""
    rng = random.Random(f"tokenizer|{seed}")
    docs: list[str] = []
    if "general" in domains:
        from openk3.posttrain.domains.general import sft_dataset

        docs += [_render(r) for r in sft_dataset(general_problems, rng.randrange(2 ** 31), "train")]
    agentic = [d for d in domains if d != "general"]
    if agentic:
        from openk3.agent.tasks import generate
        from openk3.posttrain.domains.agentic import DOMAINS as FAMILIES
        from openk3.posttrain.domains.agentic import act

        for domain in agentic:
            for family in FAMILIES[domain]:
                for k in range(agentic_problems):
                    task = generate(family, rng.randrange(2 ** 31), 1 + k % 3, "train")
                    for effort in THINKING_EFFORTS:
                        episode = act(task, effort)
                        docs.append(_render({"messages": episode["messages"], "tools": episode["tools"],
                                             "effort": effort}))
    return docs


def strip_markers(text: str) -> str:
    """`text` with every special token spelled in it replaced by a newline (they are never merged)."""
    names = sorted(byte_tokenizer().special_ids, key=len, reverse=True)
    return re.sub("|".join(map(re.escape, names)), "\n", text)


def train_posttrain_tokenizer(domains: tuple[str, ...], vocab_size: int, seed: int, **corpus_sizes):
    """A byte-level BPE (K3's file format and special block) of at most `vocab_size` ids for `domains`."""
    from openk3.tokenizer.train import train_bpe

    docs = [strip_markers(d) for d in tokenizer_corpus(domains, seed, **corpus_sizes)]
    return train_bpe(docs, vocab_size, min_frequency=2, allow_fewer=True)
