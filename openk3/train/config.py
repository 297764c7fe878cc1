"""`TrainConfig`: everything a training run needs, as one frozen dataclass with nested sections.

    cfg = TrainConfig(model=preset("nano"), max_steps=200)
    cfg = apply_overrides(cfg, ["optim.lr=1e-3", "model.hidden_size=64", "data.max_bytes=300000"])
    cfg.to_json("run/train_config.json"); TrainConfig.from_json("run/train_config.json")

Sections: `model` (a `K3Config`, usually a preset), `optim` (`OptimConfig`), `data` (`DataConfig`),
`parallel` (`openk3.parallel.mesh.ParallelConfig`: degrees, e.g. `parallel.dp_shard=2` under torchrun);
the loop's own fields (`LoopConfig`, which SFT's config shares) sit at the top level. Overrides are
`key=value` strings with dotted keys (`model.linear_attn_config.full_attn_layers=[4]`), converted to the
declared type of the field:
int, float, bool (true/false/1/0/yes/no/on/off), str, None (`none`/`null` where the field allows it),
tuples and lists (`[0.9,0.95]`, `(a,b)` or `a,b`). An unknown key raises a ValueError that lists
the closest known keys; a value that does not fit raises one naming the key and the value.

Resuming: `resume_changes(old, new)` splits the differences between a checkpoint's config and the
new one into those that may change freely (`RESUME_FREE`: length, cadence, where and how fast it
runs) and those that change the run's maths (everything else), which `train` refuses unless told.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import torch

from openk3.config import K3Config, LinearAttnConfig, preset
from openk3.data import DataConfig
from openk3.fsutil import read_json, write_atomic
from openk3.parallel.mesh import ParallelConfig
from openk3.train.optim import OptimConfig

DTYPES = ("fp32", "bf16")
SCHEDULES = ("cosine", "wsd", "constant")
BALANCES = ("qb", "sign")  # Quantile Balancing (K3) | DeepSeek-V3's sign rule (K2-style baseline)

# Fields a resumed run may change without `allow_config_change`: they do not change what the
# remaining steps compute. `max_steps` is here because extending a run is the common case; note that
# the LR schedule (and a fractional `warmup`) is recomputed for the new length. The model's special
# token ids are derived from the tokenizer each start (runs saved before that was done differ there).
RESUME_FREE = frozenset({
    "max_steps", "eval_every", "eval_batches", "save_every", "keep_checkpoints", "log_every", "samples",
    "sample_tokens", "threads", "device", "activation_checkpointing", "cache_dir", "peak_flops", "preset",
    "compile",  # the same maths, compiled
    "grad_accum",  # the same global batch in smaller pieces: the same steps
    "model.bos_token_id", "model.eos_token_id", "model.pad_token_id",
    # the same global batch gives the same steps at any world size, so a run may resume on another one
    "parallel.dp_shard", "parallel.dp_replicate", "parallel.ep", "parallel.pp", "parallel.cp",
})


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """The loop's section, shared by pretraining (`TrainConfig`) and SFT (`posttrain.trainers.sft.SFTConfig`),
    which inherit it (the fields sit at their top level, so their config files and `key=value` overrides stay flat):
    how one step is taken (batch, precision, optimizer, schedule, balancing) and the run's cadence."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    batch_size: int = 8  # the global batch (rows per optimizer step, all ranks and micro-batches together)
    grad_accum: int = 1  # micro-batches per step on each rank: activations of batch_size / (dp * grad_accum) rows
    seq_len: int = 256
    max_steps: int | None = 1000  # (SFT: None = `epochs` passes over the data)
    eval_every: int = 100  # 0: only at the end
    eval_batches: int | None = 20  # None: the whole validation split
    save_every: int = 500  # 0: only at the end
    keep_checkpoints: int | None = None  # None: keep all; N: keep the newest N
    log_every: int = 10  # console lines; metrics.jsonl gets every step
    seed: int = 0
    dtype: str = "fp32"  # "fp32" | "bf16" (autocast; params, optimizer state, fp32 islands stay fp32); bfloat16 ok
    device: str = "cpu"
    # schedule
    schedule: str = "cosine"
    warmup: float = 0.01  # < 1: fraction of max_steps; >= 1: steps
    min_lr_ratio: float = 0.1
    decay_frac: float = 0.2  # WSD only
    # balancing and stability
    # "qb": Quantile Balancing at qb_rate; "sign": b_j += sign_rate * sign(mean load - load_j) after each step
    # (openk3.train.balance), the K2-style baseline. Each rule reads only its own rate: with "sign", qb_rate is
    # ignored (sign_rate=0 then freezes the biases), so a run switches rule by one field.
    balance: str = "qb"
    qb_rate: float = 1.0  # Quantile Balancing rate; 0 disables QB (SFT: freezes the expert biases)
    sign_rate: float = 1e-3  # the sign rule's bias update speed u (DeepSeek-V3's 0.001)
    qk_clip: bool = False  # MuonClip with optim.qk_clip_tau
    threads: int | None = None  # None: $OPENK3_THREADS / $OMP_NUM_THREADS, else measured (train/threads.py)
    peak_flops: float | None = None  # FLOP/s for MFU; None: the CPU table x threads (no figure on CUDA)
    # torch.compile the model's forward (and so its backward) in each step: offered where
    # tests/test_compiled_train.py shows a compiled step's losses, gradients and expert-bias updates equal eager's
    # (one process on the CPU, float32, no qk_clip / aux loss / activation checkpointing); elsewhere a ValueError
    compile: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            # Same spellings as every other --dtype (bfloat16, float32, ...), stored canonically so a
            # resumed run compares equal; object.__setattr__ because the dataclass is frozen.
            from openk3.common import resolve_dtype

            try:
                canonical = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(resolve_dtype(self.dtype))
            except ValueError:
                canonical = None
            if canonical is not None:
                object.__setattr__(self, "dtype", canonical)
        for name in ("batch_size", "grad_accum", "seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {self.max_steps}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} must divide into grad_accum={self.grad_accum} "
                             f"micro-batches (on every data-parallel rank)")
        for name in ("eval_batches", "keep_checkpoints", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES} (or bfloat16, float32), got {self.dtype!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {self.balance!r}")
        for name in ("qb_rate", "sign_rate"):
            if not getattr(self, name) >= 0:  # (NaN too)
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    # ---- derived ----
    @property
    def warmup_steps(self) -> int:
        return int(round(self.warmup * self.max_steps)) if self.warmup < 1 else int(self.warmup)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass(frozen=True, kw_only=True)
class TrainConfig(LoopConfig):
    model: K3Config = field(default_factory=lambda: preset("nano"))
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # degrees; torchrun gives the processes
    preset: str | None = "nano"  # name the model section came from (informational)
    max_steps: int = 1000
    activation_checkpointing: bool = False
    aux_loss_coef: float = 0.0  # > 0: add the sequence-wise auxiliary balance loss (for comparison)
    # tokenizer and data plumbing
    tokenizer: str | None = None  # a tokenizer folder; None: train one (model.vocab_size) into <out>/tokenizer
    cache_dir: str | None = None  # tokenised-data cache; None: <out>/../.cache
    # end-of-run samples
    samples: int = 2
    sample_tokens: int = 32

    def validate(self) -> None:
        super().validate()
        if self.max_steps is None:
            raise ValueError("max_steps must be >= 0, got None")
        if self.sample_tokens < 1:
            raise ValueError(f"sample_tokens must be >= 1, got {self.sample_tokens}")
        if self.samples < 0:
            raise ValueError(f"samples must be >= 0, got {self.samples}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "model":
                out[f.name] = v.to_dict()
            elif dataclasses.is_dataclass(v):
                out[f.name] = dataclasses.asdict(v)
            else:
                out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "train config") -> TrainConfig:
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {_with_hints(unknown, names)}")
        kwargs: dict[str, Any] = {}
        hints = typing.get_type_hints(cls)
        for k, v in d.items():
            if k == "model":
                kwargs[k] = K3Config.from_dict(v, source=f"{source}: model")
            elif k in ("optim", "data", "parallel"):
                kwargs[k] = _dataclass_from_dict(hints[k], v, f"{source}: {k}")
            else:
                kwargs[k] = _coerce_json(hints[k], v, f"{source}: {k}")
        return cls(**kwargs)

    def to_json(self, path: str | os.PathLike) -> None:
        """Write atomically (temp file + rename)."""
        write_atomic(path, (json.dumps(self.to_dict(), indent=2) + "\n").encode())

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TrainConfig:
        return cls.from_dict(read_json(path), source=str(path))


# ---- resuming ------------------------------------------------------------------------------------------

def config_diff(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs between two config dicts."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{k}.")
        elif _plain(a) != _plain(b):
            out.append((f"{prefix}{k}", a, b))
    return out


def _plain(v: Any) -> Any:
    """Tuples as lists: a config read back from JSON or torch.save must compare equal to the live one."""
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


# Fields added after run folders were first written, with the value a config saved without them ran as:
# resuming such a run compares against that value, not against "missing" (which would read as a change of
# the run's maths and be refused). Loading one (`from_dict`) needs nothing: the dataclass default fills it.
ADDED_DEFAULTS = {"balance": "qb", "sign_rate": 1e-3, "optim.muon": True}


def with_added_defaults(d: dict) -> dict:
    """A copy of config dict `d` with the `ADDED_DEFAULTS` it lacks filled in (sections it has only)."""
    out = dict(d)
    for key, value in ADDED_DEFAULTS.items():
        *section, leaf = key.split(".")
        parent = out
        for name in section:
            if not isinstance(parent.get(name), dict):
                break
            child = dict(parent[name])  # copied: `d` is left as it was
            parent[name] = child
            parent = child
        else:
            parent.setdefault(leaf, value)
    return out


def resume_changes(old: dict, new: dict, free_keys=None) -> tuple[list[str], list[str]]:
    """(free, refused): "key: old -> new" lines for the differences between the config a checkpoint
    was trained with (`old`, a `to_dict()`; fields it predates read as `ADDED_DEFAULTS`) and `new`; refused
    ones change the run's maths. `free_keys`: the keys that may always change (default RESUME_FREE,
    pretraining's; SFT passes its own)."""
    free_keys = RESUME_FREE if free_keys is None else free_keys
    free, refused = [], []
    for key, a, b in config_diff(with_added_defaults(old), new):
        (free if key in free_keys else refused).append(f"{key}: {a!r} -> {b!r}")
    return free, refused


# ---- overrides ------------------------------------------------------------------------------------------

def _with_hints(unknown: list[str], known) -> str:
    parts = []
    for u in unknown:
        close = difflib.get_close_matches(u, list(known), n=3, cutoff=0.5)
        parts.append(f"{u!r} (did you mean {', '.join(repr(c) for c in close)}?)" if close else repr(u))
    return ", ".join(parts)


def _fields_of(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation of a dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_SECTIONS = {"model": K3Config, "optim": OptimConfig, "data": DataConfig, "parallel": ParallelConfig}
_NESTED = {(K3Config, "linear_attn_config"): LinearAttnConfig}


def override_keys() -> list[str]:
    """Every settable dotted key (what unknown-key suggestions are drawn from)."""
    keys = []
    for name in _fields_of(TrainConfig):
        if name in _SECTIONS:
            cls = _SECTIONS[name]
            for sub in _fields_of(cls):
                if sub == "extra":
                    continue
                nested = _NESTED.get((cls, sub))
                if nested is not None:
                    keys += [f"{name}.{sub}.{leaf}" for leaf in _fields_of(nested)]
                else:
                    keys.append(f"{name}.{sub}")
        else:
            keys.append(name)
    return keys


def _resolve(key: str) -> tuple[str, str | None, Any]:
    """key -> (section or top field, sub-key within the section or None, type)."""
    parts = key.split(".")
    head = parts[0]
    top = _fields_of(TrainConfig)
    if head in _SECTIONS and len(parts) >= 2:
        cls = _SECTIONS[head]
        fields = _fields_of(cls)
        sub = parts[1]
        if sub in fields and sub != "extra":
            nested = _NESTED.get((cls, sub))
            if nested is None and len(parts) == 2:
                return head, sub, fields[sub]
            if nested is not None and len(parts) == 3:
                nf = _fields_of(nested)
                if parts[2] in nf:
                    return head, f"{sub}.{parts[2]}", nf[parts[2]]
    elif head in top and head not in _SECTIONS and len(parts) == 1:
        return head, None, top[head]
    raise ValueError(f"unknown config key {_with_hints([key], override_keys())}")


def _split_seq(text: str) -> list[str]:
    s = text.strip()
    if len(s) >= 2 and s[0] + s[-1] in ("[]", "()"):
        s = s[1:-1]
    return [p.strip() for p in s.split(",") if p.strip()]


_ORDER = (bool, int, float, list, tuple, str)


def _rank(tp: Any) -> int:
    o = typing.get_origin(tp) or tp
    return _ORDER.index(o) if o in _ORDER else len(_ORDER)


def parse_value(tp: Any, text: str) -> Any:
    """`text` converted to annotation `tp` (raises ValueError/TypeError on a mismatch)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and text.strip().lower() in ("none", "null"):
            return None
        order = sorted((a for a in args if a is not type(None)), key=_rank)
        errors = []
        for a in order:
            try:
                return parse_value(a, text)
            except (ValueError, TypeError) as e:
                errors.append(str(e))
        raise ValueError("; ".join(errors) or "no type fits")
    if tp is Any:
        return text
    if tp is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"not a bool: {text!r}")
    if tp is int:
        s = text.strip()
        try:
            return int(s)
        except ValueError:
            try:
                f = float(s)  # "1e3"
            except ValueError:
                raise ValueError(f"not an integer: {text!r}") from None
            if not f.is_integer():
                raise ValueError(f"not an integer: {text!r}") from None
            return int(f)
    if tp is float:
        return float(text.strip())
    if tp is str:
        return text
    if origin in (tuple, list):
        args = typing.get_args(tp)
        items = _split_seq(text)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(items) != len(args):
                raise ValueError(f"expected {len(args)} items, got {len(items)}")
            return tuple(parse_value(a, s) for a, s in zip(args, items))
        elem = args[0] if args else str
        vals = [parse_value(elem, s) for s in items]
        return tuple(vals) if origin is tuple else vals
    raise ValueError(f"cannot set a field of type {tp}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) if typing.get_origin(tp) is None else str(tp).replace("typing.", "")


def _derive_layout(model: K3Config, vals: dict[str, Any]) -> dict[str, Any]:
    """Layer lists follow a changed depth unless given: `num_hidden_layers` alone re-derives
    `full_attn_layers` with K3's rule (every 4th layer + the last); a changed `full_attn_layers`
    re-derives `kda_layers` (the rest)."""
    vals = dict(vals)
    if "num_hidden_layers" in vals and "linear_attn_config.full_attn_layers" not in vals:
        from openk3.config import hybrid_layers

        vals["linear_attn_config.full_attn_layers"] = hybrid_layers(vals["num_hidden_layers"])
    if "linear_attn_config.full_attn_layers" in vals and "linear_attn_config.kda_layers" not in vals:
        vals["linear_attn_config.kda_layers"] = None
    return vals


def apply_overrides(cfg: TrainConfig, overrides: list[str] | tuple[str, ...]) -> TrainConfig:
    """A copy of `cfg` with `key=value` overrides applied, typed against the dataclass fields."""
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        head, sub, tp = _resolve(key)
        try:
            value = parse_value(tp, text)
        except (ValueError, TypeError) as e:
            raise ValueError(f"bad value for {key}: {text!r} (expected {_type_name(tp)}: {e})") from None
        if sub is None:
            top[head] = value
        else:
            sections.setdefault(head, {})[sub] = value
    changes = dict(top)
    for head, vals in sections.items():
        current = getattr(cfg, head)
        try:
            if head == "model":
                changes[head] = current.replace(**_derive_layout(current, vals))
            else:
                changes[head] = dataclasses.replace(current, **vals)
        except (ValueError, TypeError) as e:
            raise ValueError(f"overrides {sorted(f'{head}.{k}' for k in vals)}: {e}") from None
    try:
        return dataclasses.replace(cfg, **changes)
    except (ValueError, TypeError) as e:
        raise ValueError(f"overrides {sorted(changes)}: {e}") from None


# ---- JSON coercion (lists back to tuples) -------------------------------------------------------------

def _coerce_json(tp: Any, v: Any, source: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None:
            return None
        for a in typing.get_args(tp):
            if a is type(None):
                continue
            if typing.get_origin(a) is tuple and isinstance(v, list):
                return tuple(v)
        return v
    if origin is tuple and isinstance(v, list):
        return tuple(v)
    return v


def _dataclass_from_dict(cls: type, d: Any, source: str) -> Any:
    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected an object")
    fields = _fields_of(cls)
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"{source}: unknown field(s) {_with_hints(unknown, fields)}")
    return cls(**{k: _coerce_json(fields[k], v, f"{source}.{k}") for k, v in d.items()})
