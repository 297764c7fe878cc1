"""`save(model, path)`: a HF-style checkpoint folder, written atomically (see `openk3.checkpoint`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from openk3.checkpoint import files
from openk3.checkpoint.layout import EXPERTS_FORMATS, PREFIX, Entry, config_files, layout
from openk3.checkpoint.runs import STATE_FILE  # a training checkpoint's optimizer state: `carried_files` skips it
from openk3.common import resolve_dtype
from openk3.fsutil import naming
from openk3.peers import check_kimi_linear_form

SAVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def kimi_linear_form(cfg) -> bool:
    """Whether transformers' native KimiLinear computes this config's model (no K3-only feature)."""
    try:
        check_kimi_linear_form(cfg)
    except ValueError:
        return False
    return True


def writes_itself(name: str) -> bool:
    """Whether a file of this name in a checkpoint folder is one `save` writes (so no extra file may take it)."""
    return name in ("config.json", "generation_config.json", files.INDEX) or name.endswith(".safetensors")


def save(model, path, *, wrapper: bool | None = None, experts_format: str | None = None,
         dtype: torch.dtype | str = torch.bfloat16, max_shard_bytes: int = 5 * 2**30,
         extra_files: dict[str, str | os.PathLike] | None = None) -> None:
    """Write `model` (a `K3ForCausalLM`, experts plain or `PackedExperts`) as a checkpoint folder.

    Args:
        path: the folder; replaced atomically if it exists (files in it that a save does not write,
            e.g. tokenizer files, are carried over).
        wrapper: True = top-level `kimi_k3` config.json and `language_model.`-prefixed tensors (the
            release); False = bare `kimi_linear` config (Kimi-Linear-48B style). None = wrapper iff
            the config uses any K3-only feature (a bare file of it would open in transformers' native
            KimiLinear with K3's tensors unexpected and its own initialised at random) or was read from a
            wrapper.
        experts_format: "bf16" (routed experts as `dtype` floats) or "mxfp4" (compressed-tensors
            `weight_packed`/`weight_scale`, spec §6; experts held packed are written bit for bit,
            float experts are quantised with `openk3.quant.mxfp4.pack`, which gives back the exact
            values of experts unpacked from MXFP4). None = the format the model was loaded in
            (`model.loaded_format`, set by `openk3.load`; MXFP4 with the source's
            `quantization_config` verbatim), "bf16" for a model built in memory.
        dtype: on-disk dtype of every tensor except the fp32 islands and MXFP4 bytes (float32 gives a
            lossless copy of an fp32 model); a torch dtype or a name ("bf16", "float32", ...); None or
            "auto" = the model's own trunk dtype.
        max_shard_bytes: above this many tensor bytes, write `model-0000i-of-0000N.safetensors`
            shards plus `model.safetensors.index.json`.
        extra_files: {file name: source path} copied into the folder inside the same atomic write
            (tokenizer files, for instance); names are plain file names.

    Raises:
        ValueError: on a bad argument, a model whose tensors disagree with its config, or a `path`
            that is an existing file.
    """
    if "expert_stream" in getattr(model, "__dict__", {}) or any(
            type(m).__name__ in ("Int8Linear", "Int4Linear") for m in model.modules()):
        raise ValueError("this model streams its experts from disk (experts='stream') or holds an integer trunk "
                         "(trunk='int8'/'int4'): its weights are not all here as floats; save the checkpoint it "
                         "was loaded from, or load it with experts='memory' and trunk='bf16' first")
    loaded = getattr(model, "loaded_format", None)
    if experts_format is None:
        experts_format = loaded.experts_format if loaded is not None else "bf16"
    if experts_format not in EXPERTS_FORMATS:
        raise ValueError(f"experts_format must be one of {EXPERTS_FORMATS}, got {experts_format!r}")
    dtype = resolve_dtype(dtype) or _trunk_dtype(model)  # "auto" / None: as the model holds it
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {SAVE_DTYPES}, got {dtype!r}")
    for name in extra_files or {}:
        if not name or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"extra_files: {name!r} is not a plain file name")
        if writes_itself(name):
            raise ValueError(f"extra_files: {name!r} is a file save writes itself (configs, index, shards)")
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError(f"save expects an openk3 K3ForCausalLM (with .config), got {type(model).__name__}")
    if wrapper is None:
        wrapper = "_wrapper" in cfg.extra or not kimi_linear_form(cfg)  # (AttnRes is one of the K3-only features)
    prefix = PREFIX if wrapper else ""
    sources = _Sources(model, dtype)
    items = [(prefix + e.name, e.shape, e.disk_dtype(dtype), sources.producer(e)) for e in layout(cfg, experts_format)]
    source_quant = loaded.quantization_config if loaded is not None else None
    config, generation = config_files(cfg, wrapper=bool(wrapper), experts_format=experts_format, dtype=dtype,
                                      quantization_config=source_quant)

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: exists and is not a folder; a checkpoint is a folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    files.clean_leftovers(path)
    tmp = files.temp_sibling(path, "tmp")
    tmp.mkdir()
    existed = path.exists()
    try:
        files.write_json(tmp / "config.json", config)
        files.write_json(tmp / "generation_config.json", generation)
        files.write_weights(tmp, items, max_shard_bytes)
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
        files.swap_in(tmp, path)
    except OSError as e:  # a full disk says only "No space left on device": name the folder, say what is kept
        shutil.rmtree(tmp, ignore_errors=True)
        kept = "the folder is as it was" if existed else "nothing was created there"
        raise naming(e, path, f"writing a checkpoint; its partial copy was removed and {kept}", temp=tmp) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _Sources:
    """Produces each file tensor from the model on demand (one at a time: no second model copy)."""

    def __init__(self, model, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.packs: dict[tuple[str, int], list] = {}  # (param, expert) -> [packed, scale, uses left]

    def producer(self, e: Entry) -> Callable[[], torch.Tensor]:
        mod_name, leaf = e.param.rsplit(".", 1)
        target = e.disk_dtype(self.dtype)
        if e.expert is None:
            return lambda: self._plain(mod_name, leaf, e, target)
        return lambda: self._expert(mod_name, leaf, e, target)

    @torch.no_grad()
    def _plain(self, mod_name: str, leaf: str, e: Entry, target: torch.dtype) -> torch.Tensor:
        t = getattr(self.model.get_submodule(mod_name), leaf).detach()
        if leaf != "A_log":
            return t.to(target)
        H = self.model.config.linear_attn_config.num_heads
        if e.shape == tuple(t.shape):  # K3 form: padded, pads written as exact zeros (spec §2)
            out = t.to(target, copy=True)
            out[H:] = 0
            return out
        return t[:H].to(target).reshape(e.shape)

    @torch.no_grad()
    def _expert(self, mod_name: str, leaf: str, e: Entry, target: torch.dtype) -> torch.Tensor:
        mod = self.model.get_submodule(mod_name)
        held_packed = hasattr(mod, f"{leaf}_packed")
        if e.kind == "float":
            if held_packed:
                from openk3.quant.mxfp4 import unpack

                return unpack(getattr(mod, f"{leaf}_packed")[e.expert], getattr(mod, f"{leaf}_scale")[e.expert],
                              target)
            return getattr(mod, leaf)[e.expert].detach().to(target)
        if held_packed:
            return getattr(mod, f"{leaf}_{e.kind}")[e.expert]
        key = (e.param, e.expert)
        if key not in self.packs:
            from openk3.quant.mxfp4 import pack

            self.packs[key] = [*pack(getattr(mod, leaf)[e.expert].detach()), 2]
        slot = self.packs[key]
        slot[2] -= 1
        if slot[2] == 0:
            del self.packs[key]
        return slot[0] if e.kind == "packed" else slot[1]


def _trunk_dtype(model) -> torch.dtype:
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return embed.weight.dtype if embed is not None else torch.bfloat16


def carried_files(src: str) -> dict[str, str]:
    """The files of SRC that a conversion carries over unchanged: tokenizer files, chat templates, remote
    code, READMEs, ... (every plain file except the weights and what `save` rewrites)."""
    return {p.name: str(p) for p in sorted(Path(src).iterdir())
            if p.is_file() and not writes_itself(p.name) and p.name != STATE_FILE}
