"""Supervised fine-tuning: `sft(cfg, out_dir)` fine-tunes a release-format checkpoint on chat JSONL.

    summary = sft(SFTConfig(base="runs/nano", data=("sft.jsonl",), max_steps=200), "runs/nano-sft")

The loop is pretraining's (`openk3.train.trainer.Trainer`: Muon + AdamW, warmup + cosine, Quantile
Balancing, gradient clipping, token-summed CE over labelled tokens) over `SFTLoader` batches, whose
labels are the renderer's assistant-channel mask (`openk3.posttrain.sft_data`). Run folder, as for
`openk3 train`:
    sft_config.json              the config in force (`base` and `data` as absolute paths)
    sft_config_history.jsonl     one line per resume that changed the config: step, changes, previous config
    metrics.jsonl                one record per step, eval and resume (`openk3.train.metrics`); an eval is
                                 {"kind": "eval", "step", "val_loss" (nats per trained token), "val_tokens"}
    loss.png                     train (and val) loss, redrawn at each eval, checkpoint and the end
    checkpoints/step_N/          release-format fp32 weights + the base's tokenizer + trainer_state.pt; `latest`
so `openk3.load(OUT)`, `openk3 chat --model OUT` and `openk3 sft --model OUT` (a further stage) open it.

Start: the base (a checkpoint folder, or a run folder's latest checkpoint) is read in fp32 with its
tokenizer, which encodes the data. Its special ids are set from the tokenizer (as `openk3 train` does),
and the result is saved with float experts whatever the base held: fp32 weights make the resume exact
(an MXFP4 base is unpacked exactly; `openk3 convert --experts mxfp4` packs the result again).
Length: `max_steps`, or when it is None `epochs` passes over the data (the packing of each epoch is
known in advance, so the step count and the LR schedule are exact).

Resume: as `openk3.train.trainer.train` -- the newest checkpoint that loads, metrics cut back to it,
bit-for-bit the uninterrupted run's losses on CPU in fp32; a config whose maths differ from the
checkpoint's (`SFT_RESUME_FREE` lists what may change) is refused unless `allow_config_change`, and
data whose tokens differ from the checkpoint's are refused always (the loader's fingerprint).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from openk3.fsutil import read_json, write_atomic
from openk3.posttrain.sft_data import (
    LEGACY_PACKING,
    OVERFLOW,
    PACKING,
    SPLITS,
    SFTLoader,
    eval_batches,
    load_conversations,
)
from openk3.train.optim import OptimConfig

# Fields a resumed run may change without `allow_config_change` (they do not change what the remaining
# steps compute; `max_steps`/`epochs` lengthen or shorten the run and recompute the LR schedule's length).
SFT_RESUME_FREE = frozenset({
    "max_steps", "epochs", "eval_every", "eval_batches", "save_every", "keep_checkpoints", "log_every", "threads",
    "device", "peak_flops", "grad_accum",
})
DTYPES = ("fp32", "bf16")
SCHEDULES = ("cosine", "wsd", "constant")


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    base: str = ""  # checkpoint folder or training run folder (its latest checkpoint)
    data: tuple[str, ...] = ()  # JSONL files (openk3.posttrain.sft_data)
    val_data: tuple[str, ...] = ()  # JSONL files scored at each eval; empty: no evaluation
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4))
    batch_size: int = 8
    grad_accum: int = 1  # micro-batches per step (batch_size / grad_accum rows at a time: memory, same steps)
    seq_len: int = 1024
    epochs: int = 2  # background §3.4: 2 epochs; used when max_steps is None
    max_steps: int | None = None
    overflow: str = "drop"  # conversations longer than seq_len: "drop" (counted) or "truncate"
    packing: str = "best_fit"  # conversations into rows: "best_fit" or "next_fit" (openk3.posttrain.sft_data.pack)
    splits: tuple[str, ...] = ("train",)  # record splits read from the data (val_data: all splits)
    eval_every: int = 0  # 0: only at the end (when val_data is given)
    eval_batches: int | None = None  # None: all of val_data
    save_every: int = 500  # 0: only at the end
    keep_checkpoints: int | None = None
    log_every: int = 10
    seed: int = 0
    dtype: str = "fp32"
    device: str = "cpu"
    schedule: str = "cosine"
    warmup: float = 0.03  # < 1: fraction of the steps; >= 1: steps
    min_lr_ratio: float = 0.1
    decay_frac: float = 0.2
    qb_rate: float = 1.0  # Quantile Balancing keeps running during SFT (0 freezes the expert biases)
    qk_clip: bool = False
    threads: int | None = None
    peak_flops: float | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "log_every", "epochs", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} must divide into grad_accum={self.grad_accum} "
                             "micro-batches")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_steps", "eval_batches", "keep_checkpoints", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.overflow not in OVERFLOW:
            raise ValueError(f"overflow must be one of {OVERFLOW}, got {self.overflow!r}")
        if self.packing not in PACKING:
            raise ValueError(f"packing must be one of {PACKING}, got {self.packing!r}")
        if not self.splits or any(s not in SPLITS for s in self.splits):
            raise ValueError(f"splits must be a non-empty subset of {SPLITS}, got {self.splits!r}")
        if self.warmup < 0 or not 0 <= self.min_lr_ratio <= 1 or self.qb_rate < 0:
            raise ValueError(f"need warmup >= 0, 0 <= min_lr_ratio <= 1, qb_rate >= 0; got {self.warmup}, "
                             f"{self.min_lr_ratio}, {self.qb_rate}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "sft config") -> SFTConfig:
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object")
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(d) - set(hints))
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {', '.join(map(repr, unknown))}")
        kw = dict(d)
        if "optim" in kw:
            optim = dict(kw["optim"])
            if "betas" in optim:
                optim["betas"] = tuple(optim["betas"])
            kw["optim"] = OptimConfig(**optim)
        for name in ("data", "val_data", "splits"):
            if name in kw:
                kw[name] = tuple(kw[name])
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> SFTConfig:
        return cls.from_dict(read_json(path), source=str(path))

    @classmethod
    def from_run(cls, path: str | os.PathLike) -> SFTConfig:
        """A run's own `sft_config.json`; one written before the `packing` option packed next-fit."""
        d = read_json(path)
        if isinstance(d, dict):
            d.setdefault("packing", LEGACY_PACKING)
        return cls.from_dict(d, source=str(path))

    def to_json(self, path: str | os.PathLike) -> None:
        write_atomic(path, (json.dumps(self.to_dict(), indent=2) + "\n").encode())


def apply_overrides(cfg: SFTConfig, overrides: list[str] | tuple[str, ...]) -> SFTConfig:
    """A copy of `cfg` with `key=value` overrides (top-level fields, or `optim.<field>`), typed against the
    dataclass fields as `openk3 train`'s are (`openk3.train.config.parse_value`)."""
    from openk3.train.config import parse_value

    top_hints, optim_hints = typing.get_type_hints(SFTConfig), typing.get_type_hints(OptimConfig)
    known = [k for k in top_hints if k != "optim"] + [f"optim.{k}" for k in optim_hints]
    top: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        key, text = (s.strip() for s in item.split("=", 1))
        if key.startswith("optim.") and key[6:] in optim_hints:
            tp, into, name = optim_hints[key[6:]], optim, key[6:]
        elif key in top_hints and key != "optim":
            tp, into, name = top_hints[key], top, key
        else:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
            raise ValueError(f"unknown sft config key {key!r}"
                             + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
        try:
            into[name] = parse_value(tp, text)
        except (ValueError, TypeError) as e:
            raise ValueError(f"bad value for {key}: {text!r} ({e})") from None
    if optim:
        top["optim"] = dataclasses.replace(cfg.optim, **optim)
    return dataclasses.replace(cfg, **top)


def _say(msg: str) -> None:
    print(f"[sft] {msg}", flush=True)


def _warn(msg: str) -> None:
    print(f"[sft] warning: {msg}", file=sys.stderr, flush=True)


def resolve_paths(cfg: SFTConfig) -> tuple[SFTConfig, Path]:
    """`cfg` with `base` the absolute checkpoint folder it names and data paths absolute; and that folder."""
    from openk3.checkpoint.load import resolve_checkpoint

    if not cfg.base:
        raise ValueError("no base model: give --model (a checkpoint folder or a training run folder)")
    if not cfg.data:
        raise ValueError("no training data: give --data FILE[,FILE] (JSONL conversations)")
    folder = resolve_checkpoint(cfg.base).resolve()
    absolute = lambda paths: tuple(str(Path(p).resolve()) for p in paths)  # noqa: E731
    return dataclasses.replace(cfg, base=str(folder), data=absolute(cfg.data), val_data=absolute(cfg.val_data)), folder


def base_tokenizer(folder: Path):
    """The tokenizer saved with the base checkpoint, and its files (copied into every SFT checkpoint)."""
    from openk3.tokenizer import Tokenizer

    if not (folder / "tiktoken.model").is_file():
        raise ValueError(f"{folder}: the base checkpoint has no tokenizer (tiktoken.model); SFT encodes the data "
                         "with the base's own tokenizer")
    files = {name: str(folder / name) for name in ("tiktoken.model", "tokenizer_config.json")
             if (folder / name).is_file()}
    return Tokenizer.from_dir(str(folder)), files


def loop_config(cfg: SFTConfig, model_cfg, max_steps: int):
    """The `TrainConfig` the pretraining `Trainer` reads its step options from (the SFT run's values)."""
    from openk3.train.config import TrainConfig

    return TrainConfig(model=model_cfg, optim=cfg.optim, preset=None, batch_size=cfg.batch_size,
                       grad_accum=cfg.grad_accum, seq_len=cfg.seq_len, max_steps=max_steps, seed=cfg.seed,
                       dtype=cfg.dtype, device=cfg.device,
                       schedule=cfg.schedule, warmup=cfg.warmup, min_lr_ratio=cfg.min_lr_ratio,
                       decay_frac=cfg.decay_frac, qb_rate=cfg.qb_rate, aux_loss_coef=0.0, qk_clip=cfg.qk_clip,
                       peak_flops=cfg.peak_flops, threads=cfg.threads, samples=0)


@torch.no_grad()
def evaluate(model, convs, cfg: SFTConfig, pad_id: int, device: torch.device) -> dict:
    """Mean CE (nats) per trained token of `convs` (packed in file order), and the token count."""
    from openk3.common import autocast_context
    from openk3.ops.loss import cross_entropy_sum

    was = model.training
    model.eval()
    nats, tokens = 0.0, 0
    try:
        for i, batch in enumerate(eval_batches(convs, cfg.batch_size, cfg.seq_len, pad_id)):
            if cfg.eval_batches is not None and i >= cfg.eval_batches:
                break
            with autocast_context(cfg.dtype, device):
                logits = model(batch["input_ids"].to(device), seg_BT=batch["seg"].to(device))
            loss, count = cross_entropy_sum(logits, batch["labels"].to(device))
            nats += float(loss)
            tokens += int(count)
    finally:
        model.train(was)
    return {"loss": nats / max(1, tokens), "tokens": tokens}


def sft(cfg: SFTConfig, out_dir: str | os.PathLike, *, resume: bool = True, progress: bool = True,
        allow_config_change: bool = False, on_event=None) -> dict:
    """Fine-tune (or resume fine-tuning) into `out_dir`; returns a summary dict (module docstring).

    resume / allow_config_change / on_event(kind, info) ("step", "eval", "checkpoint") as in
    `openk3.train.trainer.train`.
    """
    from openk3.checkpoint import load
    from openk3.checkpoint.runs import find_latest
    from openk3.checkpoint.steps import save_checkpoint
    from openk3.common import resolve_device, seed_everything, setup_cpu
    from openk3.train.config import resume_changes
    from openk3.train.metrics import MetricsLog, logged_eval, losses_by_step, plot_losses
    from openk3.train.state import open_run_folder, record_config, restart_changes, resume_trainer
    from openk3.train.trainer import build_trainer, with_tokenizer_ids

    device = resolve_device(cfg.device)
    cfg, base = resolve_paths(cfg)
    tok, tok_files = base_tokenizer(base)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = setup_cpu(cfg.threads)

    ckpt, saved, saved_weights = open_run_folder(out, resume, _say, _warn)
    changes: list[str] = []
    if saved is not None:
        saved["config"].setdefault("packing", LEGACY_PACKING)  # saved before the option existed
        free, refused = resume_changes(saved["config"], cfg.to_dict(), SFT_RESUME_FREE)
        if refused and not allow_config_change:
            raise ValueError(f"{out}: the config differs from checkpoint {ckpt.name}'s in settings that change "
                             f"the run's maths (checkpoint -> now):\n  " + "\n  ".join(refused) + "\nto resume the "
                             "run as it was, drop those options (or give the checkpoint's values); to continue with "
                             "the new ones, pass --allow-config-change; the old config is then kept in "
                             "sft_config_history.jsonl")
        changes = refused + free
        if changes:
            _say(f"config changed since {ckpt.name}: " + "; ".join(changes))
    else:
        changes = restart_changes(out, cfg, "sft_config", SFT_RESUME_FREE)

    convs, stats = load_conversations(cfg.data, tok, seq_len=cfg.seq_len, overflow=cfg.overflow, splits=cfg.splits)
    _say(f"data {', '.join(cfg.data)}: {stats.describe()}")
    if not convs:
        raise ValueError(f"{', '.join(cfg.data)}: no conversation to train on ({stats.describe()})")
    val = []
    if cfg.val_data:
        val, vstats = load_conversations(cfg.val_data, tok, seq_len=cfg.seq_len, overflow=cfg.overflow,
                                         splits=SPLITS)
        _say(f"validation {', '.join(cfg.val_data)}: {vstats.describe()}")
    pad_id = tok.pad_id if tok.pad_id is not None else 0
    loader = SFTLoader(convs, cfg.batch_size, cfg.seq_len, seed=cfg.seed, pad_id=pad_id, packing=cfg.packing)
    if saved is not None:
        loader.load_state_dict(saved["loader"])  # other data are refused here, before the config is rewritten
    max_steps = cfg.max_steps if cfg.max_steps is not None else loader.steps_for_epochs(cfg.epochs)
    record_config(out, cfg, step=None if saved is None else int(saved["step"]), changes=changes, name="sft_config")

    seed_everything(cfg.seed)
    model = load(base, dtype=torch.float32, device=device)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"{base}: the tokenizer has {tok.vocab_size} ids but the model only "
                         f"{model.config.vocab_size} embeddings")
    model.config = with_tokenizer_ids(model.config, tok).replace(vocab_size=model.config.vocab_size)
    model.loaded_format = None  # save float experts (fp32): what resumes exactly (module docstring)
    model.train()
    tcfg = loop_config(cfg, model.config, max_steps)
    trainer = build_trainer(model, loader, tcfg, device=device, threads=threads)  # one process: no sharding
    _say(f"base {base}: {sum(p.numel() for p in model.parameters()):,} parameters, {threads} thread(s), "
         f"{cfg.dtype}; {max_steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens"
         + ("" if cfg.max_steps is not None else f" ({cfg.epochs} epochs)"))

    metrics_path = out / "metrics.jsonl"
    resumed_from = resume_trainer(trainer, ckpt, saved, saved_weights, metrics_path, _say)
    saved_weights = None

    def emit(kind: str, info: dict) -> None:
        if on_event is not None:
            on_event(kind, info)

    log = MetricsLog(str(metrics_path))
    if resumed_from is not None:
        log.log({"kind": "resume", "step": resumed_from, "time": time.time()})

    def plot() -> None:
        plot_losses(losses_by_step(trainer.history), losses_by_step(trainer.history, "eval", "val_loss"),
                    str(out / "loss.png"))

    def save() -> Path:
        state = trainer.state_dict()
        state["config"] = cfg.to_dict()
        path = save_checkpoint(out, trainer.step, model, state, extra_files=tok_files, keep=cfg.keep_checkpoints)
        plot()
        emit("checkpoint", {"step": trainer.step, "path": str(path)})
        return path

    def run_eval() -> dict:
        t0 = time.perf_counter()
        r = evaluate(model, val, cfg, pad_id, device)
        trainer.recorder.clear()  # eval forwards are not routing statistics of a training step
        if trainer.qk_recorder is not None:
            trainer.qk_recorder.clear()
        trainer.elapsed += time.perf_counter() - t0
        rec = {"kind": "eval", "step": trainer.step, "val_loss": r["loss"], "val_tokens": r["tokens"],
               "elapsed": trainer.elapsed}
        trainer.history.append({"kind": "eval", "step": trainer.step, "val_loss": r["loss"]})
        log.log(rec)
        bar.write(f"[sft] eval step {trainer.step}: val loss {r['loss']:.4f} over {r['tokens']:,} trained tokens")
        plot()
        emit("eval", rec)
        return rec

    from tqdm import tqdm

    bar = tqdm(total=max_steps, initial=min(trainer.step, max_steps), file=sys.stderr, disable=not progress,
               unit="step", dynamic_ncols=True, desc="sft")
    last_saved = trainer.step if ckpt is not None else None
    last_eval = max((h["step"] for h in trainer.history if h["kind"] == "eval"), default=None)
    if val and resumed_from is not None and last_eval != trainer.step:
        # a run an older version finished saved before its final eval: that eval is in metrics.jsonl
        if (rec := logged_eval(str(metrics_path), trainer.step)) is not None:
            trainer.history.append({k: rec[k] for k in ("kind", "step", "val_loss")})
            last_eval = trainer.step
    try:
        while trainer.step < max_steps:
            rec = trainer.train_step(loader.next())
            rec["epoch"] = loader.epoch
            log.log(rec)
            step = trainer.step
            bar.set_postfix({"loss": f"{rec['loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:,.0f}"}, refresh=False)
            bar.update(1)
            if step % cfg.log_every == 0 or step == 1 or step == max_steps:
                bar.write(f"[sft] step {step}/{max_steps} epoch {loader.epoch} loss {rec['loss']:.4f} "
                          f"lr {rec['lr']:.2e} gnorm {rec['grad_norm']:.3f} {rec['tokens_per_s']:,.0f} tok/s")
            emit("step", rec)
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"loss is {rec['loss']} at step {step}")
            # the last step evaluates before it saves, so a finished run's checkpoint holds its final eval
            if val and (cfg.eval_every and step % cfg.eval_every == 0 or step == max_steps):
                run_eval()
                last_eval = step
            if cfg.save_every and step % cfg.save_every == 0:
                save()
                last_saved = step
        if val and last_eval != trainer.step:
            run_eval()
        if last_saved != trainer.step:
            save()
        else:
            plot()
    finally:
        bar.close()
        log.close()
        trainer.close()

    evals = [h for h in trainer.history if h["kind"] == "eval"]
    summary = {"out_dir": str(out), "steps": trainer.step, "tokens": trainer.tokens, "elapsed": trainer.elapsed,
               "resumed_from": resumed_from, "final_loss": losses_by_step(trainer.history).get(trainer.step),
               "val_loss": evals[-1]["val_loss"] if evals else None, "checkpoint": str(find_latest(out)),
               "conversations": stats.kept, "dropped_too_long": stats.too_long, "truncated": stats.truncated}
    _say(f"done: {trainer.step} steps, {trainer.tokens:,} tokens in {trainer.elapsed:.1f} s; checkpoint "
         f"{summary['checkpoint']}")
    return summary
