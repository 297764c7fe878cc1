"""What a checkpoint folder holds: every tensor's file name, shape and on-disk dtype (spec §2), and
the config files (spec §1). Shared by `save` and `load`, so the two cannot drift apart.

The layout is derived from the model built on the meta device: every parameter and buffer keeps its
name on disk (after the optional `language_model.` prefix) except
* routed experts, stacked in memory (`experts.w1`/`w3` [E, I, C], `w2` [E, C, I]) and stored per
  expert (`experts.{e}.w1.weight` [I, C], or `.weight_packed` [I, C/2] + `.weight_scale` [I, C/32] U8);
* KDA `A_log`, [ceil(H/128)*128] zero-padded in memory, stored padded in the K3 form and as
  [1, 1, H, 1] in the Kimi-Linear form.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from openk3.config import K3Config
from openk3.config_rules import k3_special_id
from openk3.model.model import FP32_NAMES, K3ForCausalLM

PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # other towers of the release; skipped on load
EXPERTS_FORMATS = ("bf16", "mxfp4")
MXFP4_GROUP = 32
_CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")

# safetensors dtype names of the dtypes openk3 reads and writes.
ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
             torch.uint8: "U8"}
ST_FLOATS = ("BF16", "F16", "F32", "F64")
TORCH_DTYPES = {v: k for k, v in ST_DTYPES.items()}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float64: "float64"}

# compressed-tensors ignore list of the release (spec §1.5), written verbatim.
MXFP4_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]


def mxfp4_quantization_config() -> dict[str, Any]:
    """The `quantization_config` of an MXFP4 checkpoint, exactly as the release's (spec §1.5)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "mxfp4-pack-quantized",
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": MXFP4_GROUP,
                            "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": None,
                            "observer": "minmax"},
                "input_activations": None,
                "output_activations": None,
            },
        },
        "ignore": list(MXFP4_IGNORE),
    }


@dataclass(frozen=True, slots=True)
class LoadedFormat:
    """How the checkpoint a model was read from stored it; `load` sets it as `model.loaded_format` and
    `save` writes the same form unless told otherwise (a model built in memory has none: bf16 experts).

    `quantization_config` is the source's own (compressed-tensors) object when its experts were MXFP4,
    written back verbatim: other tools add to the release's incomplete ignore list (spec §1.5).
    """

    experts_format: str
    quantization_config: dict[str, Any] | None = None


def experts_format_of(cfg: K3Config, source: str) -> str:
    """"mxfp4" when the config declares the release's quantization, "bf16" when it declares none."""
    q = cfg.extra.get("quantization_config")
    if q is None:
        return "bf16"
    fmt = q.get("format") if isinstance(q, dict) else None
    if fmt != "mxfp4-pack-quantized":
        raise ValueError(f"{source}: field 'quantization_config.format' must be 'mxfp4-pack-quantized' (the only "
                         f"quantized format openk3 reads), got {fmt!r}")
    return "mxfp4"


def is_island(name: str) -> bool:
    """Stored (and kept in memory) in fp32 whatever the model dtype (spec §2, §10.13)."""
    return any(name.endswith(s) for s in FP32_NAMES)


def island_dtype(dtype: torch.dtype) -> torch.dtype:
    """`K3ForCausalLM.cast` semantics: islands stay fp32 unless everything is float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def k3_form(cfg: K3Config) -> bool:
    """K3's bounded decay gate: `A_log` is stored zero-padded to a multiple of 128 (as the release)."""
    return cfg.linear_attn_config.gate_lower_bound is not None


def a_log_disk_shape(cfg: K3Config) -> tuple[int, ...]:
    H = cfg.linear_attn_config.num_heads
    return (cfg.a_log_size,) if k3_form(cfg) else (1, 1, H, 1)


def a_log_accepted_shapes(cfg: K3Config) -> list[tuple[int, ...]]:
    H = cfg.linear_attn_config.num_heads
    return sorted({(H,), (1, 1, H, 1), (cfg.a_log_size,)}, key=lambda s: (len(s), s))


@dataclass(slots=True)
class Entry:
    """One tensor in the file. `param` is the in-memory (stacked-experts) name it comes from;
    `expert` the expert index for routed experts; `kind` one of float / island / packed / scale."""

    name: str
    shape: tuple[int, ...]
    kind: str
    param: str
    expert: int | None = None

    def disk_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.kind in ("packed", "scale"):
            return torch.uint8
        return island_dtype(dtype) if self.kind == "island" else dtype


def is_stacked_expert(param: str) -> bool:
    return param.rsplit(".", 2)[-2:-1] == ["experts"] and param.rsplit(".", 1)[-1] in ("w1", "w2", "w3")


def meta_model(cfg: K3Config) -> K3ForCausalLM:
    return K3ForCausalLM.build(cfg, device="meta")


def layout(cfg: K3Config, experts_format: str, model: K3ForCausalLM | None = None) -> list[Entry]:
    """Every tensor of the file, in writing order (un-prefixed names), for `cfg` and an experts format.

    Each expert's tensors are back to back in the order w1, w2, w3, as in the release (spec §2).
    """
    if experts_format not in EXPERTS_FORMATS:
        raise ValueError(f"experts_format must be one of {EXPERTS_FORMATS}, got {experts_format!r}")
    model = model if model is not None else meta_model(cfg)
    sd = model.state_dict(keep_vars=True)
    out: list[Entry] = []
    for param, t in sd.items():
        if not is_stacked_expert(param):
            if param.endswith("A_log"):
                out.append(Entry(param, a_log_disk_shape(cfg), "island", param))
            else:
                out.append(Entry(param, tuple(t.shape), "island" if is_island(param) else "float", param))
            continue
        if not param.endswith(".w1"):
            continue  # w2 and w3 are emitted with w1, expert by expert
        base = param[:-2]  # "...experts."
        for p in (f"{base}w1", f"{base}w2", f"{base}w3"):
            if experts_format == "mxfp4" and sd[p].shape[2] % MXFP4_GROUP:
                raise ValueError(f"experts_format 'mxfp4' needs the input width of every expert matrix to be a "
                                 f"multiple of {MXFP4_GROUP}; {p} is {list(sd[p].shape)}")
        for e in range(sd[param].shape[0]):
            for w in ("w1", "w2", "w3"):
                _, rows, cols = sd[f"{base}{w}"].shape
                if experts_format == "bf16":
                    out.append(Entry(f"{base}{e}.{w}.weight", (rows, cols), "float", f"{base}{w}", e))
                else:
                    out.append(Entry(f"{base}{e}.{w}.weight_packed", (rows, cols // 2), "packed", f"{base}{w}", e))
                    out.append(Entry(f"{base}{e}.{w}.weight_scale", (rows, cols // MXFP4_GROUP), "scale",
                                     f"{base}{w}", e))
    return out


# ---- config files ------------------------------------------------------------------------------

def _token(cfg: K3Config, key: str) -> Any:
    """bos/pad id: from the config's metadata or wrapper, else where K3's layout puts it for this vocabulary
    (the top 256 ids are the reserved block, as for eos: 163584 / 163839 at the release's 163840; None for
    vocabularies too small to hold the block)."""
    if key in cfg.extra:
        return cfg.extra[key]
    w = cfg.extra.get("_wrapper", {})
    if key in w:
        return w[key]
    return k3_special_id(cfg.vocab_size, key)


def config_files(cfg: K3Config, *, wrapper: bool, experts_format: str, dtype: torch.dtype,
                 quantization_config: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) contents for a save. `quantization_config`: the one to
    write with MXFP4 experts (default the release's, `mxfp4_quantization_config()`)."""
    text = cfg.to_dict()
    text.pop("auto_map", None)
    text.pop("quantization_config", None)  # never a stale one: it follows the experts format written
    if experts_format == "mxfp4":
        text["quantization_config"] = copy.deepcopy(quantization_config or mxfp4_quantization_config())
    text["dtype"] = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    if "torch_dtype" in text:
        text["torch_dtype"] = text["dtype"]
    bos = _token(cfg, "bos_token_id")
    pad = _token(cfg, "pad_token_id")
    if wrapper:
        kept = copy.deepcopy(cfg.extra.get("_wrapper", {}))
        # (auto_map: another code's classes (Moonshot's remote code) that would not load these files; an export
        # that ships its own shims writes its own, openk3.hf.export)
        for k in ("architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
                  "tie_word_embeddings", "text_config", "quantization_config", "auto_map"):
            kept.pop(k, None)
        for k in ("dtype", "torch_dtype"):
            if k in kept:
                kept[k] = text["dtype"]
        config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                  "bos_token_id": bos, "eos_token_id": cfg.eos_token_id, "pad_token_id": pad, **kept,
                  "tie_word_embeddings": False, "text_config": text}
    else:
        config = text
        config["bos_token_id"], config["pad_token_id"] = bos, pad
    gen: dict[str, Any] = {}
    if bos is not None:
        gen["bos_token_id"] = bos
    gen["eos_token_id"] = cfg.eos_token_id
    if pad is not None:
        gen["pad_token_id"] = pad
    return config, gen


def checkpoint_file(name: str) -> bool:
    """Files a save writes (and may replace): configs, weights, the index."""
    return name in _CHECKPOINT_FILES or (name.startswith("model-") and name.endswith(".safetensors"))
