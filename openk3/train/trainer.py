"""Pretraining: `train(cfg, out_dir)` sets a run up (or resumes it) and hands a `PretrainJob` (the `Trainer`'s
step, evaluation, checkpoints) to the run loop (`openk3.train.loop`).

    summary = train(TrainConfig(model=preset("nano"), max_steps=200), "runs/nano")

Run folder:
    train_config.json        the config in force (model.vocab_size and special ids = the tokenizer's)
    train_config_history.jsonl   one line per resume that changed the config: step, changes, previous config
    tokenizer/               trained for the run when `cfg.tokenizer` is None
    metrics.jsonl            one record per step, eval and resume (`openk3.train.metrics`)
    loss.png                 train/val loss, redrawn at each eval, checkpoint and the end (when there is news)
    checkpoints/step_N/      release-format fp32 weights + tokenizer + trainer_state.pt; `latest`

`Trainer` is one step as a function of (model, batches, optimizer set, schedule): `batches` is any
object with `next() -> {"input_ids", "labels", "seg"}` (labels -100 where nothing is learned) and
`state_dict()`/`load_state_dict()`, so SFT swaps in a loader that masks prompts, and a distributed run
swaps in a rank-sharded one, without touching the step. The loss is the token-summed cross-entropy
over the count of labelled tokens (the global-token normalisation a data-parallel run all-reduces).

Resume: `train` on a folder with a complete checkpoint continues from it (weights, optimizer set,
schedule, loader position, RNG states, metrics history), and on CPU in fp32 with one thread it
reproduces the uninterrupted run's losses bit for bit. metrics.jsonl is cut back to the checkpoint's
step first, so it always describes one run. A checkpoint that does not load (truncated file) is skipped
for the next newest with a warning; a config that differs from the checkpoint's in a field that changes
the maths is refused unless `allow_config_change` (`openk3.train.config.RESUME_FREE`: what may change).
Before the tokenizer is trained and the data cached, the disk must have room for the checkpoints the
run will write (`keep_checkpoints` bounds them) and the token cache, estimated from the configs alone
(`check_free_space`). A write that fails (a full disk) names the folder or file it was writing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from openk3.checkpoint.runs import checkpoint_root, find_latest, list_checkpoints, step_dir_name
from openk3.checkpoint.steps import save_checkpoint
from openk3.common import autocast_context
from openk3.log import quiet_reporter, reporter
from openk3.ops.loss import IGNORE_INDEX, cross_entropy_sum
from openk3.parallel.ac import apply_activation_checkpointing
from openk3.parallel.fsdp import full_tensor
from openk3.parallel.mesh import Mesh, null_mesh
from openk3.tokenizer.files import tokenizer_files
from openk3.train.balance import RoutingRecorder, apply_quantile_balancing, apply_sign_balancing, load_stats
from openk3.train.config import LoopConfig, TrainConfig
from openk3.train.loop import Cadence, EventHook, Job, run_loop
from openk3.train.metrics import losses_by_step, mfu, peak_flops, plot_losses
from openk3.train.optim import OptimizerSet, build_optimizer
from openk3.train.qk_clip import QKClipRecorder, qk_clip_
from openk3.train.run_tokenizer import find_tokenizer, get_tokenizer, with_tokenizer_ids
from openk3.train.samples import val_samples
from openk3.train.schedule import LRSchedule
from openk3.train.space import cache_bytes, check_free_space, checkpoint_bytes, checkpoints_to_fit, planned_saves
from openk3.train.state import (
    open_run_folder,
    record_config,
    restart_changes,
    resume_run,
    rng_state,
    set_rng_state,
    settings_changes,
)
from openk3.train.threads import ThreadTuner


class Trainer:
    """One optimizer step at a time over `batches` (see the module docstring)."""

    def __init__(self, model: nn.Module, batches, optimizers: OptimizerSet, schedule: LRSchedule, cfg: LoopConfig,
                 *, device: torch.device | str = "cpu", threads: int = 1, mesh: Mesh | None = None) -> None:
        from openk3.model.accounting import flops_per_token

        self.model, self.batches, self.opt, self.schedule, self.cfg = model, batches, optimizers, schedule, cfg
        self.aux_loss_coef = getattr(cfg, "aux_loss_coef", 0.0)  # pretraining's comparison option (not in SFT)
        # data parallelism (openk3.parallel): each rank trains on its rows of every global batch
        self.mesh = mesh or null_mesh()
        if self.mesh.dp_size > 1 or self.mesh.cfg.pp > 1:
            kind = "data" if self.mesh.dp_size > 1 else "pipeline"
            for on, what in ((self.aux_loss_coef > 0, "aux_loss_coef > 0"), (cfg.qk_clip, "qk_clip")):
                if on:
                    raise ValueError(f"{what} with {kind} parallelism is not implemented yet (issue 19); run it in "
                                     "one process or turn it off")
        self.pipeline = None  # pipeline stages (parallel.pp): this rank's stage and its schedule
        if self.mesh.cfg.pp > 1 and self.mesh.distributed:
            from openk3.parallel.pipeline import PipelineParallel

            self.pipeline = PipelineParallel(model, self.mesh, n_micro=cfg.grad_accum, device=device)
        if cfg.grad_accum > 1 and self.aux_loss_coef > 0:
            raise ValueError("aux_loss_coef > 0 with grad_accum > 1 is not implemented yet; use grad_accum=1")
        self.device = torch.device(device)
        self.forward = self._compiled(model, cfg) if cfg.compile else model
        self.step = 0
        self.tokens = 0
        self.elapsed = 0.0
        self.history: list[dict] = []  # compact train/eval records (what loss.png is drawn from)
        self.recorder = RoutingRecorder(model, keep_inputs=self.aux_loss_coef > 0).enable()
        self.qk_recorder = QKClipRecorder(model).enable() if cfg.qk_clip else None
        self.flops_per_token = flops_per_token(model, cfg.seq_len, training=True)
        dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
        self.peak = cfg.peak_flops or peak_flops(dtype, threads, self.device.type)
        self.threads = threads

    def _compiled(self, model: nn.Module, cfg: LoopConfig) -> nn.Module:
        """`torch.compile(model)` for the step's forward, where a test covers it (see `LoopConfig.compile`)."""
        uncovered = [what for on, what in (
            (self.device.type != "cpu", f"device {self.device.type}"),
            (cfg.dtype != "fp32", f"dtype {cfg.dtype}"),
            (self.mesh.world_size > 1, "more than one process"),
            (cfg.qk_clip, "qk_clip"),
            (self.aux_loss_coef > 0, "aux_loss_coef > 0"),
            (getattr(cfg, "activation_checkpointing", False), "activation_checkpointing"),
        ) if on]
        if uncovered:
            raise ValueError(f"compile=true is offered where a test shows the compiled step equal to the eager one "
                             f"(one process, CPU, fp32, no qk_clip, aux loss or activation checkpointing); this run "
                             f"has {', '.join(uncovered)}: set compile=false")
        return torch.compile(model)

    def use_threads(self, n: int) -> None:
        """Run the next steps on `n` CPU threads (MFU is then measured against `n` cores)."""
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        dtype = torch.bfloat16 if self.cfg.dtype == "bf16" else torch.float32
        self.peak = self.cfg.peak_flops or peak_flops(dtype, n, self.device.type)
        self.threads = n

    # ---- one step ----
    def train_step(self, batch: dict) -> dict:
        cfg, model = self.cfg, self.model
        t0 = time.perf_counter()
        rows = self.mesh.batch_rows(batch["input_ids"].shape[0])
        ids = batch["input_ids"][rows].to(self.device)
        labels = batch["labels"][rows].to(self.device)
        seg = batch["seg"][rows].to(self.device) if batch.get("seg") is not None else None
        lr = self.opt.cfg.peak_lr * self.schedule.multiplier
        self.recorder.clear()
        # the global count of loss tokens (all ranks, all micro-batches): each micro-batch's loss is its share
        # of the global mean, so the accumulated and (FSDP) reduced gradients are the single-process gradients
        # of the whole batch, however it is split
        count = self.mesh.all_reduce_sum((labels != IGNORE_INDEX).sum())
        loss = torch.zeros((), device=self.device)
        aux = None
        micro = ids.shape[0] // cfg.grad_accum
        if self.pipeline is not None:  # the schedule runs the micro-batches through the stages
            with autocast_context(cfg.dtype, self.device):
                loss = self.pipeline.step(ids, labels, seg, count)
            self.recorder.keep_last(cfg.grad_accum)  # one record per micro-batch (not the stage's first probe)
        for k in range(cfg.grad_accum if self.pipeline is None else 0):
            part = slice(k * micro, (k + 1) * micro)
            with autocast_context(cfg.dtype, self.device):
                logits = self.forward(ids[part], seg_BT=None if seg is None else seg[part])
                loss_sum, _ = cross_entropy_sum(logits, labels[part])
                share = loss_sum / count.clamp_min(1)
                total = share
                if self.aux_loss_coef > 0 and self.recorder.layers:
                    aux = self.recorder.aux_loss()
                    total = share + self.aux_loss_coef * aux
            recorded = {n: len(r) for n, r in self.recorder.records.items()}
            # FSDP averages the ranks' gradients; the shares of the global mean must add up, so undo the division
            (total * self.mesh.dp_size if self.mesh.dp_size > 1 else total).backward()
            for n, r in recorded.items():  # activation checkpointing re-ran the MoE forwards: drop the repeats
                del self.recorder.records[n][r:]
                del self.recorder.inputs[n][r:]
            loss = loss + share.detach()
        if self.pipeline is not None:
            grad_norm = self.pipeline.clip_grad_norm_(self.opt.params(), self.opt.cfg.grad_clip)
        else:
            grad_norm = full_tensor(self.opt.clip_grad_norm_())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if cfg.balance == "sign":  # the loads of the global batch: an all-reduce of E counts per layer
            reduce = self.mesh.all_reduce_sum if self.mesh.distributed else None
            stats = apply_sign_balancing(model, self.recorder, cfg.sign_rate, reduce=reduce)
        elif cfg.qb_rate > 0:
            gather = self.mesh.all_gather_rows if self.mesh.distributed else None
            stats = apply_quantile_balancing(model, self.recorder, cfg.qb_rate, gather=gather)
        else:
            stats = {}
            for n, m in self.recorder.layers.items():
                if self.recorder.records[n]:
                    stats[n] = load_stats(self.recorder.routing(n)[1], m.gate.weight.shape[0])
            self.recorder.clear()
        clipped = None
        if self.qk_recorder is not None:
            tau = self.opt.cfg.qk_clip_tau
            if tau is not None:
                clipped = sum(qk_clip_(model, self.qk_recorder.max_logits, tau).values())
            self.qk_recorder.clear()
        self.schedule.step()
        dt = time.perf_counter() - t0
        self.step += 1
        n_tok = ids.numel() * self.mesh.dp_size  # the global batch
        self.tokens += n_tok
        self.elapsed += dt
        tps = n_tok / dt if dt > 0 else float("nan")
        loss_value = self.mesh.all_reduce_sum(loss.detach().clone()).item()  # the shares add to the global mean
        rec = {"kind": "train", "step": self.step, "loss": loss_value, "lr": lr,
               "grad_norm": float(grad_norm), "tokens": self.tokens, "tokens_per_s": tps,
               "mfu": mfu(tps, self.flops_per_token, self.peak * self.mesh.world_size),
               "load_max_over_mean": max((s["max_over_mean"] for s in stats.values()), default=None),
               "step_time": dt, "elapsed": self.elapsed, "threads": self.threads}
        if aux is not None:
            rec["aux_loss"] = aux.item()
        if clipped is not None:
            rec["qk_clipped_heads"] = clipped
        self.history.append({"kind": "train", "step": self.step, "loss": rec["loss"]})
        return rec

    def evaluate(self, split) -> dict:
        from openk3.data.loader import evaluate_bpb

        cfg = self.cfg
        t0 = time.perf_counter()
        if self.pipeline is not None:  # each rank then scores with the whole, current model
            self.pipeline.sync(self.model)
        with autocast_context(cfg.dtype, self.device):
            # every rank scores the same batches (the sharded forward is collective, so the ranks must run the
            # same forwards), a micro-batch of rows at a time: the same numbers at any layout
            micro = cfg.batch_size // (self.mesh.dp_size * cfg.grad_accum)
            r = evaluate_bpb(self.model, split, cfg.batch_size, cfg.seq_len, cfg.eval_batches, device=self.device,
                             chunk_rows=micro)
        return self.eval_record(t0, {"val_loss": r["loss"], "val_bpb": r["bpb"], "val_tokens": r["tokens"]},
                                kept=("val_loss", "val_bpb"))

    def eval_record(self, t0: float, values: dict, *, kept: tuple[str, ...]) -> dict:
        """Book an evaluation that started at `t0` (perf_counter) and measured `values`: the routing and QK
        statistics its forwards left are dropped (they are not a training step's), its time counts in
        `elapsed`, the `kept` values join the history (what loss.png and a resume read); returns the metrics
        record {"kind": "eval", "step", **values, "elapsed"}."""
        self.recorder.clear()
        if self.qk_recorder is not None:
            self.qk_recorder.clear()
        self.elapsed += time.perf_counter() - t0
        self.history.append({"kind": "eval", "step": self.step, **{k: values[k] for k in kept}})
        return {"kind": "eval", "step": self.step, **values, "elapsed": self.elapsed}

    # ---- state ----
    def state_dict(self, optimizer: bool = True) -> dict:
        """optimizer=False: the optimizer entry only names where its DCP shards go (multi-process saves)."""
        from openk3.parallel.checkpoint import OPTIMIZER_DIR

        opt = self.opt.state_dict() if optimizer else {"dcp": OPTIMIZER_DIR, "lr_multiplier": self.opt.lr_multiplier}
        return {"step": self.step, "tokens": self.tokens, "elapsed": self.elapsed,
                "optimizer": opt, "schedule": self.schedule.state_dict(),
                "loader": self.batches.state_dict(), "rng": rng_state(), "history": list(self.history)}

    def load_state_dict(self, sd: dict, checkpoint: Path | None = None) -> None:
        """`checkpoint`: the folder `sd` came from (where a multi-process save put the optimizer's shards)."""
        self.step, self.tokens, self.elapsed = int(sd["step"]), int(sd["tokens"]), float(sd["elapsed"])
        if "dcp" in sd["optimizer"]:
            from openk3.parallel.checkpoint import load_optimizer

            if checkpoint is None:
                raise ValueError("this trainer state keeps its optimizer in DCP shards: give the checkpoint folder")
            load_optimizer(self.model, self.opt, Path(checkpoint) / sd["optimizer"]["dcp"])
            self.opt.set_lr_multiplier(sd["optimizer"]["lr_multiplier"])
        else:
            self.opt.load_state_dict(sd["optimizer"])
        if self.pipeline is not None:  # a stage keeps only its own parameters' state (the others' would go stale)
            self.pipeline.drop_foreign_state(self.opt)
        self.schedule.load_state_dict(sd["schedule"])
        self.batches.load_state_dict(sd["loader"])
        set_rng_state(sd["rng"])
        self.history = list(sd["history"])

    def close(self) -> None:
        self.recorder.disable()
        if self.qk_recorder is not None:
            self.qk_recorder.disable()


# ---- set-up -------------------------------------------------------------------------------------------

def build_trainer(model: nn.Module, batches, cfg: LoopConfig, *, mesh: Mesh | None = None,
                  device: torch.device | str = "cpu", threads: int = 1) -> Trainer:
    """A `Trainer` for `model` the way every caller sets one up: routed experts spread over the ep ranks
    (`parallel.ep` > 1), then FSDP2 for the rest (both no-ops in one process), then the optimizers built on
    the parameters as they now are (sharded) and the LR schedule over `cfg.max_steps`. `openk3 train`,
    `openk3 sft`, the multi-process tests and `bench_distributed` all build theirs here."""
    from openk3.parallel.ep import apply_ep
    from openk3.parallel.fsdp import apply_fsdp

    mesh = mesh or null_mesh()
    apply_ep(model, mesh)
    apply_fsdp(model, mesh)
    opt = build_optimizer(model, cfg.optim)
    schedule = LRSchedule(opt, kind=cfg.schedule, warmup=cfg.warmup_steps, total=cfg.max_steps,
                          min_ratio=cfg.min_lr_ratio, decay_frac=cfg.decay_frac)
    return Trainer(model, batches, opt, schedule, cfg, device=device, threads=threads, mesh=mesh)


class TrainerJob(Job):
    """A job whose step is a `Trainer`'s (pretraining, SFT): its step count, its loss.png (train and validation
    loss from the trainer's history; `draws` False on ranks that do not write) and its hooks released at the
    end."""

    def __init__(self, trainer: Trainer, out: Path, *, draws: bool = True) -> None:
        self.trainer, self.out, self.draws = trainer, out, draws
        self.drawn = -1  # how much of the history loss.png shows (the history is append-only)

    @property
    def step(self) -> int:
        return self.trainer.step

    def plot(self) -> None:
        history = self.trainer.history
        # a step that evaluates and then saves would draw the same picture twice (matplotlib: ~0.2 s a draw)
        if self.draws and self.drawn != len(history):
            plot_losses(losses_by_step(history), losses_by_step(history, "eval", "val_loss"),
                        str(self.out / "loss.png"))
            self.drawn = len(history)

    def close(self) -> None:
        self.trainer.close()


class PretrainJob(TrainerJob):
    """Pretraining as a job of the run loop (`train.loop`): the `Trainer`'s step over the packed loader,
    bits-per-byte evaluation on the validation split, checkpoints (rank 0 writes; several processes also
    write DCP shards), loss.png."""

    tag = "train"

    def __init__(self, trainer: Trainer, loader, val, cfg: TrainConfig, out: Path, mesh: Mesh, *, tuner, extra: dict,
                 empty_copy: Callable[[], nn.Module]) -> None:
        super().__init__(trainer, out, draws=mesh.is_main)
        self.loader, self.val, self.cfg, self.mesh = loader, val, cfg, mesh
        self.tuner, self.extra, self.empty_copy = tuner, extra, empty_copy

    @property
    def evaluates(self) -> bool:
        return True

    def next_step(self) -> dict:
        if self.tuner is not None:
            self.trainer.use_threads(self.tuner.threads_for(self.trainer.step + 1))
        rec = self.trainer.train_step(self.loader.next())
        if self.tuner is not None and (note := self.tuner.record(self.trainer.step, rec["step_time"])):
            self.note(note)
        return rec

    def step_line(self, rec: dict, max_steps: int) -> str:
        lb = rec["load_max_over_mean"]
        return (f"step {rec['step']}/{max_steps} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                f"gnorm {rec['grad_norm']:.3f} {rec['tokens_per_s']:,.0f} tok/s"
                + (f" mfu {rec['mfu']:.1%}" if rec["mfu"] is not None else "")
                + (f" load max/mean {lb:.2f}" if lb is not None else ""))

    def postfix(self, rec: dict) -> dict[str, str]:
        out = {"loss": f"{rec['loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:,.0f}"}
        if rec["mfu"] is not None:
            out["mfu"] = f"{rec['mfu']:.1%}"
        return out

    def evaluate(self) -> dict:
        return self.trainer.evaluate(self.val)  # every rank evaluates the same batches (the forward is collective)

    def eval_line(self, rec: dict) -> str:
        return f"eval step {rec['step']}: val loss {rec['val_loss']:.4f}, {rec['val_bpb']:.4f} bits/byte"

    def save(self) -> Path | None:
        # several processes: the optimizer state goes to DCP shards written by every rank into a staging folder
        # that rank 0 moves into the checkpoint as it commits (parallel/checkpoint.py); one process: as it was
        from openk3.parallel.fsdp import gathered_model

        trainer, mesh, out = self.trainer, self.mesh, self.out
        state = trainer.state_dict(optimizer=not mesh.distributed)
        state["config"] = self.cfg.to_dict()
        dirs = None
        if mesh.distributed:
            from openk3.parallel.checkpoint import MODEL_DIR, OPTIMIZER_DIR, STAGING_PREFIX, save_model, save_optimizer

            staging = checkpoint_root(out) / f"{STAGING_PREFIX}{step_dir_name(trainer.step)}"
            staging_w = checkpoint_root(out) / f"{STAGING_PREFIX}weights-{step_dir_name(trainer.step)}"
            if mesh.is_main:
                for folder in (staging, staging_w):
                    shutil.rmtree(folder, ignore_errors=True)
                staging.parent.mkdir(parents=True, exist_ok=True)
            mesh.barrier()
            if trainer.pipeline is not None:  # every rank then holds every stage's current weights
                trainer.pipeline.sync(trainer.model)
            save_optimizer(trainer.model, trainer.opt, staging)
            save_model(trainer.model, staging_w)  # what a multi-process resume reads, each rank its own rows
            dirs = {OPTIMIZER_DIR: staging, MODEL_DIR: staging_w}
            state["weights_dcp"] = MODEL_DIR
        whole = gathered_model(trainer.model, mesh, self.empty_copy)  # (pipeline stages were synchronised above)
        path = None
        if mesh.is_main:
            path = save_checkpoint(out, trainer.step, whole, state, extra_files=self.extra,
                                   keep=self.cfg.keep_checkpoints, extra_dirs=dirs)
        mesh.barrier()  # nobody runs ahead (or exits) before the checkpoint is on disk
        return path


def train(cfg: TrainConfig, out_dir: str | os.PathLike, *, resume: bool = True, progress: bool = True,
          allow_config_change: bool = False, on_event: EventHook | None = None) -> dict:
    """Train (or resume) the run in `out_dir`; returns a summary dict (see the module docstring).

    resume: continue from the newest checkpoint that loads (a damaged newer one is skipped with a
    warning; False: refuse to start in a folder that has checkpoints). allow_config_change: resume
    even though `cfg` differs from the checkpoint's config in fields that change the run's maths
    (`openk3.train.config.RESUME_FREE` lists those that may always change); without it that is a
    ValueError listing every difference. on_event(kind, info): called after each "step", "eval" and
    "checkpoint" (tests use it to simulate a kill).
    """
    from openk3.common import resolve_device
    from openk3.parallel.mesh import init_mesh

    device = resolve_device(cfg.device)  # a ValueError naming what is missing, before anything is written
    # under torchrun: the process group and the data ranks (docs/distributed.md); the null mesh otherwise
    mesh = init_mesh(cfg.parallel, device, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum)
    try:
        return _train(cfg, Path(out_dir), mesh, device, resume=resume, progress=progress and mesh.is_main,
                      allow_config_change=allow_config_change, on_event=on_event)
    finally:
        mesh.close()


def _train(cfg: TrainConfig, out: Path, mesh: Mesh, device, *, resume: bool, progress: bool,
           allow_config_change: bool, on_event: EventHook | None) -> dict:
    """`train` in one process of the mesh: rank 0 writes (folder, tokenizer, cache first; then metrics,
    plots, checkpoints), every rank computes."""
    from openk3.common import cpus_available, fixed_threads, seed_everything, setup_cpu
    from openk3.data.loader import PackedLoader
    from openk3.data.shards import build_dataset
    from openk3.model.model import K3ForCausalLM
    from openk3.parallel.fsdp import gathered_model

    main = mesh.is_main
    report = reporter("train") if main else quiet_reporter("train")
    say, warn = report.info, report.warning
    out.mkdir(parents=True, exist_ok=True)
    # one process on the CPU with no thread count given: all CPUs or one, measured as it trains (train/threads.py)
    tuner = None
    if fixed_threads(cfg.threads) is None and not mesh.distributed and torch.device(device).type == "cpu":
        tuner = ThreadTuner(cpus_available())
    threads = setup_cpu(tuner.choice if tuner else cfg.threads)

    with mesh.main_first():  # rank 0 removes torn saves; then every rank reads the newest intact checkpoint
        # (several processes read a multi-process save's weights from its DCP shards once the model is laid out)
        ckpt, saved, saved_weights = open_run_folder(out, resume, say, warn, weights_dcp_ok=mesh.distributed)

    # Disk space first, from the configs alone: a full disk is then an error before the tokenizer is
    # trained and the data cached, not an ENOSPC in the middle of either or at the first checkpoint.
    cache_dir = Path(cfg.cache_dir or out.resolve().parent / ".cache")
    found_tok = find_tokenizer(cfg, out) if main else None  # rank 0 may be writing it: the others wait below
    tok = found_tok[0] if found_tok is not None else None
    model_cfg = cfg.model if tok is None else with_tokenizer_ids(cfg.model, tok)  # a new one gets vocab_size ids
    saves = checkpoints_to_fit(planned_saves(cfg, 0 if saved is None else int(saved["step"])),
                               len(list_checkpoints(out)), cfg.keep_checkpoints)
    if main:
        check_free_space(out, saves, checkpoint_bytes(model_cfg, muon=cfg.optim.muon), cache_dir,
                         cache_bytes(cfg.data, model_cfg.vocab_size, cache_dir, tok))

    with mesh.main_first():  # rank 0 trains a missing tokenizer; the others then find it
        tok, tok_dir = (found_tok if main else None) or get_tokenizer(cfg, out)
    if tok.vocab_size != cfg.model.vocab_size:
        say(f"model.vocab_size {cfg.model.vocab_size} -> {tok.vocab_size} (the tokenizer's)")
    cfg = dataclasses.replace(cfg, model=with_tokenizer_ids(cfg.model, tok))
    say(f"tokenizer {tok_dir}: vocab {tok.vocab_size} ({tok.n_ranks} ranks + {len(tok.special_ids)} specials)")
    if saved is not None:
        changes = settings_changes(out, ckpt, saved["config"], cfg, allow=allow_config_change, say=say)
    else:
        changes = restart_changes(out, cfg, "train_config") if main else []
    if main:
        record_config(out, cfg, step=None if saved is None else int(saved["step"]), changes=changes)

    seed_everything(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    with mesh.main_first():  # rank 0 builds the token cache; the others then read it
        ds = build_dataset(cfg.data, tok, str(cache_dir), progress=progress)
    say(f"data {cfg.data.source!r}: train {ds.train.num_tokens:,} tokens "
        f"({ds.train.bytes_per_token:.2f} bytes/token), "
        f"val {ds.val.num_tokens:,} tokens; cache {cache_dir}")
    loader = PackedLoader(ds.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed)  # the global batch, every rank

    model = K3ForCausalLM.build(cfg.model, device=device, seed=cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    trainer = build_trainer(model, loader, cfg, mesh=mesh, device=device, threads=threads)
    ranks = f", {mesh.world_size} processes (dp_replicate {cfg.parallel.dp_replicate} x dp_shard " \
            f"{cfg.parallel.dp_shard}, ep {cfg.parallel.ep}, pp {cfg.parallel.pp})" if mesh.distributed else ""
    if trainer.pipeline is not None:
        ranks += "; stages (layers) " + ", ".join(f"{a}-{b - 1}" for a, b in trainer.pipeline.bounds)
    auto = f" to start (auto: {tuner.cpus} or 1, whichever steps faster)" if tuner and tuner.cpus > 1 else ""
    say(f"model {cfg.preset or 'custom'}: {n_params:,} parameters, {trainer.flops_per_token / 1e6:.1f} MFLOP/token "
        f"(train), {threads} thread(s){auto}{ranks}, {cfg.dtype}; {cfg.max_steps} steps of {cfg.tokens_per_step:,} "
        "tokens")

    # (a multi-process resume keeps the history it saved: its ranks must run the same evaluations)
    resumed = resume_run(trainer, ckpt, saved, saved_weights, out / "metrics.jsonl", say, write=main,
                         eval_keys=("val_loss", "val_bpb"), recover_eval=not mesh.distributed)
    saved_weights = None  # copied into `model`: do not hold a second copy through training
    extra = tokenizer_files(tok_dir)

    def empty_copy() -> nn.Module:  # what `gathered_model` fills with the whole tensors on rank 0
        return K3ForCausalLM.build(cfg.model, device="cpu", seed=cfg.seed)

    job = PretrainJob(trainer, loader, ds.val, cfg, out, mesh, tuner=tuner, extra=extra, empty_copy=empty_copy)
    run_loop(job, Cadence(cfg.max_steps, cfg.eval_every, cfg.save_every, cfg.log_every), resumed.log, report=report,
             progress=progress, on_event=on_event if main else None, last_saved=resumed.last_saved,
             last_eval=resumed.last_eval)

    final_eval = next(h for h in reversed(trainer.history) if h["kind"] == "eval")
    train_losses = losses_by_step(trainer.history)
    summary = {"out_dir": str(out), "steps": trainer.step, "tokens": trainer.tokens, "elapsed": trainer.elapsed,
               "resumed_from": resumed.step, "final_loss": train_losses.get(trainer.step),
               "val_loss": final_eval["val_loss"], "val_bpb": final_eval["val_bpb"],
               "checkpoint": str(find_latest(out)), "vocab_size": tok.vocab_size, "samples": []}
    say(f"done: {trainer.step} steps, {trainer.tokens:,} tokens in {trainer.elapsed:.1f} s; validation "
        f"{final_eval['val_loss']:.4f} nats/token, {final_eval['val_bpb']:.4f} bits per byte")
    # several processes: rank 0 samples from a whole copy (a sharded forward is collective, and ranks that drew
    # different tokens would run different numbers of them and hang)
    sampler = gathered_model(model, mesh, empty_copy, trainer.pipeline) if cfg.samples and mesh.distributed else model
    if cfg.samples and main:
        with autocast_context(cfg.dtype, device):
            summary["samples"] = val_samples(sampler, tok, ds.val, cfg.samples, cfg.sample_tokens, seed=cfg.seed,
                                             device=device, say=say)
    return summary
