"""Block Attention Residuals: the depth-wise softmax mix over block snapshots (spec §4.3).

Legend: N candidates (block snapshots then the current partial sum), ... any leading token dims,
D hidden width.
"""

from __future__ import annotations

import torch

from openk3.common import fp32_island, upcast


def attn_res_mix(cands: list[torch.Tensor], query_D: torch.Tensor, eps: float) -> torch.Tensor:
    """Mix = softmax over candidates of <RMSNorm(v_i), q>, applied to the raw candidates.

    Entirely in fp32 (spec §4.8): keys are weight-less RMS-normalised candidates, the logit is their
    dot product with `query_D` (= res_norm.weight * res_proj.weight[0], folded), no temperature; the
    output mixes the *un-normalised* candidates and is cast back to the candidates' dtype.

    Args:
        cands: N tensors [..., D] in the activation dtype, snapshots first, partial sum last.
        query_D: the site's pseudo-query [D].
        eps: the `*_res_norm` epsilon (rms_norm_eps).
    """
    with fp32_island(query_D):
        v_N_D = torch.stack([upcast(c) for c in cands])
        k_N_D = v_N_D * torch.rsqrt(v_N_D.pow(2).mean(-1, keepdim=True) + eps)
        logits_N_ = k_N_D @ upcast(query_D)
        p_N_ = torch.softmax(logits_N_, dim=0)
        return (p_N_.unsqueeze(-1) * v_N_D).sum(0).to(cands[-1].dtype)
