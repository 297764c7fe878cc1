"""`load(path)` and `read_config(path)`: a checkpoint folder -> `K3ForCausalLM` (see `openk3.checkpoint`)."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from pathlib import Path

import torch
import torch.nn as nn

from openk3.checkpoint import files
from openk3.checkpoint.layout import (
    PREFIX,
    ST_FLOATS,
    TORCH_DTYPES,
    VISION_PREFIXES,
    Entry,
    LoadedFormat,
    a_log_accepted_shapes,
    experts_format_of,
    island_dtype,
    layout,
    meta_model,
)
from openk3.common import resolve_device, resolve_dtype
from openk3.config import K3Config
from openk3.quant.mxfp4 import E2M1_MAX, SCALE_BIAS, SCALE_NAN, unpack

LOAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def read_config(path) -> K3Config:
    """The text config of a checkpoint folder (or of a config.json path); wrapper fields go to `extra`.

    Raises FileNotFoundError for a path that does not exist, ValueError naming the file (and field)
    for a folder without config.json or an invalid one.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such checkpoint folder or config file")
    if p.is_dir():
        p = p / "config.json"
        if not p.exists():
            raise ValueError(f"{p.parent}: no config.json (not a checkpoint folder?)")
    try:
        return K3Config.from_json(p)
    except (TypeError, KeyError, AttributeError) as e:  # wrong JSON types for a field
        raise ValueError(f"{p}: invalid config ({type(e).__name__}: {e})") from None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder `path` names: a checkpoint folder itself (it has config.json), its
    config.json, or a training run folder (`openk3 train --out DIR`, or its `checkpoints/` folder), whose
    latest complete checkpoint is used (`checkpoints/latest`, see `openk3.checkpoint.runs.find_latest`).

    Raises FileNotFoundError for a path that does not exist, ValueError naming the path otherwise.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such checkpoint or training run folder")
    if p.is_file():
        if p.name == "config.json":
            return p.parent
        raise ValueError(f"{p}: a file; give a checkpoint folder (with config.json) or a training run folder")
    if (p / "config.json").is_file():
        return p
    if (p / "config.json").exists():  # a folder (or other non-file) where config.json goes
        raise ValueError(f"{p / 'config.json'}: not a file; a checkpoint's config.json must be a JSON file")
    # lazily: the run layout belongs to openk3.train, which a plain checkpoint load never needs
    from openk3.checkpoint.runs import checkpoint_root, find_latest

    run = p.parent if p.name == "checkpoints" and not checkpoint_root(p).is_dir() else p
    ckpt = find_latest(run)
    if ckpt is not None:
        return ckpt
    if checkpoint_root(run).is_dir():
        raise ValueError(f"{p}: a training run folder without a complete checkpoint yet")
    raise ValueError(f"{p}: not a checkpoint folder (no config.json) nor a training run folder (no checkpoints/)")


@dataclasses.dataclass
class Inventory:
    """A checkpoint folder checked against its config (`inventory`), before any tensor data is read."""

    folder: Path
    cfg: K3Config
    experts_format: str
    prefix: str  # "language_model." for a kimi_k3 wrapper, "" for a bare config
    weight_map: dict[str, str]  # file tensor name -> shard file
    headers: dict[str, tuple[str, list[int]]]  # file tensor name -> (safetensors dtype, shape), every tensor
    src: dict[str, str]  # canonical (prefixed) name -> file name (they differ for transformers' dense MLP)
    model: nn.Module  # the config's model on the meta device
    entries: list[Entry]  # its file layout, in reading order


def inventory(path, *, keep_handles: bool = False) -> tuple[Inventory, dict]:
    """Resolve `path` (`resolve_checkpoint`), read its config, index and every shard header, and check
    the tensors against the config: names, shapes, dtypes (`_check`). Reads no tensor data.

    Returns the inventory and the open shard handles (closed and empty unless `keep_handles`).
    Raises FileNotFoundError / ValueError as `load` does.
    """
    folder = resolve_checkpoint(path)
    cfg = read_config(folder)
    fmt = experts_format_of(cfg, str(folder / "config.json"))
    prefix = PREFIX if "_wrapper" in cfg.extra else ""
    wm = files.weight_map(folder)
    info, handles = files.headers(folder, wm)
    try:
        src = {n: n for n in info} if prefix else _transformers_aliases(cfg, info)
        model = meta_model(cfg)
        entries = layout(cfg, fmt, model)
        _check(folder, cfg, fmt, prefix, entries, {name: info[file_name] for name, file_name in src.items()})
    except BaseException:
        files.close(handles)
        raise
    if not keep_handles:
        files.close(handles)
    return Inventory(folder, cfg, fmt, prefix, wm, info, src, model, entries), handles


def load(path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu", *,
         keep_packed: bool = False, experts: str = "memory", expert_cache: int | str | None = None,
         io_threads: int = 4, direct_io: bool | None = None, trunk: str = "bf16",
         trunk_promote: tuple[str, ...] | None = None, trunk_group: int = 32):
    """Build the model of a checkpoint folder and fill it tensor by tensor from its safetensors files.

    Args:
        path: a checkpoint folder, its config.json, or a training run folder (its latest complete
            checkpoint; `resolve_checkpoint`).
        dtype: a torch dtype or a name ("bf16", "float32", ...; "auto" = None).
            None keeps the on-disk dtypes (trunk dtype = that of `model.embed_tokens.weight`; fp32
            islands fp32; MXFP4 experts unpacked to the trunk dtype). A dtype casts like
            `K3ForCausalLM.cast` (islands stay fp32 unless float64).
        device: where the tensors go (each is moved as it is read; peak host memory ~ one model).
        keep_packed: MXFP4 experts stay packed (`openk3.model.packed_experts.PackedExperts`, 4.25 bits/weight) instead
            of being unpacked (exactly) to `dtype`. No effect on a checkpoint with float experts.
        experts: "memory" (default) or "stream": the routed experts (MXFP4 checkpoints only; CPU) stay on disk
            and are read as layers need them into a per-layer cache of `expert_cache` bytes ("22GB", "1.5GiB",
            an int; default half the available memory, at most every expert), by `io_threads` threads, O_DIRECT
            where the filesystem allows (`direct_io` None) or as forced (True / False). Results are bit for bit
            those of `keep_packed=True` (`openk3.stream`; counters: `openk3.stream.stats(model)`).
        trunk: "bf16" (default: the trunk's linears as loaded, in `dtype`), "int8" or "int4": weight-only integer
            linears (`openk3.quant.trunk`), each quantised as its weight is read, so the float trunk is never
            whole in memory; `trunk_promote` names the groups int4 keeps at int8 (default
            `openk3.quant.trunk.DEFAULT_PROMOTE`), `trunk_group` int4's group size (32, 64, 128, 256). CPU;
            activations stay in `dtype`.

    The model gets `loaded_format` (`LoadedFormat`: the experts format and MXFP4 `quantization_config`
    of the files), which `openk3.save` follows by default.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: naming file/tensor/field: invalid config.json or index (or an index entry outside
            the folder), a missing or corrupt shard, missing/unexpected tensors, wrong shapes or dtypes,
            a non-zero `A_log` padding, a weight that is NaN/inf in the file or overflows `dtype`.
    """
    dtype = resolve_dtype(dtype)
    if dtype is not None and dtype not in LOAD_DTYPES:
        raise ValueError(f"dtype must be None or one of {LOAD_DTYPES}, got {dtype!r}")
    if experts not in ("memory", "stream"):
        raise ValueError(f"experts must be 'memory' or 'stream', got {experts!r}")
    stream = experts == "stream"
    if stream and torch.device(device).type != "cpu":
        raise ValueError(f"experts='stream' computes the routed experts on the CPU; device must be cpu, got {device}")
    if not stream and (expert_cache is not None or direct_io is not None):
        raise ValueError("expert_cache and direct_io apply to experts='stream'")
    from openk3.quant.trunk import DEFAULT_PROMOTE, GROUPS, TRUNK_FORMATS

    if trunk not in TRUNK_FORMATS:
        raise ValueError(f"trunk must be one of {TRUNK_FORMATS}, got {trunk!r}")
    promote = DEFAULT_PROMOTE if trunk_promote is None else tuple(trunk_promote)
    if any(g not in GROUPS for g in promote):
        raise ValueError(f"trunk_promote: unknown group(s) {[g for g in promote if g not in GROUPS]}; groups: "
                         f"{', '.join(GROUPS)}")
    if trunk_group not in (32, 64, 128, 256):
        raise ValueError(f"trunk_group must be 32, 64, 128 or 256, got {trunk_group!r}")
    if trunk != "bf16" and torch.device(device).type != "cpu":
        raise ValueError(f"trunk={trunk!r} runs torch's CPU integer matmuls; device must be cpu, got {device}")
    inv, handles = inventory(path, keep_handles=True)
    folder, cfg, fmt, prefix, wm, src = inv.folder, inv.cfg, inv.experts_format, inv.prefix, inv.weight_map, inv.src
    cache = None
    try:
        loaded = LoadedFormat(fmt, copy.deepcopy(cfg.extra.get("quantization_config")) if fmt == "mxfp4" else None)
        if stream:  # before any tensor data is read: a bad index or cache size fails fast
            from openk3.stream import ExpertIndex, parse_bytes

            index = ExpertIndex.from_inventory(inv)
            if expert_cache is not None:
                parse_bytes(expert_cache, "expert_cache")
        packed_in_memory = fmt == "mxfp4" and keep_packed and not stream
        if fmt == "mxfp4" and not keep_packed and not stream:  # the model in memory is not quantised: no stale metadata
            cfg.extra.pop("quantization_config", None)
            cfg.extra.get("_wrapper", {}).pop("quantization_config", None)
        model, entries = inv.model, inv.entries
        trunk_dtype = dtype or TORCH_DTYPES[inv.headers[src[prefix + "model.embed_tokens.weight"]][0]]
        filler = _Filler(model, cfg, trunk_dtype, resolve_device(device), packed_in_memory, files.reads_owned_tensors(),
                         (trunk, promote, trunk_group))
        if stream:
            entries = [e for e in entries if e.kind not in ("packed", "scale")]
        last = {wm[src[prefix + e.name]]: i for i, e in enumerate(entries)}
        for i, e in enumerate(entries):
            name = src[prefix + e.name]
            file = wm[name]
            try:
                t = handles[file].get_tensor(name)
            except Exception as err:  # I/O or a corrupt data section
                raise ValueError(f"{folder / file}: cannot read tensor {name} ({err})") from None
            filler.put(e, t, name, folder / file)
            if last[file] == i:  # done with this shard: release it (and its mapping, without pread)
                handles.pop(file).__exit__(None, None, None)
        if stream:  # after the trunk: a default cache size sees the memory the trunk took
            from openk3.stream import attach

            cache = attach(model, index, expert_cache, io_threads=io_threads, direct=direct_io,
                           max_scale_byte=_max_safe_scale_byte(trunk_dtype))
    except BaseException:
        if cache is not None:
            cache.close()
        raise
    finally:
        files.close(handles)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:  # pragma: no cover - the layout covers every tensor of the model
        raise RuntimeError(f"openk3 bug: tensors left unloaded: {left[:10]}")
    model.loaded_format = loaded
    if trunk != "bf16":
        model.__dict__["trunk_format"] = trunk
    return model


_HF_DENSE = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.(gate|up|down)_proj\.weight")


def load_to_rewrite(src, experts_format: str | None = None):
    """(model, experts format to write) for rewriting checkpoint folder `src` (`openk3 convert`, `openk3 export`):
    the format defaults to SRC's own; packed -> packed keeps the MXFP4 codes as they are (re-packing would be exact
    too, but may pick other bytes). Tensors are read as stored; `save` casts them once to the dtype written."""
    packed = "quantization_config" in read_config(src).extra
    experts_format = experts_format or ("mxfp4" if packed else "bf16")
    return load(src, keep_packed=packed and experts_format == "mxfp4"), experts_format


def _transformers_aliases(cfg: K3Config, info: dict) -> dict[str, str]:
    """Canonical name -> file name for a bare checkpoint. transformers' `save_pretrained` of KimiLinear
    writes the dense MLP of the first layers as `block_sparse_moe.{gate,up,down}_proj` (its reverse
    rename of every `.mlp.`); those are read as `mlp.*` when that layer is dense."""
    out = {}
    for name in info:
        m = _HF_DENSE.fullmatch(name)
        if m and not cfg.is_moe_layer(int(m[1])):
            out[f"model.layers.{m[1]}.mlp.{m[2]}_proj.weight"] = name
        else:
            out[name] = name
    return out


def _check(folder: Path, cfg: K3Config, fmt: str, prefix: str, entries: list[Entry],
           info: dict[str, tuple[str, list[int]]]) -> None:
    """One ValueError listing every missing / unexpected tensor and every wrong shape or dtype."""
    expected = {prefix + e.name: e for e in entries}
    present = {n for n in info if not (prefix and n.startswith(VISION_PREFIXES))}  # other towers: set aside
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    shapes, dtypes = [], []
    for name in sorted(present & set(expected)):
        e = expected[name]
        dt, shape = info[name]
        ok_shapes = a_log_accepted_shapes(cfg) if e.param.endswith("A_log") else [e.shape]
        if tuple(shape) not in ok_shapes:
            shapes.append(f"{name}: expected {' or '.join(str(list(s)) for s in ok_shapes)}, got {shape}")
        if e.kind in ("packed", "scale"):
            if dt != "U8":
                dtypes.append(f"{name}: expected U8 (MXFP4 {'codes' if e.kind == 'packed' else 'scales'}), got {dt}")
        elif dt not in ST_FLOATS:
            dtypes.append(f"{name}: expected a float dtype ({'F32' if e.kind == 'island' else 'BF16'} as written "
                          f"by the release; any of {'/'.join(ST_FLOATS)} is read), got {dt}")
    if not (missing or unexpected or shapes or dtypes):
        return
    form = "kimi_k3 wrapper, `language_model.` prefix" if prefix else "bare kimi_linear, no prefix"
    lines = [f"{folder}: tensors do not match config.json ({form}; routed experts {fmt}):"]
    for title, names in (("missing tensors", missing), ("unexpected tensors", unexpected),
                         ("wrong shape", shapes), ("wrong dtype", dtypes)):
        if names:
            lines.append(f"  {title} ({len(names)}): {files.some_names(names)}")
    lines += _hints(prefix, fmt, missing, unexpected)
    raise ValueError("\n".join(lines))


def _hints(prefix: str, fmt: str, missing: list[str], unexpected: list[str]) -> list[str]:
    out = []
    if missing and unexpected:
        other = {n[len(PREFIX):] if n.startswith(PREFIX) else PREFIX + n for n in unexpected}
        if len(other & set(missing)) >= len(missing) // 2 + 1:
            out.append("  hint: the tensor names " + ("lack" if prefix else "carry") + " the `language_model.` "
                       "prefix; config.json must be " + ("a bare kimi_linear config" if prefix else
                                                         "a kimi_k3 wrapper config") + " for these files")
        if any(n.endswith((".weight_packed", ".weight_scale")) for n in (unexpected if fmt == "bf16" else missing)):
            out.append("  hint: " + ("the experts are MXFP4-packed but config.json has no quantization_config"
                                     if fmt == "bf16" else "config.json declares MXFP4 (quantization_config) but "
                                     "the experts are stored as plain weights"))
    return out


class _Filler:
    """Converts file tensors and assigns them into the meta model; stacks experts layer by layer."""

    def __init__(self, model: nn.Module, cfg: K3Config, trunk: torch.dtype, device: torch.device,
                 packed_in_memory: bool, owned: bool, quant: tuple = ("bf16", (), 32)) -> None:
        self.model, self.cfg, self.trunk, self.device = model, cfg, trunk, device
        self.quant = quant  # (trunk format, groups promoted to int8): linears quantised as their weight arrives
        self.copy = not owned  # tensors that view a file mapping must be copied out of it
        self.packed_in_memory = packed_in_memory
        self.stacks: dict[str, list] = {}  # param (or param_packed/_scale) -> [tensor, experts still to fill]
        self.half: dict[tuple[str, int], torch.Tensor] = {}  # an expert's packed codes awaiting its scales
        if packed_in_memory:
            from openk3.model.packed_experts import PackedExperts

            for mod in list(model.modules()):
                if type(mod).__name__ == "SparseMoE":
                    E, I, C = mod.experts.w1.shape
                    mod.experts = PackedExperts(E, C, I, device="meta")

    @torch.no_grad()
    def put(self, e: Entry, t: torch.Tensor, name: str, where: Path) -> None:
        """Convert the file tensor `name` (read from file `where`) and put it in place, refusing values
        that are NaN/inf in the file or overflow their in-memory dtype (checked here, tensor by tensor,
        while each is in hand, so a load needs no second pass over the model)."""
        mod_name, leaf = e.param.rsplit(".", 1)
        if e.expert is None:
            if leaf == "A_log":
                t = self._a_log(t, name)
            target = island_dtype(self.trunk) if e.kind == "island" else self.trunk
            out = t.to(device=self.device, dtype=target, copy=self.copy)
            _require_finite(out, t, name, where)
            self._assign(mod_name, leaf, out)
        elif e.kind == "float":
            row = self._stack(mod_name, leaf, self.trunk)[e.expert]
            row.copy_(t)
            _require_finite(row, t, name, where)
            self._done(mod_name, leaf)
        elif e.kind == "packed":  # held until its scales arrive (the next tensor of the layout)
            self.half[(e.param, e.expert)] = t.clone() if self.copy else t
        else:
            packed = self.half.pop((e.param, e.expert))
            if bool((t == SCALE_NAN).any()):  # as `unpack` would refuse it, for packed models too
                raise ValueError(f"{where}: tensor {name}: MXFP4 scale byte 255 (E8M0 NaN) found; refusing to "
                                 f"load NaN weights")
            # E2M1 codes are all finite and every other scale byte is a finite power of two, so the only
            # other failure is a weight too large for the dtype it is dequantised to
            if self.packed_in_memory:
                if int(t.max()) > _max_safe_scale_byte(self.trunk):  # rare: then decode to see
                    _require_finite(unpack(packed, t, torch.float64).to(self.trunk), None, name, where)
                for kind, v in (("packed", packed), ("scale", t)):
                    self._stack(mod_name, f"{leaf}_{kind}", torch.uint8)[e.expert].copy_(v)
                    self._done(mod_name, f"{leaf}_{kind}")
                return
            w = unpack(packed, t, self.trunk)
            _require_finite(w, None, name, where)
            self._stack(mod_name, leaf, self.trunk)[e.expert].copy_(w)
            self._done(mod_name, leaf)

    def _a_log(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """Any accepted on-disk form -> the in-memory [ceil(H/128)*128] with exact-zero pads."""
        H = self.cfg.linear_attn_config.num_heads
        flat = t.reshape(-1)
        if flat.numel() > H and bool((flat[H:] != 0).any()):
            raise ValueError(f"{name}: entries {H}..{flat.numel() - 1} must be exactly 0: A_log holds one value per "
                             f"head ({H} heads), zero-padded; a non-zero tail means a different (per-channel) layout")
        out = torch.zeros(self.cfg.a_log_size, dtype=flat.dtype)
        out[:H] = flat[:H]
        return out

    def _stack(self, mod_name: str, leaf: str, dtype: torch.dtype) -> torch.Tensor:
        key = f"{mod_name}.{leaf}"
        if key not in self.stacks:
            meta = getattr(self.model.get_submodule(mod_name), leaf)
            self.stacks[key] = [torch.empty(meta.shape, dtype=dtype, device=self.device), meta.shape[0]]
        return self.stacks[key][0]

    def _done(self, mod_name: str, leaf: str) -> None:
        key = f"{mod_name}.{leaf}"
        self.stacks[key][1] -= 1
        if self.stacks[key][1] == 0:
            self._assign(mod_name, leaf, self.stacks.pop(key)[0])

    def _assign(self, mod_name: str, leaf: str, t: torch.Tensor) -> None:
        mod = self.model.get_submodule(mod_name)
        if leaf in mod._parameters:
            mod._parameters[leaf] = nn.Parameter(t, requires_grad=mod._parameters[leaf].requires_grad)
        else:
            mod._buffers[leaf] = t
        if self.quant[0] != "bf16" and leaf == "weight" and type(mod) is nn.Linear:
            from openk3.quant.trunk import replace_linear_

            replace_linear_(self.model, mod_name, *self.quant)


_FINITE_CHUNK = 1 << 24  # elements checked at a time: bounds the temporary mask to 16 MB


def _all_finite(t: torch.Tensor) -> bool:
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + _FINITE_CHUNK]).all()) for i in range(0, flat.numel(), _FINITE_CHUNK))


def nonfinite_tensors(inv: Inventory, handles: dict) -> list[str]:
    """"name (file)" of each file tensor of an inventoried checkpoint (`inventory(..., keep_handles=True)`) that
    holds NaN or inf, or for MXFP4 scales the E8M0 NaN byte: every tensor is read, one at a time."""
    bad = []
    for name, (dtype, _) in sorted(inv.headers.items(), key=lambda item: (inv.weight_map[item[0]], item[0])):
        scales = dtype == "U8" and name.endswith("_scale")
        if dtype not in ST_FLOATS and not scales:
            continue  # MXFP4 codes: every E2M1 code is finite
        file = inv.weight_map[name]
        try:
            t = handles[file].get_tensor(name)
        except Exception as err:  # I/O or a corrupt data section
            raise ValueError(f"{inv.folder / file}: cannot read tensor {name} ({err})") from None
        if bool((t == SCALE_NAN).any()) if scales else not _all_finite(t):
            bad.append(f"{name} ({file})")
    return bad


def _require_finite(out: torch.Tensor, src: torch.Tensor | None, name: str, where: Path) -> None:
    """ValueError naming the tensor and file if `out` (the in-memory form of file tensor `src`; None
    for MXFP4, whose file bytes cannot hold NaN/inf beyond the scale byte checked before) is not finite."""
    if _all_finite(out):
        return
    if src is not None and not _all_finite(src):
        raise ValueError(f"{where}: tensor {name} holds NaN or inf values; refusing to load non-finite weights")
    raise ValueError(f"{where}: tensor {name} has values too large for {out.dtype} (they become inf); "
                     f"load with a wider dtype (e.g. dtype=torch.float32)")


def _max_safe_scale_byte(dtype: torch.dtype) -> int:
    """The largest E8M0 byte whose every MXFP4 value (|code| <= 6) is finite in `dtype`."""
    return min(SCALE_NAN - 1, SCALE_BIAS + math.floor(math.log2(torch.finfo(dtype).max / E2M1_MAX)))
