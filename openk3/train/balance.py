"""Expert load balancing: Quantile Balancing of `e_score_correction_bias` (spec §5), DeepSeek-V3's sign
rule (Kimi K2's, for the scaling lab's K2-style baseline), load metrics, and an auxiliary-loss alternative
for comparison; `RoutingRecorder` collects routing from a model.

Legend: N tokens, E experts, K experts per token (top-k).

Quantile Balancing (QB, J. Su 2026, K3 report), for a batch of N tokens, target load q = N*K/E:
  alpha_i = the (K+1)-th largest biased score of token i (its cutoff),
  M_ij    = s_ij + b_j - alpha_i   (expert j is in token i's top-k iff M_ij > 0),
  c_j     = the (q+1)-th largest margin of column j,
  b_j    <- b_j - rate * c_j.
With rate 1 (the documented default) exactly q margins of every column stay positive (when q is an
integer and there are no ties). That is a statement about the margins *against the old cutoffs*:
moving all biases at once moves every token's cutoff too, so the re-routed top-k loads of the same
batch are close to q but not exactly q; repeated updates converge. rate < 1 damps the step.

Non-integer q: c_j is linearly interpolated between the (floor(q)+1)-th and (floor(q)+2)-th largest
margins (continuous in q; at integer q it is exactly the (q+1)-th largest).

Token population: whatever the caller passes (a micro-batch, or everything a `RoutingRecorder`
collected over the micro-batches of one optimizer step). A global-batch version over data-parallel
ranks needs a distributed quantile (gather, or histograms as in Megatron); it is not here.

Sign rule (DeepSeek-V3's auxiliary-loss-free balancing, also Kimi K2's), with update speed u
(DeepSeek-V3: 0.001): load_j = tokens routed to expert j in the batch (the top-k of the biased scores, as
recorded), mean = N*K/E, b_j <- b_j + u * sign(mean - load_j). Every expert moves by exactly u (or
not at all when exactly at the mean), whatever its imbalance: slower than QB, which moves each bias by
what would re-balance this batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from openk3.common import upcast
from openk3.model.moe import SparseMoE


def quantile_balance_update(scores_NE: torch.Tensor, bias_E: torch.Tensor, top_k: int,
                            rate: float = 1.0) -> torch.Tensor:
    """New correction bias after one QB step on unbiased sigmoid scores [N, E] (see the module doc).

    Computed in fp32 (float64 if given); returned in `bias_E`'s dtype. Nothing is modified in place.
    """
    s_NE = upcast(scores_NE.detach())
    N, E = s_NE.shape
    if not 0 < top_k < E:
        raise ValueError(f"top_k={top_k} must be in (0, {E})")
    b_E = bias_E.detach().to(s_NE.dtype)
    biased_NE = s_NE + b_E
    alpha_N = torch.topk(biased_NE, top_k + 1, dim=1).values[:, -1]
    margin_NE = biased_NE - alpha_N[:, None]
    q = N * top_k / E
    lo = math.floor(q)
    frac = q - lo
    vals_RE = torch.topk(margin_NE, min(lo + 2, N), dim=0).values  # descending per column
    c_E = vals_RE[lo]
    if frac > 0 and lo + 1 < vals_RE.shape[0]:
        c_E = (1 - frac) * c_E + frac * vals_RE[lo + 1]
    return (b_E - rate * c_E).to(bias_E.dtype)


def sign_balance_update(load_E: torch.Tensor, bias_E: torch.Tensor, rate: float = 1e-3) -> torch.Tensor:
    """New correction bias after one sign-rule step (see the module doc) from the per-expert token counts
    `load_E` (integers, `expert_load`); returned in `bias_E`'s dtype, nothing modified in place."""
    if load_E.shape != bias_E.shape:
        raise ValueError(f"load {tuple(load_E.shape)} and bias {tuple(bias_E.shape)} must both be [E]")
    load_E = load_E.to(torch.int64)
    # sign(mean - load) = sign(sum - E * load), in integers: an expert exactly at a fractional mean is
    # never pushed by a rounding error
    sign_E = torch.sign(load_E.sum() - load_E.shape[0] * load_E)
    return bias_E.detach() + rate * sign_E.to(bias_E.dtype)


def expert_load(idx_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert [E] (int64)."""
    return torch.bincount(idx_NK.reshape(-1), minlength=num_experts)


def load_stats(idx_NK: torch.Tensor, num_experts: int) -> dict[str, float]:
    """max/mean load ("max_over_mean", 1.0 = perfect balance), min and max load (tokens), and the
    coefficient of variation "cv" (population std / mean) of the per-expert loads."""
    return stats_of_load(expert_load(idx_NK, num_experts))


def stats_of_load(load_E: torch.Tensor) -> dict[str, float]:
    """`load_stats` of per-expert token counts [E]."""
    load = load_E.double()
    mean = load.mean()
    return {"max_over_mean": (load.max() / mean).item(), "min": load.min().item(), "max": load.max().item(),
            "cv": (load.std(correction=0) / mean).item()}


def aux_balance_loss(scores_NE: torch.Tensor, idx_NK: torch.Tensor, num_experts: int, top_k: int, *,
                     seq_len: int | None = None) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (without its coefficient alpha).

    Per sequence of T tokens: f_j = E / (K T) * #(tokens choosing j), P_j = mean_t s'_tj with the
    sigmoid scores normalised per token (s' = s / sum_j s), loss = sum_j f_j P_j; averaged over
    sequences. `seq_len=None` treats all N tokens as one sequence (a batch-wise loss). Equals 1 under
    perfectly uniform routing. Gradients flow through `scores_NE` only.
    """
    N, E = scores_NE.shape
    T = N if seq_len is None else seq_len
    if N % T:
        raise ValueError(f"{N} tokens are not a whole number of sequences of {T}")
    s_NE = upcast(scores_NE)
    p_NE = s_NE / (s_NE.sum(-1, keepdim=True) + 1e-20)
    onehot_NE = torch.zeros(N, E, dtype=s_NE.dtype, device=s_NE.device)
    onehot_NE.scatter_(1, idx_NK, 1.0)
    f_SE = onehot_NE.view(N // T, T, E).sum(1) * (num_experts / (top_k * T))
    P_SE = p_NE.view(N // T, T, E).mean(1)
    return (f_SE * P_SE).sum(-1).mean()


class RoutingRecorder:
    """Switches on routing recording in every `SparseMoE` of a model and collects, per MoE layer (by
    module name), the detached (scores_NE, idx_NK) of each forward since the last `clear()` (so the
    micro-batches of one optimizer step pool into one QB update).

    `keep_inputs=True` also keeps each layer's (grad-carrying) input so `aux_loss` can recompute the
    router scores with gradients. Use as a context manager or with `enable()` / `disable()`.
    Forwards that activation checkpointing re-runs inside backward are not recorded (they repeat a
    micro-batch's routing; under pipeline stages they interleave with the next micro-batches' forwards).
    """

    def __init__(self, model: nn.Module, *, keep_inputs: bool = False) -> None:
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, SparseMoE)}
        self.keep_inputs = keep_inputs
        self.records: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in self.layers}
        self.inputs: dict[str, list[torch.Tensor]] = {n: [] for n in self.layers}
        self._handles: list = []

    def _hook(self, name: str):
        def hook(module, args, output):
            if torch._C._current_graph_task_id() != -1:
                return  # a forward re-run inside backward (activation checkpointing): not a new micro-batch
            self.records[name].append(module.last_routing)
            if self.keep_inputs:
                self.inputs[name].append(args[0])
        return hook

    def keep_last(self, n: int) -> None:
        """Keep each layer's last `n` records: torch's pipeline stage runs a forward of its own before the first
        step (shape inference), which is not a micro-batch of the step."""
        for name in self.layers:
            del self.records[name][:-n or None]
            del self.inputs[name][:-n or None]

    def enable(self) -> RoutingRecorder:
        if not self._handles:
            for n, m in self.layers.items():
                m.record_routing = True
                self._handles.append(m.register_forward_hook(self._hook(n)))
        return self

    def disable(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self.layers.values():
            m.record_routing = False
            m.__dict__.pop("last_routing", None)

    def __enter__(self) -> RoutingRecorder:
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.disable()

    def clear(self) -> None:
        for n in self.layers:
            self.records[n].clear()
            self.inputs[n].clear()

    def routing(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores_NE, idx_NK) of layer `name`, concatenated over the recorded forwards."""
        recs = self.records[name]
        if not recs:
            raise ValueError(f"nothing recorded for {name}")
        return torch.cat([r[0] for r in recs]), torch.cat([r[1] for r in recs])

    def aux_loss(self, *, seq_len: int | None = None) -> torch.Tensor:
        """Mean over MoE layers (and recorded forwards) of `aux_balance_loss`, with router scores
        recomputed (with grad) from the kept inputs; sequence-wise over each input's rows unless
        `seq_len` is given. Needs `keep_inputs=True`; multiply by a small coefficient, add to the loss."""
        if not self.keep_inputs:
            raise ValueError("RoutingRecorder(keep_inputs=True) is needed for the auxiliary loss")
        losses = []
        for n, m in self.layers.items():
            for x_BTD, (_, idx_NK) in zip(self.inputs[n], self.records[n]):
                x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
                scores_NE = torch.sigmoid(upcast(x_ND) @ upcast(m.gate.weight).t())
                T = x_BTD.shape[1] if seq_len is None else seq_len
                losses.append(aux_balance_loss(scores_NE, idx_NK, m.gate.weight.shape[0], m.top_k, seq_len=T))
        if not losses:
            raise ValueError("nothing recorded")
        return torch.stack(losses).mean()


@torch.no_grad()
def apply_quantile_balancing(model: nn.Module, recorder: RoutingRecorder, rate: float = 1.0,
                             gather=None) -> dict[str, dict]:
    """One QB step for every MoE layer of `model` from what `recorder` collected, then `recorder.clear()`.

    Returns per-layer `load_stats` of the recorded routing (the loads *before* this update), keyed
    by module name, for logging. Layers with nothing recorded are skipped. `gather` (data parallelism:
    `Mesh.all_gather_rows`) concatenates every rank's scores in rank order, so each rank computes the
    update of the global batch, exactly the single-process one (background B.6's exact mode; the scores
    are N x E floats per layer, small at the sizes this runs).
    """
    stats = {}
    for n, m in model.named_modules():
        if not isinstance(m, SparseMoE) or not recorder.records.get(n):
            continue
        scores_NE, idx_NK = recorder.routing(n)
        if gather is not None:
            scores_NE, idx_NK = gather(scores_NE), gather(idx_NK)
        bias = m.gate.e_score_correction_bias
        stats[n] = load_stats(idx_NK, bias.shape[0])
        bias.copy_(quantile_balance_update(scores_NE, bias, m.top_k, rate))
    recorder.clear()
    return stats


@torch.no_grad()
def apply_sign_balancing(model: nn.Module, recorder: RoutingRecorder, rate: float = 1e-3,
                         reduce=None) -> dict[str, dict]:
    """One sign-rule step (module doc) for every MoE layer of `model` from what `recorder` collected, then
    `recorder.clear()`; the counterpart of `apply_quantile_balancing`, with the same return value (per-layer
    `load_stats` of the loads before this update). `rate` 0 only measures.

    `reduce` (data parallelism: `Mesh.all_reduce_sum`, summing a tensor over the ranks in place): the rule
    reads nothing but the per-expert counts, so an all-reduce of the E counts of each layer gives every rank
    the global batch's loads and the same update, exactly the single-process one (no gather of scores, as
    QB needs).
    """
    stats = {}
    for n, m in model.named_modules():
        if not isinstance(m, SparseMoE) or not recorder.records.get(n):
            continue
        bias = m.gate.e_score_correction_bias
        load_E = expert_load(recorder.routing(n)[1], bias.shape[0])
        if reduce is not None:
            load_E = reduce(load_E)
        stats[n] = stats_of_load(load_E)
        if rate:
            bias.copy_(sign_balance_update(load_E, bias, rate))
    recorder.clear()
    return stats
