"""The language-model loss every trainer and evaluator shares: token-summed cross-entropy over labelled tokens.

Labels are the next tokens, `IGNORE_INDEX` (-100, torch's default) where nothing is learned: padding, prompts,
tool output, a document's last token (no cross-document label). Returning the sum and the count (not the mean)
lets a caller normalise by the global count of labelled tokens, which is what a data-parallel run all-reduces
and what makes gradient accumulation split-invariant.

Legend: B rows, T positions, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed CE in fp32 over labelled tokens, number of labelled tokens)."""
    V = logits_BTV.shape[-1]
    loss = F.cross_entropy(logits_BTV.reshape(-1, V).float(), labels_BT.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss, (labels_BT != IGNORE_INDEX).sum()
