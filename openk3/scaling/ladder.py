"""Ladder points: one family at one (width, depth, token budget, learning rate, seed), trained once, kept.

    store = PointStore("runs/exp/points", LadderSettings(...))
    p = store.point("k3", width=32, steps=80, lr=3e-3, seed=0)   # trains it, or reads it back
    p["loss"], p["compute"]                                        # held-out bits/byte, training FLOPs

A point is a pretraining run of `openk3.train.train` on the built-in corpus, with every setting that is not
the family's own shared by all points of a store: one tokenizer (trained once, into STORE/tokenizer), one
tokenised data cache, the same sequence length, batch, data order (the loader's seed is the point's seed),
WSD schedule shape (a fixed warmup in steps, a constant phase, the last `decay_frac` of the steps decaying
linearly to `min_lr_ratio`) and the same held-out batches for the loss (bits per byte over the first
`eval_batches` batches of the validation split). Only the family (its config and its train overrides), the
width, the step budget, the learning rate and the seed vary.

Points live in STORE/points/<key>/point.json, the key naming every one of those (and a hash of the shared
settings), so a ladder interrupted anywhere continues with its first unfinished point (and a run killed
mid-point resumes from that run's last checkpoint), and experiments that share an arm share its points.

WSD decay branches (`branch_from`): a budget of T steps decays over its last `decay_frac * T` steps, so
its first (1 - decay_frac) * T steps are the constant phase that every longer budget of the same (family,
width, lr, seed) runs too. A point of budget T2 therefore starts from the stable-phase checkpoint of the next
shorter budget T1 (saved at step (1 - decay_frac) * T1) instead of from step 0: the same run, bit for bit
(`tests/test_scaling.py` checks it against a run from scratch), for T2 - 0.8 T1 steps instead of T2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path

from openk3.fsutil import read_json, write_atomic
from openk3.scaling.families import config_flops, family


@dataclasses.dataclass(frozen=True)
class LadderSettings:
    """What every point of a store shares (the hash in each point's key)."""

    layers: int = 9
    batch_size: int = 8
    seq_len: int = 256
    vocab: int = 512  # byte-level (K3's specials on top of the 256 bytes): bits/byte is the loss anyway
    eval_batches: int = 32  # held-out batches of batch_size x seq_len tokens
    max_bytes: int | None = 20_000_000  # the built-in corpus' first bytes (tokenised once per store)
    val_fraction: float = 0.01  # held-out share of documents (DataConfig: chosen by a hash of the text)
    warmup_steps: int = 10  # fixed in steps, so that every budget shares its constant phase (WSD branches)
    decay_frac: float = 0.2
    min_lr_ratio: float = 0.1
    device: str = "cpu"
    dtype: str = "fp32"  # "bf16" on a GPU (autocast; TrainConfig.dtype)

    def key(self) -> str:
        d = dataclasses.asdict(self)
        if d["dtype"] == "fp32":  # (added later: the stores made before keep their keys)
            del d["dtype"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]


def point_key(arm: str, width: int, steps: int, lr: float, seed: int, settings: LadderSettings) -> str:
    return f"{arm}-w{width}-L{settings.layers}-s{steps}-lr{lr:.3g}-seed{seed}-{settings.key()}"


def stable_steps(steps: int, decay_frac: float) -> int:
    """The last step of the constant phase of a budget of `steps` (where a longer budget branches off)."""
    return int(math.floor(steps * (1.0 - decay_frac)))


class PointStore:
    def __init__(self, root: str | os.PathLike, settings: LadderSettings, say=print) -> None:
        self.root, self.settings, self.say = Path(root), settings, say
        (self.root / "points").mkdir(parents=True, exist_ok=True)

    # ---- paths ------------------------------------------------------------------------------------
    def folder(self, arm: str, width: int, steps: int, lr: float, seed: int) -> Path:
        return self.root / "points" / point_key(arm, width, steps, lr, seed, self.settings)

    def done(self, arm: str, width: int, steps: int, lr: float, seed: int) -> dict | None:
        """The finished point's record, or None. A point whose run trained another model than the family's
        current definition (a family changed in the code since; its key names only arm, sizes, LR, seed and the
        shared settings) is moved aside to `<folder>.stale-<n>` and counts as not done."""
        folder = self.folder(arm, width, steps, lr, seed)
        if not (folder / "point.json").is_file():
            return None
        if self._stale(folder, arm, width):
            n = 0
            while folder.with_name(f"{folder.name}.stale-{n}").exists():
                n += 1
            aside = folder.with_name(f"{folder.name}.stale-{n}")
            self.say(f"point {folder.name}: trained with another {arm!r} config than the family's current one; "
                     f"moved to {aside.name}, training it again")
            folder.rename(aside)
            return None
        return read_json(folder / "point.json")

    def _stale(self, folder: Path, arm: str, width: int) -> bool:
        """Does the run's saved model config differ from the family's current one in anything but the ids the
        tokenizer sets, or its training options from the family's?"""
        path = folder / "train_config.json"
        if not path.is_file():
            return False
        saved_all = read_json(path)
        saved = saved_all.get("model", {})
        fam = family(arm)
        now = fam.config(width, self.settings.layers, self.settings.vocab, self.settings.seq_len).to_dict()
        ignore = {"vocab_size", "eos_token_id", "bos_token_id", "pad_token_id"}
        keys = (set(saved) | set(now)) - ignore
        if any(saved.get(k) != now.get(k) for k in keys):
            return True
        # the family's training options too (k2-style's balance, k3-adamw's optimizer)
        for key, value in fam.train_overrides.items():
            section, _, leaf = key.rpartition(".")
            if (saved_all.get(section, {}) if section else saved_all).get(leaf) != value:
                return True
        return False

    # ---- the run ----------------------------------------------------------------------------------
    def train_config(self, arm: str, width: int, steps: int, lr: float, seed: int):
        import torch

        from openk3.train.config import TrainConfig, apply_overrides
        from openk3.train.optim import OptimConfig

        s = self.settings
        fam = family(arm)
        cfg = TrainConfig(
            model=fam.config(width, s.layers, s.vocab, s.seq_len), preset=None, max_steps=steps,
            batch_size=s.batch_size, seq_len=s.seq_len, seed=seed, schedule="wsd", warmup=float(s.warmup_steps),
            decay_frac=s.decay_frac, min_lr_ratio=s.min_lr_ratio, optim=OptimConfig(lr=lr),
            eval_every=0, eval_batches=s.eval_batches, device=s.device, dtype=s.dtype,
            save_every=stable_steps(steps, s.decay_frac),
            # the process's threads (`openk3 experiment --threads`), not train's own measuring tuner, which could
            # switch mid-point
            keep_checkpoints=None, log_every=max(1, steps // 4), samples=0, threads=torch.get_num_threads(),
            tokenizer=str(self.root / "tokenizer"),
            cache_dir=str(self.root / "cache"),
            data=dataclasses.replace(TrainConfig().data, max_bytes=s.max_bytes, val_fraction=s.val_fraction))
        overrides = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in fam.train_overrides.items()]
        return apply_overrides(cfg, overrides) if overrides else cfg

    def point(self, arm: str, width: int, steps: int, lr: float, seed: int, *, branch_from: int | None = None
              ) -> dict:
        """The point's record (module docstring), training it first unless it is in the store. `branch_from`:
        a shorter budget of the same (arm, width, lr, seed) to start from (its stable-phase checkpoint)."""
        found = self.done(arm, width, steps, lr, seed)
        if found is not None:
            return found
        folder = self.folder(arm, width, steps, lr, seed)
        with _locked(folder.with_name(folder.name + ".lock")):  # another process may be training it
            found = self.done(arm, width, steps, lr, seed)
            return found if found is not None else self._train_point(arm, width, steps, lr, seed, branch_from)

    def _train_point(self, arm: str, width: int, steps: int, lr: float, seed: int, branch_from: int | None) -> dict:
        from openk3.model.accounting import count_params
        from openk3.train.trainer import train

        folder = self.folder(arm, width, steps, lr, seed)
        cfg = self.train_config(arm, width, steps, lr, seed)
        self._tokenizer(cfg)
        started = "from scratch"
        if branch_from is not None and not (folder / "checkpoints").is_dir():
            started = self._branch(arm, width, branch_from, steps, lr, seed, folder)
        self.say(f"point {folder.name}: {steps} steps of {cfg.tokens_per_step:,} tokens, {started}")
        t0 = time.perf_counter()
        summary = train(cfg, folder, progress=False)
        seconds = time.perf_counter() - t0
        import torch

        from openk3.model.model import K3ForCausalLM

        with torch.device("meta"):
            counts = count_params(K3ForCausalLM(cfg.model))
        flops = config_flops(cfg.model, cfg.seq_len)
        tokens = steps * cfg.tokens_per_step
        record = {"arm": arm, "width": width, "layers": self.settings.layers, "params": counts.total,
                  "active_params": counts.active, "flops_per_token": flops, "tokens": tokens,
                  "compute": float(flops) * tokens, "loss": summary["val_bpb"], "val_nats": summary["val_loss"],
                  "seed": seed, "lr": lr, "steps": steps, "seconds": round(seconds, 1), "started": started,
                  "settings": self.settings.key()}
        write_atomic(folder / "point.json", (json.dumps(record, indent=1) + "\n").encode())
        self._prune(folder, keep=stable_steps(steps, self.settings.decay_frac))
        return record

    def _tokenizer(self, cfg) -> None:
        """STORE/tokenizer, trained once on the store's data (every point then names it, so a branch's
        config equals its source's), and the tokenised data cache, built once (under the store's lock:
        processes sharing the store wait for the first)."""
        from openk3.data.shards import build_dataset
        from openk3.tokenizer import Tokenizer
        from openk3.train.run_tokenizer import train_tokenizer

        with _locked(self.root / "store.lock"):
            if not (self.root / "tokenizer" / "tiktoken.model").is_file():
                train_tokenizer(dataclasses.replace(cfg, tokenizer=None), self.root)  # (temp folder + rename)
            build_dataset(cfg.data, Tokenizer.from_dir(str(self.root / "tokenizer")), cfg.cache_dir, progress=False)

    def _branch(self, arm: str, width: int, short: int, steps: int, lr: float, seed: int, folder: Path) -> str:
        """Seed `folder` with the shorter budget's stable-phase checkpoint (training it first if needed)."""
        from openk3.checkpoint.runs import list_checkpoints

        at = stable_steps(short, self.settings.decay_frac)
        if at < self.settings.warmup_steps or at >= steps:
            return "from scratch"
        src = self.folder(arm, width, short, lr, seed)
        if self.done(arm, width, short, lr, seed) is None:
            self.point(arm, width, short, lr, seed)
        ckpts = dict(list_checkpoints(src))
        if at not in ckpts:
            return "from scratch"  # (pruned or never saved: the long budget runs whole)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "checkpoints").mkdir(parents=True)
        shutil.copytree(ckpts[at], tmp / "checkpoints" / ckpts[at].name)
        for name in ("train_config.json", "metrics.jsonl"):
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        _cut_metrics(tmp / "metrics.jsonl", at)
        tmp.rename(folder)
        return f"branched at step {at} of the {short}-step budget"

    def _prune(self, folder: Path, keep: int) -> None:
        """Keep only the stable-phase checkpoint (what longer budgets branch from); the final weights are not
        needed once point.json holds the loss (points are many; a checkpoint of the largest is ~10 MB)."""
        from openk3.checkpoint.runs import list_checkpoints

        for step, path in list_checkpoints(folder):
            if step != keep:
                shutil.rmtree(path, ignore_errors=True)
        latest = folder / "checkpoints" / "latest"
        if latest.is_symlink() or latest.is_file():
            latest.unlink()


class _locked:
    """An exclusive lock on `path` (fcntl, released when the process dies) for the `with` body."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self):
        import fcntl

        self.f = open(self.path, "a+")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        import fcntl

        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def _cut_metrics(path: Path, step: int) -> None:
    """Drop the metrics records after `step` (the copied run's decay phase is not the branch's history)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(rec.get("step", 0)) <= step:
            keep.append(line)
    write_atomic(path, ("\n".join(keep) + "\n").encode() if keep else b"")
