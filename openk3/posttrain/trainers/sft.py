"""Supervised fine-tuning: `sft(cfg, out_dir)` fine-tunes a release-format checkpoint on chat JSONL.

    summary = sft(SFTConfig(base="runs/nano", data=("sft.jsonl",), max_steps=200), "runs/nano-sft")

The loop is pretraining's (`openk3.train.trainer.Trainer`: Muon + AdamW, warmup + cosine, Quantile
Balancing, gradient clipping, token-summed CE over labelled tokens) over `SFTLoader` batches, whose
labels are the renderer's assistant-channel mask (`openk3.posttrain.trainers.sft_data`). Run folder, as for
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
import os
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from openk3.checkpoint.steps import save_checkpoint
from openk3.fsutil import read_json, write_atomic
from openk3.posttrain.trainers.sft_data import (
    LEGACY_PACKING,
    OVERFLOW,
    PACKING,
    SPLITS,
    SFTLoader,
    eval_batches,
    load_conversations,
)
from openk3.tokenizer.files import checkpoint_tokenizer
from openk3.train.config import LoopConfig
from openk3.train.metrics import losses_by_step
from openk3.train.optim import OptimConfig
from openk3.train.trainer import TrainerJob, build_trainer

# Fields a resumed run may change without `allow_config_change` (they do not change what the remaining
# steps compute; `max_steps`/`epochs` lengthen or shorten the run and recompute the LR schedule's length).
SFT_RESUME_FREE = frozenset({
    "max_steps", "epochs", "eval_every", "eval_batches", "save_every", "keep_checkpoints", "log_every", "threads",
    "device", "peak_flops", "grad_accum",
})


@dataclass(frozen=True, kw_only=True)
class SFTConfig(LoopConfig):
    """The loop's section (`openk3.train.config.LoopConfig`: optimizer, batch, schedule, cadence, ...) with
    SFT's defaults, plus the base model and the data."""

    base: str = ""  # checkpoint folder or training run folder (its latest checkpoint)
    data: tuple[str, ...] = ()  # JSONL files (openk3.posttrain.trainers.sft_data)
    val_data: tuple[str, ...] = ()  # JSONL files scored at each eval; empty: no evaluation
    epochs: int = 2  # background §3.4: 2 epochs; used when max_steps is None
    overflow: str = "drop"  # conversations longer than seq_len: "drop" (counted) or "truncate"
    packing: str = "best_fit"  # conversations into rows: "best_fit" or "next_fit" (`sft_data.pack`)
    splits: tuple[str, ...] = ("train",)  # record splits read from the data (val_data: all splits)
    # the loop's defaults for fine-tuning
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4))
    seq_len: int = 1024
    max_steps: int | None = None
    eval_every: int = 0  # 0: only at the end (when val_data is given)
    eval_batches: int | None = None  # None: all of val_data
    warmup: float = 0.03  # < 1: fraction of the steps; >= 1: steps

    def validate(self) -> None:
        super().validate()
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {self.max_steps}")
        if self.overflow not in OVERFLOW:
            raise ValueError(f"overflow must be one of {OVERFLOW}, got {self.overflow!r}")
        if self.packing not in PACKING:
            raise ValueError(f"packing must be one of {PACKING}, got {self.packing!r}")
        if not self.splits or any(s not in SPLITS for s in self.splits):
            raise ValueError(f"splits must be a non-empty subset of {SPLITS}, got {self.splits!r}")

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


class SFTJob(TrainerJob):
    """SFT as a job of the run loop (`train.loop`): the pretraining `Trainer`'s step over `SFTLoader` batches,
    mean CE per trained token of the validation conversations, checkpoints with the base's tokenizer."""

    tag = "sft"

    def __init__(self, trainer, loader, val: list, cfg: SFTConfig, out: Path, pad_id: int, device,
                 tok_files: dict[str, str]) -> None:
        super().__init__(trainer, out)
        self.loader, self.val, self.cfg = loader, val, cfg
        self.pad_id, self.device, self.tok_files = pad_id, device, tok_files

    @property
    def evaluates(self) -> bool:
        return bool(self.val)

    def next_step(self) -> dict:
        rec = self.trainer.train_step(self.loader.next())
        rec["epoch"] = self.loader.epoch
        return rec

    def step_line(self, rec: dict, max_steps: int) -> str:
        return (f"step {rec['step']}/{max_steps} epoch {rec['epoch']} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                f"gnorm {rec['grad_norm']:.3f} {rec['tokens_per_s']:,.0f} tok/s")

    def postfix(self, rec: dict) -> dict[str, str]:
        return {"loss": f"{rec['loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:,.0f}"}

    def evaluate(self) -> dict:
        t0 = time.perf_counter()
        r = evaluate(self.trainer.model, self.val, self.cfg, self.pad_id, self.device)
        return self.trainer.eval_record(t0, {"val_loss": r["loss"], "val_tokens": r["tokens"]}, kept=("val_loss",))

    def eval_line(self, rec: dict) -> str:
        return f"eval step {rec['step']}: val loss {rec['val_loss']:.4f} over {rec['val_tokens']:,} trained tokens"

    def save(self) -> Path:
        state = self.trainer.state_dict()
        state["config"] = self.cfg.to_dict()
        return save_checkpoint(self.out, self.trainer.step, self.trainer.model, state, extra_files=self.tok_files,
                               keep=self.cfg.keep_checkpoints)


def sft(cfg: SFTConfig, out_dir: str | os.PathLike, *, resume: bool = True, progress: bool = True,
        allow_config_change: bool = False, on_event=None) -> dict:
    """Fine-tune (or resume fine-tuning) into `out_dir`; returns a summary dict (module docstring).

    resume / allow_config_change / on_event(kind, info) ("step", "eval", "checkpoint") as in
    `openk3.train.trainer.train`.
    """
    from openk3.checkpoint import load
    from openk3.checkpoint.runs import find_latest
    from openk3.common import resolve_device, seed_everything, setup_cpu
    from openk3.log import reporter
    from openk3.train.loop import Cadence, run_loop
    from openk3.train.run_tokenizer import with_tokenizer_ids
    from openk3.train.state import (
        open_run_folder,
        record_config,
        restart_changes,
        resume_run,
        settings_changes,
    )

    report = reporter("sft")
    say = report.info
    device = resolve_device(cfg.device)
    cfg, base = resolve_paths(cfg)
    tok, tok_files = checkpoint_tokenizer(base, "SFT encodes the data with the base's own tokenizer")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = setup_cpu(cfg.threads)

    ckpt, saved, saved_weights = open_run_folder(out, resume, say, report.warning)
    if saved is not None:
        saved["config"].setdefault("packing", LEGACY_PACKING)  # saved before the option existed
        changes = settings_changes(out, ckpt, saved["config"], cfg, allow=allow_config_change, say=say,
                                   free_keys=SFT_RESUME_FREE, name="sft_config")
    else:
        changes = restart_changes(out, cfg, "sft_config", SFT_RESUME_FREE)

    convs, stats = load_conversations(cfg.data, tok, seq_len=cfg.seq_len, overflow=cfg.overflow, splits=cfg.splits)
    say(f"data {', '.join(cfg.data)}: {stats.describe()}")
    if not convs:
        raise ValueError(f"{', '.join(cfg.data)}: no conversation to train on ({stats.describe()})")
    val = []
    if cfg.val_data:
        val, vstats = load_conversations(cfg.val_data, tok, seq_len=cfg.seq_len, overflow=cfg.overflow,
                                         splits=SPLITS)
        say(f"validation {', '.join(cfg.val_data)}: {vstats.describe()}")
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
    # the LR schedule runs over the resolved length (the config keeps max_steps None: epochs decide)
    trainer = build_trainer(model, loader, dataclasses.replace(cfg, max_steps=max_steps), device=device,
                            threads=threads)  # one process: no sharding
    say(f"base {base}: {sum(p.numel() for p in model.parameters()):,} parameters, {threads} thread(s), "
        f"{cfg.dtype}; {max_steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens"
        + ("" if cfg.max_steps is not None else f" ({cfg.epochs} epochs)"))

    resumed = resume_run(trainer, ckpt, saved, saved_weights, out / "metrics.jsonl", say, eval_keys=("val_loss",),
                         recover_eval=bool(val))
    saved_weights = None
    job = SFTJob(trainer, loader, val, cfg, out, pad_id, device, tok_files)
    run_loop(job, Cadence(max_steps, cfg.eval_every, cfg.save_every, cfg.log_every), resumed.log, report=report,
             progress=progress, on_event=on_event, last_saved=resumed.last_saved, last_eval=resumed.last_eval)

    evals = [h for h in trainer.history if h["kind"] == "eval"]
    summary = {"out_dir": str(out), "steps": trainer.step, "tokens": trainer.tokens, "elapsed": trainer.elapsed,
               "resumed_from": resumed.step, "final_loss": losses_by_step(trainer.history).get(trainer.step),
               "val_loss": evals[-1]["val_loss"] if evals else None, "checkpoint": str(find_latest(out)),
               "conversations": stats.kept, "dropped_too_long": stats.too_long, "truncated": stats.truncated}
    say(f"done: {trainer.step} steps, {trainer.tokens:,} tokens in {trainer.elapsed:.1f} s; checkpoint "
        f"{summary['checkpoint']}")
    return summary
