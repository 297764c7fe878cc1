"""MOPD: multi-teacher on-policy distillation of the (domain, effort) teachers into one student (issue 18,
stage 3; background §1.2, §2.1, §3.6, §5.4).

    distill(MOPDConfig(student="runs/sft", teachers={"general/low": "runs/t-gl", ...}, steps=300), "runs/mopd")

Each step:
1. draw `prompts_per_step` cells uniformly over `cells` (deterministic in (seed, step)), then for each cell
   its problems (`trainers.problems.ProblemSource` of that domain and effort: the effort's system message is in
   the prompt, the teacher sees it too). No think budget applies (the teachers encode them): a problem's
   budget is `think_cap` (default the context limit), a safety net whose hits are logged and rewarded 0;
2. the student samples `group_size` trajectories per prompt on-policy through the inference `Engine`
   (temperature 1, top-p 1; agent/coding prompts run in a forked sandbox, as in RL), with behaviour
   log-probs;
3. the samples are grouped by teacher (`losses.route_teachers`: the teacher of each sample's own cell,
   never an ensemble); each teacher scores exactly its samples by one float32 prefill, no sampling, no grad,
   at the temperature it was RL-trained at (`teacher_temperature`, `training_temperature`; `teacher_logprobs`);
4. A_t = clip(log pi_T - log pi_S,behaviour, -R, R) on the sampled tokens only (tool/env/prompt tokens are
   masked; gaps under `adv_floor`, default 0, count as agreement, `floor_gaps`), plus `alpha` * (task reward - group
   mean) when alpha != 0 (`losses.mopd_loss`);
5. loss = -sum_t m_t A_t rho_t / N_tokens, rho the ratio to the behaviour policy (1 on the first pass; with
   `ppo_epochs` > 1 the batch is reused with PPO's clipped ratio `ratio_clip`); one optimizer step per pass
   (Muon + AdamW as in `rl`, scaled by the gradient norm, `onpolicy.signal_step`; none when no gap is open);
   the router's Quantile Balancing bias stays frozen.

The trainer forward, batches, optimizer, checkpoints and resume are `rl`'s (imported, not copied).
Logged per step to <out>/metrics.jsonl: the batch's reverse-KL estimate (mean log pi_S,behaviour - log pi_T),
clipped fraction, entropy, mismatch KL (sampler vs trainer), think tokens, task reward, think-cap rate, loss,
gradient norm, and the same per cell under "cells": {"general/low": {...}}. <out>/rollouts/step_N.jsonl keeps
the rollout records with `teacher_cell` and `teacher_logprobs` (one per sampled token).

Teachers are loaded once (`openk3.load`, float32, eval mode, no grad) and kept in memory: nine `small`
teachers fit; at `base` scale load them in turn (not done here). They must share the student's tokenizer
(the same `tiktoken.model` bytes) and vocabulary: a different renderer or tokenizer silently breaks
OPD (background §5.4).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from openk3.chat import THINKING_EFFORTS
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
from openk3.posttrain.trainers.rl import make_batch, masked_mean, policy_backward, policy_logprobs, token_logprobs
from openk3.posttrain.trainers.rollout import Problem, RolloutConfig, rollout

CONFIG_FILE = "mopd_config.json"
#: Settings a resumed run may change (they do not alter what the finished steps computed).
RESUMABLE_CHANGES = ("steps", "save_every", "student", "teachers",  # a resume reads its own checkpoint
                     "micro_tokens")  # the same gradients in other pieces
#: What a trajectory that hits `think_cap` is rewarded (only alpha mixing reads rewards): a truncation, like
#: the rollout's other format failures, not RL's over-budget -1 (MOPD has no budgets).
THINK_CAP_REWARD = 0.0
ALL_CELLS = tuple(f"{d}/{e}" for d in DOMAINS for e in THINKING_EFFORTS)


def parse_cell(cell: str, where: str) -> tuple[str, str]:
    """'general/low' -> ('general', 'low'), or ValueError naming `where` and the cell."""
    parts = cell.split("/") if isinstance(cell, str) else []
    if len(parts) != 2 or parts[0] not in DOMAINS or parts[1] not in THINKING_EFFORTS:
        raise ValueError(f"{where}: {cell!r} is not a cell 'domain/effort' with domain in {list(DOMAINS)} and "
                         f"effort in {list(THINKING_EFFORTS)}")
    return parts[0], parts[1]


def read_teacher_map(teachers: str | os.PathLike | Mapping[str, str]) -> dict[str, str]:
    """{cell: checkpoint path} from a dict or a JSON file {"general/high": DIR, ...}; relative paths in a file
    are relative to the file's folder. Keys are checked (`parse_cell`), values must be non-empty strings."""
    if isinstance(teachers, Mapping):
        table, where, root = dict(teachers), "teachers", None
    else:
        where, root = str(teachers), Path(teachers).parent
        try:
            table = json.loads(Path(teachers).read_text())
        except OSError as e:
            raise ValueError(f"{teachers}: cannot read the teacher map ({e.strerror})") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{teachers}: not JSON ({e})") from e
        if not isinstance(table, dict):
            raise ValueError(f"{teachers}: the teacher map must be a JSON object {{\"general/high\": DIR, ...}}")
    out = {}
    for cell, path in table.items():
        parse_cell(cell, where)
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where}: teacher of {cell} must be a checkpoint path, got {path!r}")
        out[cell] = str(root / path) if root is not None and not os.path.isabs(path) else path
    if not out:
        raise ValueError(f"{where}: no teachers")
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class MOPDConfig(OnPolicyConfig):
    """The on-policy section (`OnPolicyConfig`: steps, prompts and group per step, lr, sampling limits, problems,
    seed, checkpoints, engine, memory) plus MOPD's student, teachers, cells and loss."""

    KIND = "mopd"
    TUPLES = ("cells", "ratio_clip")

    student: str = ""  # the starting checkpoint (the SFT model, background §1.6)
    teachers: dict = dataclasses.field(default_factory=dict)  # cell -> checkpoint folder
    cells: tuple[str, ...] = ()  # the cells drawn from (uniformly); () = every teacher's cell
    group_size: int = 1  # samples per prompt; >= 2 only matters for alpha's group baseline
    # the loss (background §1.6: K3's values are unknown, these are our defaults)
    clip: float | None = 5.0  # R: A_t clipped to [-R, R]; None = no clip (the R = inf ablation)
    alpha: float = 0.0  # outcome mixing A = A_MOPD + alpha (r - group mean) (MiMo); 0 = pure MOPD
    ppo_epochs: int = 1  # passes over each batch; > 1 reuses it with PPO's clipped ratio
    ratio_clip: tuple[float, float] = (0.2, 0.28)  # PPO clip (low, high) for passes after the first
    # |log pi_T - log pi_S| below this is agreement (A_t = 0), not signal: see `floor_gaps`. 0 = K3's formula:
    # with `update_ref` the rounding-size gaps of a matched teacher move the weights ~1e-6 of a step (measured)
    adv_floor: float = 0.0
    # the temperature each teacher's log-probs are taken at: None = the one it was RL-trained at (its run's
    # rl_config.json; 1 when there is none); a number = that for every teacher (1.0: verl's choice, §5.4)
    teacher_temperature: float | None = None
    think_cap: int | None = None  # think tokens per trajectory before it is cut (None: the context limit)

    def check(self) -> None:
        super().check()
        bad = self.bad
        teachers = read_teacher_map(self.teachers) if self.teachers else {}
        object.__setattr__(self, "teachers", teachers)
        cells = tuple(self.cells) or tuple(c for c in ALL_CELLS if c in teachers)
        for c in cells:
            parse_cell(c, "mopd cells")
            if teachers and c not in teachers:
                raise ValueError(f"mopd cells: no teacher for cell {c} (teachers: {', '.join(teachers)})")
        if len(set(cells)) != len(cells):
            raise bad("cells", "distinct cells")
        object.__setattr__(self, "cells", cells)
        if isinstance(self.ppo_epochs, bool) or not isinstance(self.ppo_epochs, int) or self.ppo_epochs < 1:
            raise bad("ppo_epochs", "an integer >= 1")
        if self.think_cap is not None and (isinstance(self.think_cap, bool) or not isinstance(self.think_cap, int)
                                           or self.think_cap < 1):
            raise bad("think_cap", "an integer >= 1 or None")
        if self.clip is not None and not self.clip > 0:
            raise bad("clip", "> 0 (or None for no clip)")
        if not self.adv_floor >= 0:
            raise bad("adv_floor", ">= 0")
        if self.teacher_temperature is not None and not self.teacher_temperature > 0:
            raise bad("teacher_temperature", "> 0 or None")
        if self.alpha and self.group_size < 2:
            raise ValueError(f"mopd alpha={self.alpha!r} mixes an outcome advantage against the group mean: "
                             f"it needs group_size >= 2, got {self.group_size}")
        lo, hi = self.ratio_clip
        if not (0 <= lo < 1 and hi >= 0):
            raise bad("ratio_clip", "(low, high) with 0 <= low < 1 and high >= 0")
        object.__setattr__(self, "ratio_clip", (float(lo), float(hi)))


# ---- cells, teachers, scoring -------------------------------------------------------------------------


def draw_cells(cells: Sequence[str], n: int, seed: int, step: int) -> list[str]:
    """The cells of step `step`'s n prompts: uniform over `cells`, the same in every run (resume-safe)."""
    rng = random.Random(f"mopd|{seed}|{step}")
    return [rng.choice(list(cells)) for _ in range(n)]


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_teachers(teachers: Mapping[str, str], cells: Sequence[str], student_folder: Path,
                  vocab_size: int) -> dict[str, torch.nn.Module]:
    """{cell: teacher model} for `cells`: each checkpoint loaded once (cells may share one), float32, eval
    mode, frozen. A teacher must have the student's tokenizer file byte for byte and its vocabulary size."""
    from openk3.checkpoint import load
    from openk3.checkpoint.load import resolve_checkpoint

    student_tok = _file_digest(student_folder / "tiktoken.model")
    loaded: dict[Path, torch.nn.Module] = {}
    out = {}
    for cell in cells:
        folder = resolve_checkpoint(teachers[cell]).resolve()
        if folder not in loaded:
            if not (folder / "tiktoken.model").is_file():
                raise ValueError(f"teacher {cell} ({folder}): no tokenizer (tiktoken.model); MOPD needs the teacher "
                                 "to share the student's tokenizer and renderer")
            if _file_digest(folder / "tiktoken.model") != student_tok:
                raise ValueError(f"teacher {cell} ({folder}): its tokenizer differs from the student's "
                                 f"({student_folder}); MOPD scores the student's token ids, so they must match")
            model = load(folder, dtype=torch.float32).eval()
            if model.config.vocab_size != vocab_size:
                raise ValueError(f"teacher {cell} ({folder}): vocab_size {model.config.vocab_size}, the student's is "
                                 f"{vocab_size}")
            model.requires_grad_(False)
            loaded[folder] = model
        out[cell] = loaded[folder]
    return out


def training_temperature(path: str | os.PathLike) -> float:
    """The temperature the teacher at `path` sampled at in RL: its run's rl_config.json (`path` a run folder, or
    a checkpoint inside one: <run>/checkpoints/step_N); 1.0 for a checkpoint no RL run made (SFT, a release).
    A teacher's behaviour is its distribution at that temperature, so that is where MOPD scores it."""
    from openk3.checkpoint.load import resolve_checkpoint
    from openk3.fsutil import read_json

    given = Path(path)
    folder = resolve_checkpoint(path).resolve()
    for run in (given, folder.parent.parent if folder.parent.name == "checkpoints" else None):
        if run is not None and (run / "rl_config.json").is_file():
            t = read_json(run / "rl_config.json").get("temperature", 1.0)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
                raise ValueError(f"{run / 'rl_config.json'}: temperature must be a number > 0, got {t!r}")
            return float(t)
    return 1.0


def teacher_temperatures(cfg: MOPDConfig) -> dict[str, float]:
    """{cell: the temperature its teacher is scored at} (`cfg.teacher_temperature`, or each one's own)."""
    if cfg.teacher_temperature is not None:
        return {c: float(cfg.teacher_temperature) for c in cfg.cells}
    return {c: training_temperature(cfg.teachers[c]) for c in cfg.cells}


@torch.no_grad()
def teacher_logprobs(records: Sequence[dict], ids_BT: torch.Tensor, teachers: Mapping[str, Callable],
                     micro_tokens: int | None = None, temperatures: Mapping[str, float] | None = None,
                     cells: Sequence[str] | None = None) -> tuple[torch.Tensor, list[str]]:
    """log pi_T of every next token [B, T-1] (float32, as `rl.make_batch` aligns targets), each row from the
    teacher of its record's cell (`domain/effort`) at that cell's temperature (`temperatures`, default 1), and
    the rows' cells (`cells`: route row b to the teacher of cells[b] instead, a control arm's routing).

    A teacher is anything `token_logprobs` can call: ids [b, t] -> logits [b, t, V]. One prefill per teacher
    over exactly its rows, cut to their longest (right padding never changes earlier positions: causal), in
    chunks of at most `micro_tokens` padded tokens when given; positions past a row's end stay 0 (masked by
    the caller)."""
    cells = [f"{r['domain']}/{r['effort']}" for r in records] if cells is None else list(cells)
    out = torch.zeros(ids_BT.shape[0], ids_BT.shape[1] - 1, dtype=torch.float32)
    for teacher, rows in losses.route_teachers(cells, teachers).values():
        n = max(len(records[b]["token_ids"]) for b in rows)
        per = len(rows) if micro_tokens is None else max(1, micro_tokens // n)
        t = 1.0 if temperatures is None else temperatures[cells[rows[0]]]
        for i in range(0, len(rows), per):
            part = rows[i:i + per]
            logp, _ = token_logprobs(teacher, ids_BT[part, :n], t)
            out[part, :n - 1] = logp.float()
    return out, cells


def floor_gaps(teacher_BT: torch.Tensor, behaviour_BT: torch.Tensor, floor: float) -> torch.Tensor:
    """The teacher's log-probs with every gap |log pi_T - log pi_S| < `floor` closed (set to the student's), so
    `losses.mopd_advantage` gives exactly 0 there.

    Sampler and trainer compute log-probs along different paths (cached decode vs a full forward), so even a
    teacher identical to the student shows gaps of ~1e-6 nats. Before `update_ref` scaled steps by the
    gradient norm, Muon turned that noise into a full learning-rate step (a 6e-7 gradient norm moved weights by
    0.9 lr), and this floor (then 1e-3 by default) was the guard; now such a gradient moves them ~1e-6 of a
    step, so the default is 0 (K3's formula) and the floor stays an option (a student that matches its teacher
    then takes no step at all)."""
    if not floor:
        return teacher_BT
    return torch.where((teacher_BT - behaviour_BT).abs() < floor, behaviour_BT, teacher_BT)


# ---- the step ---------------------------------------------------------------------------------------


def _cell_stats(records: list[dict], cells: list[str], mask: torch.Tensor, rkl: torch.Tensor,
                entropy: torch.Tensor, mismatch: torch.Tensor, clip: float | None,
                floored: torch.Tensor) -> dict[str, dict]:
    """Per cell: samples, reverse-KL estimate, clipped and floored fractions, entropy, mismatch KL (token means
    over the cell's generated tokens), think tokens (trajectory mean), task reward, think-cap rate. `floored`:
    [B, T-1] true where `floor_gaps` closed the gap."""
    out = {}
    for cell in dict.fromkeys(cells):
        rows = [b for b, c in enumerate(cells) if c == cell]
        m, recs = mask[rows], [records[b] for b in rows]
        hit = (rkl[rows].abs() > clip) if clip is not None else torch.zeros_like(m)
        out[cell] = {"n": len(rows), "reverse_kl": masked_mean(rkl[rows], m),
                     "clipped_frac": masked_mean(hit.float(), m),
                     "floored_frac": masked_mean(floored[rows].float(), m),
                     "entropy": masked_mean(entropy[rows], m), "mismatch_kl": masked_mean(mismatch[rows], m),
                     "think_mean": sum(r["think_tokens"] for r in recs) / len(recs),
                     "task_reward": sum(r["reward_components"]["task"] for r in recs) / len(recs),
                     "think_cap_rate": sum(r["stopped_reason"] == "budget" for r in recs) / len(recs)}
    return out


def mopd_step(cfg: MOPDConfig, model, opt, engine, problems: list[Problem], teachers: Mapping[str, Callable],
              tokenizer, roll_cfg: RolloutConfig, step: int, temperatures: Mapping[str, float] | None = None,
              route_fn: Callable[[list[str], int], list[str]] | None = None) -> tuple[list[dict], dict]:
    """One MOPD step on `problems` (each with meta domain/effort): the student (`model`, which `engine` runs
    on) samples, the teachers score, `cfg.ppo_epochs` optimizer steps. Returns the rollout records (with
    `teacher_cell`, `teacher_logprobs`) and the step's metrics (`step` is 0-based; metrics say step + 1).
    `temperatures`: {cell: the temperature its teacher scores at} (default 1; `distill` passes
    `teacher_temperatures(cfg)`). `route_fn(cells, step)`: the cell whose teacher scores each sample instead of
    its own (an experiment's control arm: `openk3 experiment mopd-vs-merge` shuffles the routing)."""
    if roll_cfg.group_size != cfg.group_size:
        raise ValueError(f"mopd_step: rollout group_size {roll_cfg.group_size} != the config's {cfg.group_size}")
    if roll_cfg.temperature != 1.0:
        raise ValueError("mopd_step: the student samples at temperature 1 (its own distribution, background §5.4)")
    t0 = time.perf_counter()
    records = rollout(engine, problems, tokenizer, roll_cfg, policy_version=step)
    t1 = time.perf_counter()
    batch = make_batch(records)
    mask, behaviour = batch["mask_BT"], batch["behaviour_BT"]
    routed = None if route_fn is None else route_fn([f"{r['domain']}/{r['effort']}" for r in records], step)
    teacher, cells = teacher_logprobs(records, batch["ids_BT"], teachers, cfg.micro_tokens, temperatures, routed)
    t2 = time.perf_counter()
    floored = floor_gaps(teacher, behaviour, cfg.adv_floor)
    rewards = batch["rewards_B"] if cfg.alpha else None
    group = cfg.group_size if cfg.alpha else None
    # no learning signal (every sampled token's gap closed, and no outcome advantage): no optimizer step, as in RL
    signal = bool(torch.where(mask, floored != behaviour, False).any())
    if cfg.alpha and not signal:
        signal = losses.rewards_vary(batch["rewards_B"], cfg.group_size)
    model.train()
    first: dict = {}
    if not signal:
        logp, entropy = policy_logprobs(model, batch["ids_BT"], mask, micro_tokens=cfg.micro_tokens)
        first = {"loss": 0.0, "grad_norm": 0.0, "update_scale": 0.0, "logp": logp, "entropy": entropy,
                 "stats": {"adv_mean": 0.0}}
        last_ratio_clip = 0.0
    for epoch in range(cfg.ppo_epochs if signal else 0):
        def loss_fn(lp, epoch=epoch):
            return losses.mopd_loss(lp, behaviour, floored, mask, clip=cfg.clip,
                                    ratio_clip=cfg.ratio_clip if epoch else None, rewards_B=rewards,
                                    group_size=group, alpha=cfg.alpha)

        opt.zero_grad()
        loss, stats, logp, entropy = policy_backward(model, batch["ids_BT"], mask, loss_fn,
                                                     micro_tokens=cfg.micro_tokens)
        grad_norm, scale = signal_step(opt, cfg.update_ref)
        if epoch == 0:  # the on-policy pass: what the sampled batch says about the student before any update
            first = {"loss": float(loss), "grad_norm": grad_norm, "update_scale": scale, "logp": logp,
                     "entropy": entropy, "stats": stats}
        last_ratio_clip = stats["ratio_clip_frac"]
    model.eval()
    rkl = torch.where(mask, behaviour - teacher, 0)
    mismatch = torch.where(mask, behaviour - first["logp"], 0)
    for b, r in enumerate(records):
        r["teacher_cell"] = cells[b]
        r["teacher_logprobs"] = teacher[b][mask[b]].tolist()
    n = len(records)
    hit = (rkl.abs() > cfg.clip) if cfg.clip is not None else torch.zeros_like(mask)
    metrics = {"step": step + 1, "loss": first["loss"], "grad_norm": first["grad_norm"],
               "update_scale": first["update_scale"], "lr": cfg.lr,
               "skipped": int(not signal),
               "reverse_kl": masked_mean(rkl, mask), "clipped_frac": masked_mean(hit.float(), mask),
               "floored_frac": masked_mean((floored == behaviour).float(), mask),
               "adv_mean": first["stats"]["adv_mean"], "entropy": masked_mean(first["entropy"], mask),
               "mismatch_kl": masked_mean(mismatch, mask),
               "think_mean": sum(r["think_tokens"] for r in records) / n,
               "gen_tokens_mean": sum(sum(r["gen_mask"]) for r in records) / n,
               "task_reward": sum(r["reward_components"]["task"] for r in records) / n,
               "format_fail_rate": sum(r["reward_components"]["format"] == 0 for r in records) / n,
               "think_cap_rate": sum(r["stopped_reason"] == "budget" for r in records) / n,
               "cells": _cell_stats(records, cells, mask, rkl, first["entropy"], mismatch, cfg.clip,
                                    floored == behaviour),
               "rollout_s": t1 - t0, "teacher_s": t2 - t1, "train_s": time.perf_counter() - t2}
    if cfg.ppo_epochs > 1:
        metrics["ratio_clip_frac_last"] = last_ratio_clip
    return records, metrics


# ---- the run ----------------------------------------------------------------------------------------


def _teacher_cells_changed(saved: MOPDConfig, cfg: MOPDConfig) -> list[str]:
    """The teachers may move (same cells; their paths are not compared), their cells may not."""
    if sorted(saved.teachers) != sorted(cfg.teachers):
        return [f"teacher cells: {sorted(saved.teachers)} -> {sorted(cfg.teachers)}"]
    return []


def _sources(cfg: MOPDConfig, tok, sandbox_options: dict | None) -> dict:
    from openk3.posttrain.trainers.problems import ProblemSource

    sources = {}
    for cell in cfg.cells:
        domain, effort = parse_cell(cell, "mopd cells")
        # ProblemSource's draw is keyed on (domain, seed, step): a per-effort seed keeps general/low and
        # general/high from drawing the very same problems whenever both come up in one step.
        seed = cfg.seed * len(THINKING_EFFORTS) + THINKING_EFFORTS.index(effort)
        sources[cell] = ProblemSource(domain, effort, tok, split=cfg.split, seed=seed, max_turns=cfg.max_turns,
                                      sandbox_options=sandbox_options, levels=cfg.levels)
    return sources


def draw_problems(cfg: MOPDConfig, sources: Mapping, step: int, think_cap: int) -> list[Problem]:
    """Step `step`'s prompts: `draw_cells`, then each cell's count from its source (cells in `cfg.cells`
    order), every budget replaced by `think_cap` (no budgets in MOPD)."""
    drawn = draw_cells(cfg.cells, cfg.prompts_per_step, cfg.seed, step)
    problems: list[Problem] = []
    try:
        for cell in cfg.cells:
            k = drawn.count(cell)
            if k:
                problems += [dataclasses.replace(p, budget=think_cap) for p in sources[cell].draw(step, k, cfg.steps)]
    except BaseException:
        release(sources, problems)
        raise
    return problems


def release(sources: Mapping, problems: list[Problem]) -> None:
    next(iter(sources.values())).release(problems)  # closes env problems' sandboxes (any source does)


def distill(cfg: MOPDConfig, out_dir: str | os.PathLike, *, on_step: Callable[[int, dict], None] | None = None,
            sandbox_options: dict | None = None, progress: bool = True) -> dict:
    """Run (or resume) MOPD for `cfg.steps` optimizer steps into `out_dir`; returns the last step's metrics
    ({} when the run had already finished). on_step(step, metrics) runs after each step's metrics are logged
    (before its checkpoint)."""
    from openk3.log import reporter

    if not cfg.teachers:
        raise ValueError("no teachers: give --teachers (a JSON file {\"general/high\": DIR, ...})")
    out = Path(out_dir)
    report = reporter("distill")
    run = open_run(out, cfg, config_file=CONFIG_FILE, start_field="student", missing="no student: give --student",
                   resumable=RESUMABLE_CHANGES, report=report, extra_changes=_teacher_cells_changed)
    cfg, model, tok, start = run.cfg, run.model, run.tok, run.start
    if start >= cfg.steps:
        return {}
    teachers = load_teachers(cfg.teachers, cfg.cells, run.folder, model.config.vocab_size)
    temperatures = teacher_temperatures(cfg)
    report.info("teachers score at temperature " + ", ".join(f"{c} {t:g}" for c, t in temperatures.items()))
    torch.manual_seed(cfg.seed)
    opt = optimizer_for(model, cfg.lr, cfg.grad_clip, run.state)
    sources = _sources(cfg, tok, sandbox_options)
    engine = cfg.engine(model)
    # A think count never reaches the context limit, so with no think_cap the sampler's budget stop never fires.
    think_cap = cfg.think_cap or engine.max_model_len
    roll_cfg = dict(group_size=cfg.group_size, response_cap=cfg.response_cap, over_budget_reward=THINK_CAP_REWARD)

    def step_fn(problems: list[Problem], step: int) -> tuple[list[dict], dict]:
        roll = RolloutConfig(seed=cfg.seed * 100_003 + step, **roll_cfg)
        return mopd_step(cfg, model, opt, engine, problems, teachers, tok, roll, step, temperatures)

    def line(m: dict) -> str:
        return (f"reverse KL {m['reverse_kl']:.4f}, clipped {m['clipped_frac']:.3f}, think {m['think_mean']:.1f}, "
                f"loss {m['loss']:.4g}")

    job = OnPolicyJob("distill", out, run, opt, draw=lambda step: draw_problems(cfg, sources, step, think_cap),
                      step_fn=step_fn, release=lambda problems: release(sources, problems), line=line)
    return drive(job, cfg.steps, cfg.save_every, report, on_step, what="MOPD", progress=progress)
