"""On-policy RL for one (domain, effort) cell: a teacher of issue 18's stage 2 (background §3.5).

    rl(RLConfig(model="runs/sft", domain="general", effort="high", steps=200), "runs/t-general-high")

Each step:
1. draw `prompts_per_step` problems of the cell (`trainers.problems.ProblemSource`: deterministic in (seed, step),
   with the step's think budget, annealed when `budget_from_effort` is set);
2. sample `group_size` trajectories per problem through the inference `Engine` (`rollout.rollout`), which
   runs on the very modules being trained, so every step samples from the weights the last optimizer
   step wrote; each sampled token keeps its behaviour log-prob;
3. reward = the verifier's task reward, or -1 over the think budget, or 0 on a format failure;
4. the trainer's forward in float32 over the full sequences gives the log-probs of the generated tokens
   (at the sampling temperature); env, tool and prompt tokens carry no loss;
5. the loss: `kimi` (K2's policy-mirror-descent square, `losses.kimi_pmd_loss`, with pi_old = the sampler's
   log-probs, so the tau * log-ratio term carries any sampler/trainer mismatch) or `grpo`
   (`losses.grpo_loss`: group baseline, PPO clip-higher, token mean over the batch's generated tokens,
   importance weights between the sampler's and the trainer's log-probs, `is_mode`);
6. one optimizer step (Muon for matrices + AdamW, `openk3.train.optim`), its size scaled by the gradient norm
   against its running mean, never below `update_ref` (`onpolicy.signal_step`), none when no group's rewards
   vary; the router's selection bias (Quantile Balancing) is a buffer no RL step touches: it stays frozen
   (background §5.3).

Logged per step to <out>/metrics.jsonl: reward, task reward, over-budget and format-failure rates, think
length (mean, p90), budget, entropy of the trainer's distribution on generated tokens, mismatch KL
(sampler vs trainer), zero-variance-group fraction, loss, gradient norm, update scale, skipped, the loss's own
stats, timings.
<out>/rollouts/step_NNNNNN.jsonl keeps the step's rollout records. Checkpoints (<out>/checkpoints, release
format + trainer_state.pt: optimizer, step, config, RNG) are atomic; a killed run resumes from the last one
and continues exactly as the uninterrupted run would (problems and sampler seeds depend on the step only).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from openk3.chat import THINKING_EFFORTS
from openk3.posttrain.domains.budget import B_FLOOR, BudgetConfig
from openk3.posttrain.domains.records import DOMAINS
from openk3.posttrain.trainers import losses
from openk3.posttrain.trainers.onpolicy import (
    OnPolicyConfig,
    OnPolicyJob,
    drive,
    open_run,
    optimizer_for,
    signal_step,
)
from openk3.posttrain.trainers.problems import ProblemSource
from openk3.posttrain.trainers.rollout import RolloutConfig, rollout

LOSSES = ("kimi", "grpo")
CONFIG_FILE = "rl_config.json"
#: Settings a resumed run may change (they do not alter what the finished steps computed).
RESUMABLE_CHANGES = ("steps", "save_every", "model",  # a resume reads the run's own checkpoint, not --model
                     "micro_tokens")  # the same gradients in other pieces


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig(OnPolicyConfig):
    """The on-policy section (`OnPolicyConfig`: steps, prompts and group per step, lr, sampling limits, problems,
    seed, checkpoints, engine, memory) plus RL's cell, loss and budgets."""

    KIND = "rl"
    MIN_GROUP = 2  # a group baseline needs two samples

    model: str = ""  # the starting checkpoint (SFT, or the previous effort's teacher when annealing)
    domain: str = "general"
    effort: str = "high"
    loss: str = "kimi"
    # kimi
    tau: float = 1.0
    # grpo
    baseline: str = "mean"
    std: str = "batch"  # DLER / REINFORCE++-baseline: preferred with budget truncation (background §2.3)
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_mode: str = "tis"
    is_bounds: tuple[float, float] = (0.5, 2.0)
    # sampling and budgets
    temperature: float = 1.0
    budget_from_effort: str | None = None
    anneal_fraction: float = 0.5
    b_floor: int = B_FLOOR
    budget_cap: int | None = None  # a ceiling on every budget (the think tokens a sampler can afford); None: none

    def check(self) -> None:
        super().check()
        bad = self.bad
        for field, allowed in (("domain", DOMAINS), ("effort", THINKING_EFFORTS), ("loss", LOSSES),
                               ("baseline", losses.BASELINES), ("std", losses.STD_MODES),
                               ("is_mode", losses.IS_MODES)):
            if getattr(self, field) not in allowed:
                raise bad(field, f"one of {list(allowed)}")
        if self.budget_from_effort is not None and self.budget_from_effort not in THINKING_EFFORTS:
            raise bad("budget_from_effort", f"one of {list(THINKING_EFFORTS)} or None")
        if isinstance(self.b_floor, bool) or not isinstance(self.b_floor, int) or self.b_floor < 0:
            raise bad("b_floor", "an integer >= 0")
        for field in ("tau", "temperature"):
            if not getattr(self, field) > 0:
                raise bad(field, "> 0")
        if not 0 < self.anneal_fraction <= 1:
            raise bad("anneal_fraction", "in (0, 1]")
        if self.budget_cap is not None and (isinstance(self.budget_cap, bool) or not isinstance(self.budget_cap, int)
                                            or self.budget_cap < max(1, self.b_floor)):
            raise bad("budget_cap", f"an integer >= max(1, b_floor = {self.b_floor}) or None")
        object.__setattr__(self, "is_bounds", tuple(self.is_bounds))



# ---- batches and log-probs ---------------------------------------------------------------------------


def make_batch(records: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded tensors of a step's records, aligned on *targets* (position t scores token t + 1):
    ids_BT [B, T], mask_BT [B, T-1] (1 where token t+1 was sampled by the policy), behaviour_BT [B, T-1]
    (its behaviour log-prob there, 0 elsewhere), rewards_B."""
    T = max(len(r["token_ids"]) for r in records)
    B = len(records)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T - 1, dtype=torch.bool)
    behaviour = torch.zeros(B, T - 1, dtype=torch.float32)
    for b, r in enumerate(records):
        n = len(r["token_ids"])
        ids[b, :n] = torch.tensor(r["token_ids"])
        gen = torch.tensor(r["gen_mask"][1:], dtype=torch.bool)
        if int(gen.sum()) != len(r["behaviour_logprobs"]) or r["gen_mask"][0]:
            raise ValueError(f"rollout record {r.get('id')!r}: {len(r['behaviour_logprobs'])} behaviour log-probs "
                             f"for {sum(r['gen_mask'])} generated tokens")
        mask[b, :n - 1] = gen
        behaviour[b, :n - 1][gen] = torch.tensor(r["behaviour_logprobs"], dtype=torch.float32)
    rewards = torch.tensor([float(r["reward"]) for r in records], dtype=torch.float32)
    return {"ids_BT": ids, "mask_BT": mask, "behaviour_BT": behaviour, "rewards_B": rewards}


def token_logprobs(model, ids_BT: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of ids[:, 1:] under `model` at `temperature` [B, T-1] with grad, their entropy [B, T-1]
    detached), in float32 whatever the model's dtype (ratios of bf16 log-probs round badly, §5.3)."""
    logits = model(ids_BT)[:, :-1].float()
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, ids_BT[:, 1:, None])[..., 0]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def row_chunks(mask_BT: torch.Tensor, micro_tokens: int | None) -> list[tuple[int, int, int]]:
    """(first row, end row, positions) of each micro-batch: consecutive rows, at most `micro_tokens` padded
    tokens each (at least one row), cut to the last position any of its rows trains on (right padding past it
    changes nothing before it: causal); one chunk of the whole batch when `micro_tokens` is None or it fits."""
    B, T = mask_BT.shape[0], mask_BT.shape[1] + 1
    pos = torch.arange(1, T, device=mask_BT.device)
    need_B = torch.where(mask_BT, pos, 0).amax(-1).add(1).clamp(min=2).tolist()  # ids up to the last target
    if micro_tokens is None or B * T <= micro_tokens:
        return [(0, B, T)]
    out, start = [], 0
    while start < B:
        end, n = start + 1, need_B[start]
        while end < B and (end + 1 - start) * max(n, need_B[end]) <= micro_tokens:
            n = max(n, need_B[end])
            end += 1
        out.append((start, end, n))
        start = end
    return out


@torch.no_grad()
def policy_logprobs(model, ids_BT: torch.Tensor, mask_BT: torch.Tensor, *, temperature: float = 1.0,
                    micro_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of ids[:, 1:] [B, T-1] in float32 without grad, in the row chunks of `row_chunks`
    (zeros past each chunk's last trained position)."""
    B, T1 = mask_BT.shape
    logp = torch.zeros(B, T1, dtype=torch.float32, device=ids_BT.device)
    entropy = torch.zeros(B, T1, dtype=torch.float32, device=ids_BT.device)
    for a, b, n in row_chunks(mask_BT, micro_tokens):
        lp, ent = token_logprobs(model, ids_BT[a:b, :n], temperature)
        logp[a:b, :n - 1], entropy[a:b, :n - 1] = lp.float(), ent.float()
    return logp, entropy


def policy_backward(model, ids_BT: torch.Tensor, mask_BT: torch.Tensor, loss_fn, *, temperature: float = 1.0,
                    micro_tokens: int | None = None) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    """Backward of `loss_fn(logp_BT) -> (loss, stats)` through the policy's token log-probs into `model`'s
    gradients; returns (loss detached, stats, logp_BT detached, entropy_BT).

    Whole batch (`micro_tokens` None, or it fits): one forward with grad. Otherwise in micro-batches of at most
    `micro_tokens` padded tokens, exactly: a forward without grad gives every log-prob, the loss and its
    gradient with respect to them (d loss / d logp, [B, T-1]) come from that, then each micro-batch runs
    forward again with grad and back-propagates its slice of that gradient. The RL and MOPD losses couple
    rows (group baselines, one normaliser over the batch), so slicing the loss itself would change it; this
    does not (an extra forward pass costs ~1/3 of a step: the price of not holding every row's activations)."""
    chunks = row_chunks(mask_BT, micro_tokens)
    if len(chunks) == 1 and chunks[0][2] == ids_BT.shape[1]:
        logp, entropy = token_logprobs(model, ids_BT, temperature)
        loss, stats = loss_fn(logp)
        loss.backward()
        return loss.detach(), stats, logp.detach(), entropy
    logp, entropy = policy_logprobs(model, ids_BT, mask_BT, temperature=temperature, micro_tokens=micro_tokens)
    leaf = logp.clone().requires_grad_()
    loss, stats = loss_fn(leaf)
    loss.backward()
    grad = leaf.grad
    for a, b, n in chunks:
        lp, _ = token_logprobs(model, ids_BT[a:b, :n], temperature)
        lp.backward(grad[a:b, :n - 1].to(lp.dtype))
    return loss.detach(), stats, logp, entropy


def masked_mean(x: torch.Tensor, m: torch.Tensor) -> float:
    n = int(m.sum())
    return float(torch.where(m, x, 0).sum() / n) if n else 0.0


def compute_loss(cfg: RLConfig, logp: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
    """The step's loss and its stats (see the module docstring, step 5)."""
    mask, behaviour, rewards = batch["mask_BT"], batch["behaviour_BT"], batch["rewards_B"]
    if cfg.loss == "kimi":
        return losses.kimi_pmd_loss(logp, behaviour, mask, rewards, cfg.group_size, tau=cfg.tau)
    return losses.grpo_loss(logp, logp.detach(), mask, rewards, cfg.group_size, baseline=cfg.baseline, std=cfg.std,
                            clip_low=cfg.clip_low, clip_high=cfg.clip_high, norm=float(max(int(mask.sum()), 1)),
                            sampler_logp_BT=behaviour, is_mode=cfg.is_mode, is_bounds=cfg.is_bounds)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]) if ordered else 0.0


def rollout_stats(records: list[dict], group_size: int) -> dict[str, float]:
    rewards = [r["reward"] for r in records]
    think = [r["think_tokens"] for r in records]
    groups = [rewards[i:i + group_size] for i in range(0, len(rewards), group_size)]
    n = len(records)
    return {
        "reward": sum(rewards) / n,
        "task_reward": sum(r["reward_components"]["task"] for r in records) / n,
        "over_budget_rate": sum(r["think_tokens"] > r["budget_think_tokens"] for r in records) / n,
        "format_fail_rate": sum(r["reward_components"]["format"] == 0 for r in records) / n,
        "think_mean": sum(think) / n,
        "think_p90": _p90(think),
        "budget_mean": sum(r["budget_think_tokens"] for r in records) / n,
        "gen_tokens_mean": sum(sum(r["gen_mask"]) for r in records) / n,
        "zero_variance_frac": sum(max(g) == min(g) for g in groups) / len(groups),
        "invalid_calls": sum(r["reward_components"]["invalid_calls"] for r in records),
    }


def rl_step(cfg: RLConfig, model, opt, engine, problems: list, tokenizer, roll_cfg: RolloutConfig,
            step: int, rewards_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None
            ) -> tuple[list[dict], dict]:
    """One RL step on `problems`: sample (through `engine`, which runs on `model`), reward, score in fp32,
    loss, optimizer step. Returns the rollout records and the step's metrics (`step` is 0-based; the
    metrics say step + 1, the number of steps of the run).

    A batch without a learning signal — every group's rewards equal, so every advantage is zero — takes no
    optimizer step (`"skipped": 1`, the weights and the optimizer state untouched): Muon's update has a fixed
    norm and a fresh AdamW's first one is about lr * sign(g), so stepping on the numerical residue of a zero
    advantage would move every matrix as far as a real signal does.

    `rewards_fn(rewards_B, step)`: what the loss sees instead of the batch's rewards (an experiment's control
    arm: `openk3 experiment rl-heldout` shuffles them); the records and logged rewards stay the true ones."""
    if roll_cfg.group_size != cfg.group_size:
        raise ValueError(f"rl_step: rollout group_size {roll_cfg.group_size} != the loss's {cfg.group_size}")
    t0 = time.perf_counter()
    records = rollout(engine, problems, tokenizer, roll_cfg, policy_version=step)
    t1 = time.perf_counter()
    batch = make_batch(records)
    if rewards_fn is not None:
        batch["rewards_B"] = rewards_fn(batch["rewards_B"], step)
    signal = losses.rewards_vary(batch["rewards_B"], cfg.group_size)
    model.train()
    if signal:
        opt.zero_grad()
        loss, stats, logp, entropy = policy_backward(model, batch["ids_BT"], batch["mask_BT"],
                                                     lambda lp: compute_loss(cfg, lp, batch),
                                                     temperature=cfg.temperature, micro_tokens=cfg.micro_tokens)
        grad_norm, scale = signal_step(opt, cfg.update_ref)
    else:  # the metrics still describe the batch under the (unchanged) policy
        logp, entropy = policy_logprobs(model, batch["ids_BT"], batch["mask_BT"], temperature=cfg.temperature,
                                        micro_tokens=cfg.micro_tokens)
        loss, stats, grad_norm, scale = torch.zeros(()), {}, 0.0, 0.0
    model.eval()
    mask = batch["mask_BT"]
    metrics = {"step": step + 1, **rollout_stats(records, roll_cfg.group_size), "loss": float(loss),
               "entropy": masked_mean(entropy, mask),
               "mismatch_kl": masked_mean(batch["behaviour_BT"] - logp, mask),
               "grad_norm": grad_norm, "update_scale": scale, "lr": cfg.lr, "skipped": int(not signal),
               **{f"loss_{k}": v for k, v in stats.items() if isinstance(v, (int, float))},
               "rollout_s": t1 - t0, "train_s": time.perf_counter() - t1}
    return records, metrics


# ---- the run -----------------------------------------------------------------------------------------


def rl(cfg: RLConfig, out_dir: str | os.PathLike, *, on_step: Callable[[int, dict], None] | None = None,
       sandbox_options: dict | None = None, progress: bool = True) -> dict:
    """Run (or resume) RL for `cfg.steps` optimizer steps into `out_dir`; returns the last step's metrics.

    on_step(step, metrics) is called after each step's metrics are logged (before its checkpoint).
    """
    from openk3.log import reporter

    out = Path(out_dir)
    report = reporter("rl")
    run = open_run(out, cfg, config_file=CONFIG_FILE, start_field="model", missing="no starting model: give --model",
                   resumable=RESUMABLE_CHANGES, report=report)
    cfg, model, tok = run.cfg, run.model, run.tok
    torch.manual_seed(cfg.seed)
    opt = optimizer_for(model, cfg.lr, cfg.grad_clip, run.state)
    budget = BudgetConfig(b_floor=cfg.b_floor, cap=cfg.budget_cap, anneal_fraction=cfg.anneal_fraction)
    source = ProblemSource(cfg.domain, cfg.effort, tok, split=cfg.split, seed=cfg.seed, budget=budget,
                           budget_from=cfg.budget_from_effort, max_turns=cfg.max_turns,
                           sandbox_options=sandbox_options, levels=cfg.levels)
    engine = cfg.engine(model)
    roll_cfg = dict(group_size=cfg.group_size, temperature=cfg.temperature, response_cap=cfg.response_cap)

    def step_fn(problems: list, step: int) -> tuple[list[dict], dict]:
        roll = RolloutConfig(seed=cfg.seed * 100_003 + step, **roll_cfg)
        return rl_step(cfg, model, opt, engine, problems, tok, roll, step)

    def line(m: dict) -> str:
        return (f"reward {m['reward']:.3f}, over budget {m['over_budget_rate']:.2f}, think {m['think_mean']:.1f}, "
                f"loss {m['loss']:.4g}")

    job = OnPolicyJob("rl", out, run, opt, draw=lambda step: source.draw(step, cfg.prompts_per_step, cfg.steps),
                      step_fn=step_fn, release=source.release, line=line)
    return drive(job, cfg.steps, cfg.save_every, report, on_step, what="RL", progress=progress)
