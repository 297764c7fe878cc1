"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, per-request seed.

Order of operations for one row of logits (the HF `generate` convention):
repetition penalty -> (greedy argmax if temperature == 0) -> temperature -> top-k -> top-p -> min-p ->
softmax -> one multinomial draw from the request's own `torch.Generator`. Sampling is computed in fp32;
masked entries are -inf (`sampling_logits`, for "processed" log-probs, keeps the logits' precision but the
sampler's fp32 kept set). Each request owns its generator, so its tokens depend only on its seed and its
logits, never on which other requests share the batch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from openk3.infer.structured import Structured

#: A temperature below this samples greedily (vLLM's _SAMPLING_EPS); the least repetition penalty.
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 0.01
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling settings. temperature=0 means greedy; top_k=0, top_p=1, min_p=0 and
    repetition_penalty=1 are "off"; seed=None draws a random seed. logprobs=None returns no log
    probabilities; k >= 0 returns, per generated token, its log probability and the k most likely
    tokens' (`token_logprobs`). logprobs_mode: "raw" (the model's log_softmax, whatever the sampling
    settings; vLLM's default) or "processed" (of the distribution the token was drawn from: repetition
    penalty, temperature and the top-k/top-p/min-p filters applied, `sampling_logits`; a greedy row gets
    its logits after the repetition penalty alone, raw when it has none), which is what an RL trainer's
    importance correction needs. structured: a grammar the output must match (`openk3.infer.structured`;
    `Structured.of({"json": schema})` and the like); None = unconstrained."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    structured: Structured | None = None

    def __post_init__(self) -> None:
        def bad(field: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{field} must be {rule}, got {getattr(self, field)!r}")

        if not 0 <= self.temperature < math.inf:  # also rejects NaN; inf would silently sample uniformly
            raise bad("temperature", ">= 0 and finite")
        if self.temperature < MIN_TEMPERATURE:  # greedy, as vLLM: fp32 logits / ~1e-38 overflow to inf -> NaN
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not 0 <= self.min_p < 1:
            raise bad("min_p", "in [0, 1)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an int >= 0")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty < math.inf:  # it divides logits: the same overflow
            raise bad("repetition_penalty", f">= {MIN_REPETITION_PENALTY} and finite")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "an int or None")
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "a tuple of strings")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise bad("logprobs", "None or an int >= 0")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise bad("logprobs_mode", f"one of {', '.join(map(repr, LOGPROBS_MODES))}")
        if self.structured is not None and not isinstance(self.structured, Structured):
            raise bad("structured", "None or a Structured (Structured.of(spec) builds one)")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A `torch.Generator` on `device` seeded with `seed` (None -> 63 random bits from os.urandom)."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _ids(seen_ids: Iterable[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(seen_ids, torch.Tensor):
        t = seen_ids.reshape(-1).to(device=device, dtype=torch.long)
    else:
        t = torch.tensor(list(seen_ids), dtype=torch.long, device=device)
    return torch.unique(t)


def apply_repetition_penalty(
    logits_V: torch.Tensor, seen_ids: Iterable[int] | torch.Tensor, penalty: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """CTRL / HF repetition penalty: for each distinct seen token, a positive logit is divided by `penalty`
    and a negative one multiplied by it. Returns a new tensor of `dtype` (fp32, as the sampler computes);
    the input is left untouched."""
    out = logits_V.to(dtype=dtype, copy=True)
    if penalty == 1.0:
        return out
    ids = _ids(seen_ids, out.device)
    if ids.numel() == 0:
        return out
    picked = out[ids]
    out[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return out


def _mask_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= x.shape[-1]:
        return x
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[torch.topk(x, k).indices] = True
    return x.masked_fill(~keep, float("-inf"))


def _mask_top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return x
    probs = torch.softmax(x, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
    keep_sorted = before < top_p  # the minimal prefix whose mass reaches top_p
    keep_sorted[0] = True  # never empty
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return x.masked_fill(~keep, float("-inf"))


def _mask_min_p(x: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return x
    probs = torch.softmax(x, dim=-1)
    return x.masked_fill(probs < min_p * probs.max(), float("-inf"))  # the max itself always survives


def filter_logits(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p (nucleus), min-p, on a 1-D row of logits. Returns fp32 logits whose
    dropped entries are -inf; softmax of the result is the sampling distribution. temperature == 0 skips
    the scaling (greedy callers take the argmax, which the filters never remove)."""
    if logits_V.dim() != 1:
        raise ValueError(f"filter_logits expects a 1-D row of logits, got shape {tuple(logits_V.shape)}")
    x = logits_V.float()
    if params.temperature > 0 and params.temperature != 1.0:
        x = x / params.temperature
    x = _mask_top_k(x, params.top_k)
    x = _mask_top_p(x, params.top_p)
    x = _mask_min_p(x, params.min_p)
    return x


def sampling_logits(logits_V: torch.Tensor, params: SamplingParams,
                    seen_ids: Iterable[int] | torch.Tensor = ()) -> torch.Tensor:
    """The logits whose softmax `sample_next` draws from (repetition penalty, temperature, top-k/top-p/min-p;
    dropped entries -inf), for `logprobs_mode="processed"`. The values keep the logits' precision (at least
    fp32); the kept set is the sampler's own, decided in fp32 (a float64 tie that fp32 rounds together must
    not drop the token the sampler drew). Greedy params: the logits after the repetition penalty alone."""
    dtype = torch.promote_types(logits_V.dtype, torch.float32)
    x = apply_repetition_penalty(logits_V, seen_ids, params.repetition_penalty, dtype=dtype)
    if params.greedy:
        return x
    kept = filter_logits(x if dtype == torch.float32 else
                         apply_repetition_penalty(logits_V, seen_ids, params.repetition_penalty), params)
    if dtype == torch.float32:  # the sampler's own fp32 logits are already the answer
        return kept
    if params.temperature != 1.0:
        x = x / params.temperature
    return x.masked_fill(kept == float("-inf"), float("-inf"))


def sample_next(
    logits_V: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    seen_ids: Iterable[int] | torch.Tensor = (),
) -> int:
    """One next token from a 1-D row of logits. Greedy (temperature == 0): argmax, ties -> lowest id, no
    randomness consumed. Otherwise one draw from softmax(filter_logits(...)) using `generator`."""
    if logits_V.dim() != 1:
        raise ValueError(f"sample_next expects a 1-D row of logits, got shape {tuple(logits_V.shape)}")
    x = apply_repetition_penalty(logits_V, seen_ids, params.repetition_penalty)
    if params.greedy:
        return int(torch.argmax(x))  # torch documents: first maximal index
    probs = torch.softmax(filter_logits(x, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits_nV: torch.Tensor, token_ids: Sequence[int], k: Sequence[int]
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row: (log probability of `token_ids[i]`, the `k[i]` most likely (id, log probability) pairs, most
    likely first; equal values by lowest id), log_softmax of the rows given. The engine gives it the raw
    logits (vLLM's default `raw_logprobs`: what the model predicts, whatever the request's sampling
    settings), or `sampling_logits` for a request with logprobs_mode="processed"."""
    if logits_nV.dim() != 2 or not len(token_ids) == len(k) == logits_nV.shape[0]:
        raise ValueError(f"token_logprobs: logits of shape {tuple(logits_nV.shape)} for {len(token_ids)} tokens "
                         f"and {len(k)} k values")
    # fp32 at least (bf16 logits lose the tail); a float64 model keeps float64.
    lp = torch.log_softmax(logits_nV.to(torch.promote_types(logits_nV.dtype, torch.float32)), dim=-1)
    picked = lp.gather(1, torch.tensor(token_ids, device=lp.device).view(-1, 1))[:, 0].tolist()
    top = min(max(k, default=0), lp.shape[-1])
    if top == 0:
        return [(p, []) for p in picked]
    # A stable descending sort puts equal values in id order (topk leaves ties in no documented order).
    vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
    vals, ids = vals[:, :top].tolist(), ids[:, :top].tolist()
    return [(p, list(zip(i[:kk], v[:kk], strict=True))) for p, i, v, kk in zip(picked, ids, vals, k, strict=True)]


def sample_batch(
    logits_BV: torch.Tensor,
    params_list: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    seen_list: Sequence[Iterable[int] | torch.Tensor] | None = None,
) -> list[int]:
    """Row-by-row `sample_next` over a [B, V] batch; each row uses its own params and generator, so a row's
    token is the same whatever else is in the batch."""
    if logits_BV.dim() != 2:
        raise ValueError(f"sample_batch expects [B, V] logits, got shape {tuple(logits_BV.shape)}")
    B = logits_BV.shape[0]
    if seen_list is None:
        seen_list = [()] * B
    if not len(params_list) == len(generators) == len(seen_list) == B:
        raise ValueError(
            f"sample_batch: {B} rows but {len(params_list)} params, {len(generators)} generators, "
            f"{len(seen_list)} seen lists"
        )
    return [sample_next(logits_BV[b], params_list[b], generators[b], seen_list[b]) for b in range(B)]
