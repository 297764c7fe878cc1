"""Inference (docs/inference.md): the continuous-batching `Engine` (engine.py) over a `SlotCache`
(openk3/model/cache.py) with exact prefix snapshots (prefix.py) and an optional compiled decode step
(graph.py), streaming detokenisation with stop strings (detok.py), token sampling (sample.py),
grammar-constrained decoding (structured.py; chat turns in XTML: xtml_grammar.py) and the user-facing
`openk3.LLM` (llm.py, imported lazily: it loads checkpoints)."""

from openk3.infer.sample import (
    SamplingParams,
    apply_repetition_penalty,
    filter_logits,
    make_generator,
    sample_batch,
    sample_next,
)

__all__ = [
    "SamplingParams",
    "apply_repetition_penalty",
    "filter_logits",
    "make_generator",
    "sample_batch",
    "sample_next",
]
