"""Policy losses for post-training: the RL teachers' `kimi_pmd` and `grpo`, and MOPD's distillation loss.

Pure torch functions on per-token tensors of sampled tokens; nothing here samples, scores or steps.
Every loss returns `(loss, stats)`: a scalar to minimise and a dict of detached floats / tensors to log.
The math runs in float32 (float64 inputs stay float64, for gradient checks): importance ratios of
bf16 log-probs overflow and round badly (background §5.3).

Legend: B sampled trajectories, T token positions (padded), G samples per prompt (a group; the G
samples of a prompt are contiguous, so B = P * G for P prompts).

Inputs shared by the losses:
    logp_BT       log pi_theta(y_t | ...) of each sampled token under the policy being trained (with grad)
    old_logp_BT   the same under the policy that sampled them (pi_old / behaviour), no grad
    mask_BT       1 on tokens the policy generated (the trained tokens), 0 on prompt, tool output, padding
    rewards_B     one scalar reward per trajectory (verifier reward, budget penalty included)

Values at masked positions are never used (they may be padding garbage, even -inf): every use goes
through `torch.where` on the mask, not a multiplication, so NaN * 0 cannot leak into a loss.

Background: `shared/context/next-post-training.md` §1.2-1.3 (MOPD, Kimi PMD), §2.1-2.2 (OPD and the
GRPO family), §3.5-3.6 (our defaults), §5.3-5.4 (sampler/trainer and teacher/student mismatch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from openk3.chat import THINKING_EFFORTS
from openk3.common import upcast

BASELINES = ("mean", "rloo")
STD_MODES = ("none", "group", "batch")
IS_MODES = ("tis", "icepop", "none")

Cell = tuple[str, str]  # (domain, effort)
Teacher = TypeVar("Teacher")


def _f(x: torch.Tensor) -> torch.Tensor:
    return upcast(x)


def _check_tokens(logp_BT: torch.Tensor, **others: torch.Tensor | None) -> None:
    if logp_BT.dim() != 2:
        raise ValueError(f"log-probs must be [B, T], got shape {tuple(logp_BT.shape)}")
    for name, t in others.items():
        if t is not None and tuple(t.shape) != tuple(logp_BT.shape):
            raise ValueError(f"{name} must have the log-probs' shape {tuple(logp_BT.shape)}, got {tuple(t.shape)}")


def _groups(rewards_B: torch.Tensor, group_size: int, B: int) -> torch.Tensor:
    """rewards as [P, G] (float32 or float64), after checking the grouping."""
    if rewards_B.dim() != 1 or rewards_B.shape[0] != B:
        raise ValueError(f"rewards must be [B] with B = {B} trajectories, got shape {tuple(rewards_B.shape)}")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an integer >= 2 (samples per prompt), got {group_size!r}")
    if B % group_size:
        raise ValueError(f"{B} trajectories do not split into groups of group_size={group_size}")
    return _f(rewards_B).detach().reshape(-1, group_size)


def rewards_vary(rewards_B: torch.Tensor, group_size: int) -> bool:
    """Whether any group's rewards differ: the outcome signal a group baseline can learn from (a batch where no
    group's do is skipped by RL and by MOPD's outcome mixing)."""
    r_PG = _groups(rewards_B, group_size, rewards_B.shape[0])
    return bool((r_PG.amax(-1) > r_PG.amin(-1)).any())


def _masked_mean(x_BT: torch.Tensor, m_BT: torch.Tensor) -> float:
    n = int(m_BT.sum())
    return float(torch.where(m_BT, x_BT, 0).sum() / n) if n else 0.0


# --- Kimi policy mirror descent (K1.5 / K2) ---------------------------------------------------------


def kimi_pmd_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor, rewards_B: torch.Tensor,
                  group_size: int, *, tau: float = 1.0) -> tuple[torch.Tensor, dict[str, Any]]:
    """K2's policy-mirror-descent squared loss (K2 report §3.2.3; K1.5 derives it), on whole trajectories:

        L = mean_prompts (1/K) sum_i ( r_i - mean_K(r) - tau * log(pi_theta(y_i|x) / pi_old(y_i|x)) )^2

    with K = `group_size` samples per prompt. Choices, each as K2 writes it or as we decided:

    * the log-ratio is the **sequence** one: the sum over the trajectory's generated tokens (mask), no
      length normalisation (K2's pi(y|x));
    * the baseline r-bar is the plain mean of all K rewards, sample i included (K2; it stands in for
      tau * log Z of the closed-form solution pi* ~ pi_old * exp(r / tau));
    * no clipping and no importance weights: the square is the trust region, and pi_old is the
      sampling policy (our sampler and trainer share code; feed the trainer's recomputed log-probs
      as `old_logp_BT` when they may differ);
    * groups whose rewards are all equal are **not** skipped: their residual is -tau * log-ratio, which
      pulls the policy back to pi_old on those prompts (a KL-like anchor; zero gradient at pi_old). Their
      count is logged as `zero_variance_groups`;
    * the mean over the K samples and the prompts, so the loss does not grow with the batch. The
      gradient scales with tau (at pi_theta = pi_old it is -2 tau (r_i - r-bar) grad log pi / B):
      pick the learning rate with tau.

    Stats: `residual_rms`, `seq_logratio_mean`, `zero_variance_groups`, `groups`.
    """
    _check_tokens(logp_BT, old_logp_BT=old_logp_BT, mask_BT=mask_BT)
    if not tau > 0:
        raise ValueError(f"kimi_pmd: tau must be > 0, got {tau!r}")
    r_PG = _groups(rewards_B, group_size, logp_BT.shape[0])
    m = mask_BT.bool()
    diff_BT = torch.where(m, _f(logp_BT) - _f(old_logp_BT).detach(), 0)
    seq_B = diff_BT.sum(-1)
    centred_B = (r_PG - r_PG.mean(-1, keepdim=True)).reshape(-1).to(seq_B.dtype)
    resid_B = centred_B - tau * seq_B
    loss = resid_B.square().mean()
    stats = {
        "residual_rms": float(resid_B.detach().square().mean().sqrt()),
        "seq_logratio_mean": float(seq_B.detach().mean()),
        "zero_variance_groups": int((r_PG.amax(-1) == r_PG.amin(-1)).sum()),
        "groups": r_PG.shape[0],
    }
    return loss, stats


# --- GRPO family ------------------------------------------------------------------------------------


def group_advantages(rewards_B: torch.Tensor, group_size: int, *, baseline: str = "mean",
                     std: str = "none", eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages -> (adv_B, keep_B).

    baseline: "mean" (A = r_i - mean_G r) or "rloo" (leave-one-out, A = r_i - mean_{j != i} r_j =
        G/(G-1) (r_i - mean_G r)). Both sum to zero over each group.
    std: "none" (Dr. GRPO: no division, which would weight prompts by difficulty), "group" (GRPO's
        per-group std) or "batch" (REINFORCE++-baseline / DLER: the std of the centred values over the
        kept samples of the whole batch; preferred with budget truncation, §2.3).
    keep_B is False for every sample of a group whose rewards are all equal ("zero-variance": no
    learning signal, DAPO's dynamic sampling drops them); their advantage is 0.
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    if std not in STD_MODES:
        raise ValueError(f"std must be one of {STD_MODES}, got {std!r}")
    r_PG = _groups(rewards_B, group_size, rewards_B.shape[0] if rewards_B.dim() == 1 else -1)
    G = r_PG.shape[1]
    keep_P = r_PG.amax(-1) != r_PG.amin(-1)
    a_PG = r_PG - r_PG.mean(-1, keepdim=True)
    if baseline == "rloo":
        a_PG = a_PG * (G / (G - 1))
    if std == "group":
        a_PG = a_PG / (r_PG.std(-1, keepdim=True) + eps)
    elif std == "batch" and bool(keep_P.any()):
        kept = a_PG[keep_P]
        a_PG = a_PG / (kept.std() + eps) if kept.numel() > 1 else a_PG
    a_PG = torch.where(keep_P[:, None], a_PG, 0)
    return a_PG.reshape(-1), keep_P[:, None].expand_as(a_PG).reshape(-1)


def importance_weights(trainer_logp_BT: torch.Tensor, sampler_logp_BT: torch.Tensor | None, *, mode: str = "tis",
                       bounds: tuple[float, float] = (0.5, 2.0)) -> torch.Tensor:
    """Per-token correction for sampler/trainer mismatch (background §5.3), detached:
    w = pi_trainer(y_t) / pi_sampler(y_t) of the same weights, where the rollout engine's log-probs
    (`sampler_logp_BT`) and the trainer's recomputation (`trainer_logp_BT`) differ by kernels/precision.

    mode "tis": truncated IS, w = min(ratio, bounds[1]) (verl's TIS); "icepop": w = ratio inside
    [bounds[0], bounds[1]] and 0 outside (a hard gate, NeMo's ICE-POP; the band is our choice [D]);
    "none" or no sampler log-probs: w = 1. Identical log-probs give exactly 1 in every mode.
    """
    if mode not in IS_MODES:
        raise ValueError(f"importance-sampling mode must be one of {IS_MODES}, got {mode!r}")
    lo, hi = bounds
    if not 0 <= lo <= 1 <= hi:
        raise ValueError(f"importance-sampling bounds must satisfy 0 <= low <= 1 <= high, got {bounds!r}")
    trainer = _f(trainer_logp_BT).detach()
    if sampler_logp_BT is None or mode == "none":
        return torch.ones_like(trainer)
    ratio = torch.exp(trainer - _f(sampler_logp_BT).detach().to(trainer.dtype))
    if mode == "tis":
        return ratio.clamp(max=hi)
    return torch.where((ratio >= lo) & (ratio <= hi), ratio, 0)


def grpo_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor, rewards_B: torch.Tensor,
              group_size: int, *, baseline: str = "mean", std: str = "none", clip_low: float = 0.2,
              clip_high: float = 0.28, norm: float | None = None, sampler_logp_BT: torch.Tensor | None = None,
              is_mode: str = "tis", is_bounds: tuple[float, float] = (0.5, 2.0)) -> tuple[torch.Tensor, dict[str, Any]]:
    """A GRPO-family group-relative policy gradient, named honestly (background §2.2, §3.5):

        loss = - sum_{b,t} m_bt * w_bt * min(rho_bt A_b, clip(rho_bt, 1 - clip_low, 1 + clip_high) A_b) / norm

    * A_b from `group_advantages` (`baseline`, `std`); zero-variance groups are skipped (their tokens
      leave the sum) and counted in the stats;
    * rho = pi_theta / pi_old per token, PPO-clipped with clip-higher (DAPO's 0.2 / 0.28);
    * token-level **sum divided by a constant** (Dr. GRPO), not a per-sequence mean (which favours
      long wrong answers): `norm` defaults to B * T, the padded batch; pass B * max_new_tokens to make
      it independent of the batch's padding;
    * no reference KL;
    * w: `importance_weights(old_logp_BT, sampler_logp_BT, mode=is_mode, bounds=is_bounds)` when the
      rollout engine's log-probs are given (then `old_logp_BT` is the trainer's recomputation), else 1.

    Stats: `zero_variance_groups`, `groups`, `clip_frac` (kept tokens whose clipped branch is taken),
    `ratio_mean`, `adv_abs_mean`, and with sampler log-probs `mismatch_kl` (mean sampler - trainer
    log-prob over the generated tokens: a KL(sampler || trainer) estimate) and `is_weight_mean`.
    """
    _check_tokens(logp_BT, old_logp_BT=old_logp_BT, mask_BT=mask_BT, sampler_logp_BT=sampler_logp_BT)
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"grpo: need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low!r}, {clip_high!r}")
    B, n_pos = logp_BT.shape
    norm = float(B * n_pos) if norm is None else norm
    if not norm > 0:
        raise ValueError(f"grpo: norm must be > 0, got {norm!r}")
    adv_B, keep_B = group_advantages(rewards_B, group_size, baseline=baseline, std=std)
    m = mask_BT.bool() & keep_B[:, None]
    logp = _f(logp_BT)
    old = _f(old_logp_BT).detach().to(logp.dtype)
    ratio = torch.exp(torch.where(m, logp - old, 0))
    adv = adv_B.to(logp.dtype)[:, None]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    surr = torch.minimum(ratio * adv, clipped * adv)
    w = importance_weights(old, sampler_logp_BT, mode=is_mode, bounds=is_bounds).to(logp.dtype)
    loss = -torch.where(m, w * surr, 0).sum() / norm
    stats: dict[str, Any] = {
        "zero_variance_groups": int((~keep_B).sum()) // group_size,
        "groups": B // group_size,
        "clip_frac": _masked_mean((clipped * adv < ratio * adv).to(logp.dtype), m),
        "ratio_mean": _masked_mean(ratio.detach(), m),
        "adv_abs_mean": float(adv_B.abs().mean()),
    }
    if sampler_logp_BT is not None:
        gen = mask_BT.bool()
        stats["mismatch_kl"] = _masked_mean(_f(sampler_logp_BT).detach().to(old.dtype) - old, gen)
        stats["is_weight_mean"] = _masked_mean(w, gen)
    return loss, stats


# --- MOPD (multi-teacher on-policy distillation) ----------------------------------------------------


def mopd_advantage(teacher_logp_BT: torch.Tensor, student_behaviour_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                   clip: float | None = 5.0) -> torch.Tensor:
    """K3's per-token MOPD reward (background §1.2): A_t = clip(log pi_T(y_t) - log pi_S,behaviour(y_t), -R, R),
    stop-gradient, 0 on masked tokens (prompt, tool output, padding: the teacher is never asked about
    them). R = `clip` (5.0 by default: K3's value is unknown; None = no clip). The student's log-probs
    are the behaviour ones recorded at sampling (temperature 1), as in NeMo RL and verl's PG-OPD.
    """
    _check_tokens(teacher_logp_BT, student_behaviour_logp_BT=student_behaviour_logp_BT, mask_BT=mask_BT)
    if clip is not None and not clip > 0:
        raise ValueError(f"mopd: clip R must be > 0 (or None for no clip), got {clip!r}")
    teacher = _f(teacher_logp_BT).detach()
    gap = teacher - _f(student_behaviour_logp_BT).detach().to(teacher.dtype)
    if clip is not None:
        gap = gap.clamp(-clip, clip)
    return torch.where(mask_BT.bool(), gap, 0)


def mopd_loss(logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor, teacher_logp_BT: torch.Tensor,
              mask_BT: torch.Tensor, *, clip: float | None = 5.0, ratio_clip: tuple[float, float] | None = None,
              rewards_B: torch.Tensor | None = None, group_size: int | None = None, alpha: float = 0.0,
              norm: float | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """MOPD's policy-gradient loss on dense teacher rewards (background §3.6 step 5):

        loss = - sum_t m_t * A_t * rho_t / N,   rho_t = pi_theta(y_t) / pi_behaviour(y_t)

    * A_t = `mopd_advantage(teacher, behaviour, mask, clip)`: the reward is the sampled token's clipped
      log-ratio only (not a full-vocabulary KL, not cross-entropy on teacher text); no discount;
    * rho is exactly 1 on the first pass over a batch, where the gradient is the plain REINFORCE one;
      when a batch is reused (ppo_epochs > 1) pass `ratio_clip=(0.2, 0.28)` for PPO's clipped surrogate;
    * `alpha` > 0 mixes in an outcome advantage alpha * (r_b - mean of its group) on every generated
      token (MiMo's A_MOPD + alpha A_ORM; needs `rewards_B` and `group_size`; default 0, pure MOPD);
    * N = number of generated tokens in the batch (`norm` overrides it); no reference KL.

    Stats: `reverse_kl` (mean of log pi_S,behaviour - log pi_T over generated tokens: the sampled
    estimate of KL(student || teacher), the progress metric) and its per-trajectory `reverse_kl_B`
    (for per-cell logging), `clipped_frac` / `clipped_frac_B` (share of tokens whose log-ratio hit
    +-R), `ratio_clip_frac`, `adv_mean`.
    """
    _check_tokens(logp_BT, behaviour_logp_BT=behaviour_logp_BT, teacher_logp_BT=teacher_logp_BT, mask_BT=mask_BT)
    m = mask_BT.bool()
    adv = mopd_advantage(teacher_logp_BT, behaviour_logp_BT, mask_BT, clip)
    if alpha:
        if rewards_B is None or group_size is None:
            raise ValueError("mopd: alpha != 0 mixes an outcome advantage and needs rewards_B and group_size")
        r_PG = _groups(rewards_B, group_size, logp_BT.shape[0])
        orm_B = (r_PG - r_PG.mean(-1, keepdim=True)).reshape(-1).to(adv.dtype)
        adv = torch.where(m, adv + alpha * orm_B[:, None], 0)
    logp = _f(logp_BT)
    behaviour = _f(behaviour_logp_BT).detach().to(logp.dtype)
    adv = adv.to(logp.dtype)
    ratio = torch.exp(torch.where(m, logp - behaviour, 0))
    surr = ratio * adv
    ratio_clip_frac = 0.0
    if ratio_clip is not None:
        lo, hi = ratio_clip
        if not (0 <= lo < 1 and hi >= 0):
            raise ValueError(f"mopd: ratio_clip must be (low, high), 0 <= low < 1, high >= 0; got {ratio_clip!r}")
        clipped = ratio.clamp(1 - lo, 1 + hi) * adv
        ratio_clip_frac = _masked_mean((clipped < surr).to(logp.dtype), m)
        surr = torch.minimum(surr, clipped)
    n_tokens = int(m.sum())
    N = float(max(n_tokens, 1)) if norm is None else norm
    if not N > 0:
        raise ValueError(f"mopd: norm must be > 0, got {norm!r}")
    loss = -torch.where(m, surr, 0).sum() / N

    with torch.no_grad():
        rkl_BT = torch.where(m, behaviour - _f(teacher_logp_BT).to(logp.dtype), 0)
        hit_BT = torch.where(m, (rkl_BT.abs() > clip) if clip is not None else torch.zeros_like(m), False)
        per_row = m.sum(-1).clamp(min=1)
        stats = {
            "reverse_kl": float(rkl_BT.sum() / max(n_tokens, 1)),
            "reverse_kl_B": rkl_BT.sum(-1) / per_row,
            "clipped_frac": float(hit_BT.sum() / max(n_tokens, 1)),
            "clipped_frac_B": hit_BT.sum(-1) / per_row,
            "ratio_clip_frac": ratio_clip_frac,
            "adv_mean": float(adv.sum() / max(n_tokens, 1)),
        }
    return loss, stats


def _cell(key: Cell | str, where: str) -> Cell:
    """("general", "low") or "general/low" -> ("general", "low")."""
    if isinstance(key, str):
        parts = tuple(key.split("/"))
    elif isinstance(key, tuple):
        parts = key
    else:
        raise ValueError(f"{where}: a cell is (domain, effort) or 'domain/effort', got {key!r}")
    if len(parts) != 2 or not all(isinstance(p, str) and p for p in parts):
        raise ValueError(f"{where}: a cell is (domain, effort) or 'domain/effort', got {key!r}")
    return parts  # type: ignore[return-value]


def route_teachers(cells: Sequence[Cell | str], teachers: Mapping[Cell | str, Teacher]
                   ) -> dict[Cell, tuple[Teacher, list[int]]]:
    """MOPD routing: every sample goes to the teacher of its own (domain, effort) cell, never an ensemble.

    cells: each sample's cell, ("general", "low") or "general/low" (the report's spelling).
    teachers: cell -> teacher (a model, a scoring function, anything); efforts must be K3's
        (`openk3.chat.THINKING_EFFORTS`).

    Returns {cell: (teacher, [sample indices, ascending])} for the cells present, in order of first
    appearance, so a caller runs one teacher prefill per cell over exactly its samples.
    Raises ValueError naming the sample and its cell when no teacher has that cell, and on a teacher
    key given twice (as a tuple and as a string) or with an unknown effort.
    """
    table: dict[Cell, Teacher] = {}
    for key, teacher in teachers.items():
        cell = _cell(key, "teachers")
        if cell[1] not in THINKING_EFFORTS:
            raise ValueError(f"teachers: cell {'/'.join(cell)} has effort {cell[1]!r}, not one of {THINKING_EFFORTS}")
        if cell in table:
            raise ValueError(f"teachers: cell {'/'.join(cell)} given twice")
        table[cell] = teacher
    routes: dict[Cell, tuple[Teacher, list[int]]] = {}
    for i, key in enumerate(cells):
        cell = _cell(key, f"sample {i}")
        if cell not in table:
            known = ", ".join("/".join(c) for c in table) or "none"
            raise ValueError(f"sample {i}: no teacher for cell {'/'.join(cell)} (teachers: {known})")
        routes.setdefault(cell, (table[cell], []))[1].append(i)
    return routes
