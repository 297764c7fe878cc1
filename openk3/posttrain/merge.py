"""Weight merging for the merge ablation (issue 18 item 5; background §2.4, §3.7): pure functions on state dicts.

Every method combines N fine-tuned models theta_i that share one base theta_0 (the SFT checkpoint the
nine teachers started from), through their task vectors tau_i = theta_i - theta_0:

    linear            sum_i w_i theta_i                                  (model soup; base unused)
    task_arithmetic   theta_0 + lam * sum_i w_i tau_i                    (w uniform: lam * mean tau)
    ties              theta_0 + lam * disjoint_mean(elect(trim(tau_i)))  (TIES-merging)
    dare_ties         TIES sign election and disjoint mean over DARE-dropped tau_i (no magnitude trim)
    dare_task_arithmetic  task arithmetic over DARE-dropped tau_i       (mergekit's `dare_linear`)
    model_stock       t * mean_i theta_i + (1 - t) * theta_0, t per tensor from the tau_i's cosines

`weights` (default uniform) are relative: they are normalised to sum 1, so `lam` is the only scale.
Definitions follow mergekit's docs (`docs/merge_methods.md`, `merge_methods/model_stock.py`):

* trim: per tensor and model, keep the int(density * numel) entries of largest |tau_i| (ties broken
  by position), zero the rest;
* elect: per entry, the sign of sum_i w_i tau_i (mergekit's "sum" consensus);
* disjoint mean: per entry, sum_i w_i tau_i / sum_i w_i over the models whose tau_i is non-zero with
  the elected sign (0 where none is);
* DARE: each entry of tau_i is kept with probability `density` and rescaled by 1 / density (so the
  expectation is tau_i), the mask drawn from a generator seeded by (seed, model index, tensor name):
  reproducible, independent of the order of the keys; density 1 keeps everything, exactly;
* Model Stock: cos = mean over pairs i < j of cos(tau_i, tau_j) (a zero task vector has cosine 0 with
  everything), clamped to [0, 1], t = N cos / (1 + (N - 1) cos). A negative mean cosine (task
  vectors pointing apart) would put t below 0 or at the formula's pole; the clamp gives t = 0
  (theta_0). N identical task vectors give cos = t = 1, the mean model.

Arithmetic runs in float64 and the result is cast back to each tensor's dtype, so identical inputs give
identical outputs bit for bit (and `linear` with weights (1, 0, ...) returns the first model).

Tensors that are not floating point are copied from the base when every model holds the same value
(a ValueError names the key otherwise). MXFP4-packed routed experts (`openk3.load(..., keep_packed=True)`:
uint8 `<name>_packed` + `<name>_scale` pairs, `openk3/quant/mxfp4.py`) are dequantised to float32,
merged, and requantised with `mxfp4.pack`; the rounding this costs is recorded per tensor in the
report (`quant_error`: max |error| and RMS error relative to the merged tensor's RMS).
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from openk3.quant.mxfp4 import pack, unpack

METHODS = ("linear", "task_arithmetic", "ties", "dare_ties", "dare_task_arithmetic", "model_stock")
StateDict = Mapping[str, torch.Tensor]

_PACKED, _SCALE = "_packed", "_scale"


@dataclasses.dataclass
class MergeResult:
    """The merged state dict (the base's keys, dtypes and shapes) and what the merge measured."""

    state_dict: dict[str, torch.Tensor]
    report: dict[str, Any]


# --- per tensor (float64 in, float64 out) -----------------------------------------------------------


def _trim(tau: torch.Tensor, density: float) -> torch.Tensor:
    """tau with all but its int(density * numel) largest-magnitude entries set to 0."""
    k = int(density * tau.numel())
    if k >= tau.numel():
        return tau
    flat = tau.reshape(-1)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[torch.argsort(flat.abs(), descending=True, stable=True)[:k]] = True
    return torch.where(keep, flat, 0).reshape(tau.shape)


def _ties_combine(taus: list[torch.Tensor], w: list[float]) -> torch.Tensor:
    """Sign election + disjoint weighted mean over already sparsified task vectors."""
    weighted = torch.stack([wi * t for wi, t in zip(w, taus)])
    elected = torch.sign(weighted.sum(0))
    agree = (torch.sign(torch.stack(taus)) == elected) & (elected != 0)
    w_col = torch.tensor(w, dtype=weighted.dtype).reshape(-1, *[1] * taus[0].dim())
    num = torch.where(agree, weighted, 0).sum(0)
    den = torch.where(agree, w_col.expand_as(weighted), 0).sum(0)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1), 0)


def _dare(tau: torch.Tensor, density: float, seed: int, index: int, name: str) -> torch.Tensor:
    if density >= 1:
        return tau
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{index}:{name}".encode()))
    keep = torch.rand(tau.shape, generator=g, dtype=torch.float64) < density
    return torch.where(keep, tau / density, 0)


def _model_stock_t(taus: list[torch.Tensor]) -> float:
    flat = [t.reshape(-1) for t in taus]
    norms = [float(f.norm()) for f in flat]
    cos = []
    for i in range(len(flat)):
        for j in range(i + 1, len(flat)):
            den = norms[i] * norms[j]
            cos.append(float(flat[i] @ flat[j]) / den if den > 0 else 0.0)
    c = min(max(sum(cos) / len(cos), 0.0), 1.0)
    n = len(taus)
    return n * c / (1 + (n - 1) * c)


def _wsum(w: list[float], ts: list[torch.Tensor]) -> torch.Tensor:
    """sum_i w_i t_i, starting from the first term (Python's sum starts at 0, and 0 + -0.0 is +0.0)."""
    out = w[0] * ts[0]
    for wi, t in zip(w[1:], ts[1:]):
        out = out + wi * t
    return out


def _merge_tensor(name: str, base: torch.Tensor, thetas: list[torch.Tensor], method: str, w: list[float], *,
                  lam: float, density: float, seed: int, info: dict[str, Any]) -> torch.Tensor:
    """One float64 tensor merged; `info` collects per-tensor measurements (Model Stock's t).

    Entries that no model changed come back bit for bit (the base's, or for `linear` the models'
    common value), signed zeros included: MXFP4 codes -0 and +0 are different bytes.
    """
    if method == "linear":
        same = torch.stack([t == thetas[0] for t in thetas]).all(0)
        return torch.where(same, thetas[0], _wsum(w, thetas))
    taus = [t - base for t in thetas]
    unchanged = torch.stack([tau == 0 for tau in taus]).all(0)
    if method == "model_stock":
        t = _model_stock_t(taus)
        info.setdefault("model_stock_t", {})[name] = t
        merged = t * _wsum([1 / len(thetas)] * len(thetas), thetas) + (1 - t) * base
        return torch.where(unchanged, base, merged)
    if method in ("dare_ties", "dare_task_arithmetic"):
        taus = [_dare(tau, density, seed, i, name) for i, tau in enumerate(taus)]
    if method == "ties":
        taus = [_trim(tau, density) for tau in taus]
    delta = _ties_combine(taus, w) if method in ("ties", "dare_ties") else _wsum(w, taus)
    return torch.where(unchanged, base, base + lam * delta)


# --- state dicts --------------------------------------------------------------------------------------


def check_compatible(base: StateDict, models: Sequence[StateDict]) -> None:
    """Every model must have exactly the base's keys, with the same shapes and dtypes.

    Raises ValueError naming the model (by position, 1-based) and the first offending key.
    """
    if not models:
        raise ValueError("merge: no models to merge")
    for i, sd in enumerate(models, 1):
        missing = [k for k in base if k not in sd]
        if missing:
            raise ValueError(f"merge: model {i} has no tensor {missing[0]!r} (the base has it)")
        extra = [k for k in sd if k not in base]
        if extra:
            raise ValueError(f"merge: model {i} has a tensor {extra[0]!r} that the base does not")
        for k, t in base.items():
            if tuple(sd[k].shape) != tuple(t.shape):
                raise ValueError(f"merge: tensor {k!r} has shape {tuple(sd[k].shape)} in model {i}, "
                                 f"{tuple(t.shape)} in the base")
            if sd[k].dtype != t.dtype:
                raise ValueError(f"merge: tensor {k!r} is {sd[k].dtype} in model {i}, {t.dtype} in the base")


def _weights(weights: Sequence[float] | None, n: int) -> list[float]:
    if weights is None:
        return [1.0 / n] * n
    w = [float(x) for x in weights]
    if len(w) != n:
        raise ValueError(f"merge: {len(w)} weights for {n} models")
    if not all(math.isfinite(x) and x >= 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"merge: weights must be finite, >= 0 and not all 0, got {list(weights)}")
    return [x / sum(w) for x in w]


def _packed_pairs(sd: StateDict) -> dict[str, tuple[str, str]]:
    """logical name -> (packed key, scale key) for the MXFP4 experts of a state dict."""
    out = {}
    for k, t in sd.items():
        if k.endswith(_PACKED) and t.dtype == torch.uint8:
            name = k[: -len(_PACKED)]
            if sd.get(name + _SCALE) is not None and sd[name + _SCALE].dtype == torch.uint8:
                out[name] = (k, name + _SCALE)
    return out


def merge(base: StateDict, models: Sequence[StateDict], method: str, *, weights: Sequence[float] | None = None,
          lam: float = 1.0, density: float = 1.0, seed: int = 0) -> MergeResult:
    """Merge `models` onto `base` with `method` (one of `METHODS`; see the module docstring).

    Args:
        base: theta_0, the models' common starting point (for `linear` only its keys are used).
        models: the fine-tuned state dicts; `model_stock` needs at least 2.
        weights: relative model weights (normalised to sum 1); default uniform. `model_stock` takes
            none: its weighting comes from the geometry.
        lam: scale of the merged task vector (task arithmetic, TIES, DARE).
        density: share of each task vector kept: by magnitude for `ties`, at random for `dare_*`;
            in (0, 1].
        seed: DARE's drop masks.

    Returns a `MergeResult`: the merged state dict (new tensors, the base's dtypes) and a report
    {"method", "models", "weights", "lam", "density", "seed", "tensors", "quant_error"
    {name: {"max_abs", "rel_rms"}} for requantised MXFP4 experts, "model_stock_t" {name: t}}.

    Raises ValueError naming the key or argument for mismatched state dicts, an unknown method, bad
    weights / density / lam, or differing non-float tensors.
    """
    if method not in METHODS:
        raise ValueError(f"merge: method must be one of {METHODS}, got {method!r}")
    check_compatible(base, models)
    if method == "model_stock" and len(models) < 2:
        raise ValueError("merge: model_stock needs at least 2 models (it measures angles between task vectors)")
    if method == "model_stock" and weights is not None:
        raise ValueError("merge: model_stock takes no weights (its interpolation comes from the task vectors' angles)")
    if not (isinstance(density, (int, float)) and 0 < density <= 1):
        raise ValueError(f"merge: density must be in (0, 1], got {density!r}")
    if not math.isfinite(lam):
        raise ValueError(f"merge: lam must be finite, got {lam!r}")
    w = _weights(weights, len(models))
    pairs = _packed_pairs(base)
    in_pair = {k for pk in pairs.values() for k in pk}
    info: dict[str, Any] = {}
    quant_error: dict[str, dict[str, float]] = {}
    out: dict[str, torch.Tensor] = {}

    def run(name: str, b: torch.Tensor, ts: list[torch.Tensor]) -> torch.Tensor:
        return _merge_tensor(name, b.double(), [t.double() for t in ts], method, w, lam=lam, density=density,
                             seed=seed, info=info)

    for name, (pk, sk) in pairs.items():
        # dequantise -> merge in float64 -> round to float32 (what pack reads) -> requantise
        b = unpack(base[pk], base[sk], torch.float32)
        merged = run(name, b, [unpack(sd[pk], sd[sk], torch.float32) for sd in models]).float()
        out[pk], out[sk] = pack(merged)
        err = merged - unpack(out[pk], out[sk], torch.float32)
        rms = float(merged.square().mean().sqrt())
        quant_error[name] = {"max_abs": float(err.abs().max()) if err.numel() else 0.0,
                             "rel_rms": float(err.square().mean().sqrt()) / rms if rms > 0 else 0.0}
    for k, b in base.items():
        if k in in_pair:
            continue
        if not b.is_floating_point():
            for i, sd in enumerate(models, 1):
                if not torch.equal(sd[k], b):
                    raise ValueError(f"merge: non-float tensor {k!r} differs between the base and model {i}; "
                                     "it cannot be averaged")
            out[k] = b.clone()
            continue
        out[k] = run(k, b, [sd[k] for sd in models]).to(b.dtype)
    report = {"method": method, "models": len(models), "weights": w, "lam": lam, "density": density, "seed": seed,
              "tensors": len(out), "quant_error": quant_error, **info}
    return MergeResult({k: out[k] for k in base}, report)


def linear(models: Sequence[StateDict], weights: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
    """Weighted average of the models (a model soup)."""
    return merge(models[0] if models else {}, models, "linear", weights=weights).state_dict


def task_arithmetic(base: StateDict, models: Sequence[StateDict], *, lam: float = 1.0,
                    weights: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
    """theta_0 + lam * sum_i w_i tau_i (uniform w: lam * mean tau)."""
    return merge(base, models, "task_arithmetic", lam=lam, weights=weights).state_dict


def ties(base: StateDict, models: Sequence[StateDict], *, density: float = 0.5, lam: float = 1.0,
         weights: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
    """TIES: trim each tau_i to its top-`density` magnitudes, elect signs, disjoint mean, scale by lam."""
    return merge(base, models, "ties", density=density, lam=lam, weights=weights).state_dict


def dare(base: StateDict, models: Sequence[StateDict], *, density: float, seed: int = 0, then: str = "ties",
         lam: float = 1.0, weights: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
    """DARE: drop tau entries with probability 1 - density, rescale by 1/density, then TIES' sign
    consensus (`then="ties"`, mergekit's dare_ties) or task arithmetic (`then="task_arithmetic"`,
    mergekit's dare_linear)."""
    if then not in ("ties", "task_arithmetic"):
        raise ValueError(f"dare: then must be 'ties' or 'task_arithmetic', got {then!r}")
    method = f"dare_{then}"
    return merge(base, models, method, density=density, seed=seed, lam=lam, weights=weights).state_dict


def model_stock(base: StateDict, models: Sequence[StateDict]) -> dict[str, torch.Tensor]:
    """Model Stock: per tensor t from the task vectors' mean cosine; t * mean theta_i + (1 - t) theta_0."""
    return merge(base, models, "model_stock").state_dict


# ---- checkpoints ------------------------------------------------------------------------------------------

#: Density used when none is given: inside §3.7's tuning ranges.
DEFAULT_DENSITY = {"ties": 0.5, "dare_ties": 0.3, "dare_task_arithmetic": 0.3}
REPORT_FILE = "merge_report.json"


def config_difference(base, other) -> str | None:
    """The first architecture field (name = base value vs other value) in which two configs differ, or
    None. Metadata kept in `extra` (wrapper fields, quantization_config, ...) is not compared."""
    a, b = dataclasses.asdict(base), dataclasses.asdict(other)
    for key in a:
        if key != "extra" and a[key] != b[key]:
            return f"{key} = {a[key]!r} in the base, {b[key]!r} here"
    return None


def merge_checkpoints(base: str | os.PathLike, models: Sequence[str | os.PathLike], out: str | os.PathLike,
                      method: str, *, weights: Sequence[float] | None = None, lam: float = 1.0,
                      density: float | None = None, seed: int = 0, dtype: str | torch.dtype | None = "auto"
                      ) -> dict:
    """Merge release-format checkpoints (or run folders: their latest checkpoint) that share `base` and write
    the result to `out` (atomically, in the base's expert format, with the base's other files and
    `merge_report.json`); returns that report. Every config must equal the base's and all must share one
    routed-expert format (MXFP4 experts are dequantised, merged and requantised, the error recorded). `dtype`:
    the output's on-disk dtype for what is not an fp32 island or MXFP4 bytes ("auto": as in the base). All
    N + 1 models are held in memory in float32 at once: this is for the ablation's model sizes. Reports one
    "[merge] ..." line."""
    import json
    import tempfile

    from openk3.checkpoint import load, read_config, resolve_checkpoint, save
    from openk3.checkpoint.save import carried_files
    from openk3.log import reporter

    base = resolve_checkpoint(base)
    folders = [resolve_checkpoint(m) for m in models]
    out = os.path.abspath(out)
    for p in (base, *folders):
        if os.path.abspath(p) == out:
            raise ValueError(f"--out {out} is one of the inputs ({p}); write the merge elsewhere")
    if weights is not None and len(weights) != len(folders):
        raise ValueError(f"--weights: {len(weights)} weights for {len(folders)} models")
    density = density if density is not None else DEFAULT_DENSITY.get(method, 1.0)

    def experts_format(cfg) -> str:
        return "mxfp4" if "quantization_config" in cfg.extra else "float"

    base_cfg = read_config(base)
    packed = experts_format(base_cfg) == "mxfp4"
    for m in folders:
        cfg = read_config(m)
        diff = config_difference(base_cfg, cfg)
        if diff is not None:
            raise ValueError(f"{m / 'config.json'}: config differs from the base {base}: {diff}")
        if experts_format(cfg) != experts_format(base_cfg):
            raise ValueError(f"{m}: routed experts are {experts_format(cfg)}, the base's are "
                             f"{experts_format(base_cfg)}; convert one side first (openk3 convert --experts)")
    # the base, as the output's container, in the output dtype (auto: as on disk); MXFP4 experts stay
    # packed so that `merge` dequantises, merges and requantises them and records the error
    model = load(base, dtype=dtype, keep_packed=packed)
    out_dtype = model.model.embed_tokens.weight.dtype

    def fp32(sd):
        return {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}

    base_sd = fp32(model.state_dict())
    model_sds = [load(m, dtype=torch.float32, keep_packed=packed).state_dict() for m in folders]
    result = merge(base_sd, model_sds, method, weights=weights, lam=lam, density=density, seed=seed)
    del model_sds
    model.load_state_dict(result.state_dict)
    report = {"base": str(base), "models": [str(m) for m in folders], "dtype": str(out_dtype).removeprefix("torch."),
              "experts": "mxfp4" if packed else "float", **result.report}
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, REPORT_FILE)
        with open(report_path, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
        save(model, out, dtype=out_dtype, extra_files={**carried_files(str(base)), REPORT_FILE: report_path})
    worst = max((e["rel_rms"] for e in result.report["quant_error"].values()), default=None)
    quant = f"; MXFP4 requantisation error <= {worst:.2e} relative RMS" if worst is not None else ""
    reporter("merge").info(f"{method} of {len(folders)} models onto {base} -> {out} (lam {lam}, density {density}, "
                           f"{report['dtype']}{quant})")
    return report
