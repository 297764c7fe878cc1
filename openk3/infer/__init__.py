"""Inference engine pieces. So far: token sampling (issue 6) -- `SamplingParams`, `sample_next`,
`sample_batch`, `make_generator`, `filter_logits`, `apply_repetition_penalty`."""

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
