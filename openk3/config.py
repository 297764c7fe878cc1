"""Model configuration: the release's `text_config` field names, exactly, plus named presets.

`K3Config` mirrors the `text_config` object of the released Kimi K3 `config.json` (model_type
`kimi_linear`) field for field, and `LinearAttnConfig` its nested `linear_attn_config`. The same
dataclass also describes the predecessor Kimi-Linear-48B: every K3 feature is switched on by a field
whose absence means "off" in the Kimi-Linear remote code (no `attn_res_block_size` = plain residual
stream, no `routed_expert_hidden_size` = experts at full width, no `gate_lower_bound` = softplus
decay gate, `use_full_rank_gate` false = low-rank output gate, `mla_use_output_gate` false, and
`hidden_act` "silu" = SwiGLU).

Because those defaults mean Kimi-Linear, a K3 config file must spell out every field in
`config_rules.K3_REQUIRED_FIELDS` (a missing `hidden_act` would run SwiGLU); unknown keys are kept
with a warning; special ids must lie in the vocabulary, `eos_token_id` defaulting to K3's
`<|end_of_msg|>` for it (`config_rules`, docs/architecture.md *Reading a config file*).

Layer lists are 1-indexed as in the file (spec §1.6): 0-based layer `l` is MLA iff `l + 1` is in
`full_attn_layers`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from openk3.config_rules import (
    SPECIAL_ID_OFFSETS,
    check_token_ids,
    k3_markers,
    k3_special_id,
    missing_k3_fields,
    moved_id,
    typo_hint,
    warn_unknown,
)
from openk3.config_types import type_problem
from openk3.fsutil import read_json, write_atomic

# Keys that appear in released config.json files but do not change the text model's math. They are
# accepted, kept in `K3Config.extra` and written back on save, never silently dropped.
_METADATA_KEYS = frozenset({
    "_name_or_path", "_commit_hash", "auto_map", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "pad_token_id", "initializer_range", "use_cache", "model_max_length", "head_dim",
    "rope_scaling", "attention_dropout", "attention_bias", "pretraining_tp",
    "output_router_logits", "ignore_index", "quantization_config",
})
# Top-level keys of a `kimi_k3` wrapper that belong to other towers or to the wrapper itself.
_WRAPPER_KEYS = frozenset({
    "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
    "media_placeholder_token_id", "image_placeholder", "tie_word_embeddings", "ignore_index",
    "text_config", "vision_config", "auto_map", "transformers_version", "torch_dtype", "dtype",
    "_name_or_path", "_commit_hash", "use_cache", "initializer_range", "quantization_config",
})

HIDDEN_ACTS = ("situ", "silu")


class _FromVocab:
    """Default of `eos_token_id`: K3's `<|end_of_msg|>` id for the config's vocabulary, set in __post_init__."""

    def __repr__(self) -> str:
        return "<vocab_size - 254>"


_FROM_VOCAB = _FromVocab()


@dataclass
class LinearAttnConfig:
    """`text_config.linear_attn_config`: the KDA layers and the hybrid layout (1-indexed lists)."""

    num_heads: int
    head_dim: int
    full_attn_layers: list[int]
    kda_layers: list[int] | None = None
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = None
    use_full_rank_gate: bool = False


@dataclass
class K3Config:
    """The text model. Field names are the release's `text_config` names (spec §1.3)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    linear_attn_config: LinearAttnConfig
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = None
    mla_use_nope: bool = True
    # RoPE base of the MLA "rope" dims, read only when mla_use_nope is false (the K2-style baseline; no K3
    # preset). transformers' and DeepSeek's name and default.
    rope_theta: float = 10000.0
    mla_use_output_gate: bool = False
    max_position_embeddings: int = 1048576
    hidden_act: str = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_shared_experts: int = 1
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    rms_norm_eps: float = 1e-5
    attn_res_block_size: int | None = None
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    # Default: K3's <|end_of_msg|> for this vocabulary (163586 at 163840), None below 256 ids.
    eos_token_id: int | list[int] | None = _FROM_VOCAB  # type: ignore[assignment]
    architectures: list[str] = field(default_factory=lambda: ["KimiLinearForCausalLM"])
    model_type: str = "kimi_linear"
    # openk3 options that are not release fields (kept out of config.json unless changed).
    # The HF reference builds the MLA latent norms without an eps argument (1e-6); vLLM, llama.cpp
    # and colibri use rms_norm_eps (1e-5). Spec §11 marks this a conflict, so it is a choice.
    mla_latent_norm_eps: float = 1e-6
    # Keys from the file that are not fields: metadata (see _METADATA_KEYS), unknown keys (kept with a
    # warning), the wrapper's other towers ("_wrapper") and unknown linear_attn_config keys
    # ("_linear_attn_config"); `to_dict` writes them back. Also "rope_theta" when the file has it at a value
    # `to_dict` would leave out (NoPE, the default: Kimi-Linear's file), so a save keeps the key; the field
    # holds the value.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.linear_attn_config, dict):
            self.linear_attn_config = _build(LinearAttnConfig, self.linear_attn_config, "linear_attn_config")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.eos_token_id is _FROM_VOCAB:
            self.eos_token_id = k3_special_id(self.vocab_size, "eos_token_id") \
                if isinstance(self.vocab_size, int) else None  # (a bad vocab_size is named by validate)
        self.validate()

    # ---- derived layout -------------------------------------------------------------------
    @property
    def mla_layers(self) -> list[int]:
        """0-based indices of the gated-MLA layers."""
        return [i - 1 for i in sorted(self.linear_attn_config.full_attn_layers)]

    def is_mla_layer(self, layer: int) -> bool:
        return (layer + 1) in self.linear_attn_config.full_attn_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def is_snapshot_layer(self, layer: int) -> bool:
        """AttnRes: the incoming prefix becomes a block representation at this layer (spec §4.3)."""
        return self.attn_res_block_size is not None and layer % self.attn_res_block_size == 0

    @property
    def use_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def use_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_in_dim(self) -> int:
        """Width the routed experts read and write: the latent width, or hidden for plain MoE."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def a_log_size(self) -> int:
        """Stored length of KDA `A_log`: per-head values zero-padded to a multiple of 128 (spec §2)."""
        return math.ceil(self.linear_attn_config.num_heads / 128) * 128

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # ---- validation -----------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the field for any inconsistent value."""
        la = self.linear_attn_config
        for obj, prefix in ((self, ""), (la, "linear_attn_config.")):
            for f in dataclasses.fields(obj):
                if f.name not in ("extra", "linear_attn_config"):
                    problem = type_problem(type(obj), f.name, getattr(obj, f.name))
                    if problem:
                        raise ValueError(f"config field '{prefix}{f.name}' must be {problem}, "
                                         f"got {getattr(obj, f.name)!r}")
        L = self.num_hidden_layers
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "v_head_dim", "intermediate_size", "num_experts",
                     "num_experts_per_token", "moe_intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"config field {name!r} must be a positive integer, got {v!r}")
        for name in ("num_heads", "head_dim", "short_conv_kernel_size"):
            v = getattr(la, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"config field 'linear_attn_config.{name}' must be a positive integer, got {v!r}")
        for name in ("max_position_embeddings", "num_key_value_heads", "q_lora_rank"):  # (q_lora_rank may be null)
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"config field {name!r} must be a positive integer, got {v!r}")
        if self.num_shared_experts < 0:
            raise ValueError(f"config field 'num_shared_experts' must be >= 0, got {self.num_shared_experts!r}")
        # eps 0 divides by zero on an all-zero row; a SiTU beta <= 0 divides by zero or flips the cap.
        for name in ("rms_norm_eps", "mla_latent_norm_eps", "activation_situ_beta", "activation_situ_linear_beta",
                     "routed_scaling_factor", "rope_theta"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"config field {name!r} must be a finite number > 0, got {v!r}")
        self._check_token_ids()  # (vocab_size is known to be a positive integer here)
        if not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim < 0:
            raise ValueError(f"config field 'qk_rope_head_dim' must be an integer >= 0, got {self.qk_rope_head_dim!r}")
        full = list(la.full_attn_layers)
        bad = [i for i in full if not isinstance(i, int) or not 1 <= i <= L]
        if bad:
            raise ValueError(f"config field 'linear_attn_config.full_attn_layers' must hold 1-indexed layers in "
                             f"1..{L} (num_hidden_layers), got {bad}")
        if len(set(full)) != len(full):
            raise ValueError(f"config field 'linear_attn_config.full_attn_layers' has duplicates: {full}")
        rest = [i for i in range(1, L + 1) if i not in set(full)]
        if la.kda_layers is None:
            la.kda_layers = rest
        elif sorted(la.kda_layers) != rest:
            raise ValueError(f"config field 'linear_attn_config.kda_layers' must be exactly the layers 1..{L} not in "
                             f"full_attn_layers ({rest}), got {sorted(la.kda_layers)}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"config field 'hidden_act' must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.moe_router_activation_func != "sigmoid":
            raise ValueError(f"config field 'moe_router_activation_func' must be 'sigmoid', "
                             f"got {self.moe_router_activation_func!r}")
        if self.topk_method != "noaux_tc":
            raise ValueError(f"config field 'topk_method' must be 'noaux_tc', got {self.topk_method!r}")
        if self.num_expert_group != 1 or self.topk_group != 1:
            raise ValueError("grouped top-k routing is not supported: config fields 'num_expert_group' and "
                             f"'topk_group' must be 1, got {self.num_expert_group} and {self.topk_group}")
        if not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ValueError(f"config field 'num_experts_per_token' must be in 1..num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_token}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"config field 'num_key_value_heads' must equal num_attention_heads "
                             f"({self.num_attention_heads}) for MLA, got {self.num_key_value_heads}")
        if not self.mla_use_nope and (self.qk_rope_head_dim == 0 or self.qk_rope_head_dim % 2):
            # RoPE turns the rope dims in pairs (openk3.ops.rope); K3 and Kimi-Linear (NoPE) never rotate them
            raise ValueError(f"config field 'qk_rope_head_dim' must be even and > 0 when mla_use_nope is false "
                             f"(RoPE rotates pairs of dims), got {self.qk_rope_head_dim}")
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            raise ValueError(f"config field 'attn_res_block_size' must be positive, got {self.attn_res_block_size}")
        if self.routed_expert_hidden_size is not None and self.routed_expert_hidden_size <= 0:
            raise ValueError(f"config field 'routed_expert_hidden_size' must be positive, "
                             f"got {self.routed_expert_hidden_size}")
        if self.latent_moe_use_norm and self.routed_expert_hidden_size is None:
            raise ValueError("config field 'latent_moe_use_norm' needs 'routed_expert_hidden_size'")
        if self.num_nextn_predict_layers != 0:
            raise ValueError(f"config field 'num_nextn_predict_layers' must be 0 (no MTP head), "
                             f"got {self.num_nextn_predict_layers}")
        if self.tie_word_embeddings:
            raise ValueError("config field 'tie_word_embeddings' must be false (K3 and Kimi-Linear are untied)")
        if la.gate_lower_bound is not None and not (math.isfinite(la.gate_lower_bound) and la.gate_lower_bound < 0):
            raise ValueError(f"config field 'linear_attn_config.gate_lower_bound' must be a finite negative number, "
                             f"got {la.gate_lower_bound}")
        if self.first_k_dense_replace < 0 or self.moe_layer_freq <= 0:
            raise ValueError("config fields 'first_k_dense_replace' >= 0 and 'moe_layer_freq' > 0 required, got "
                             f"{self.first_k_dense_replace} and {self.moe_layer_freq}")

    def _check_token_ids(self) -> None:
        """Every declared special id (the eos field; bos/pad metadata; a wrapper's) lies in the vocabulary."""
        check_token_ids({"eos_token_id": self.eos_token_id,
                         **{k: self.extra[k] for k in ("bos_token_id", "pad_token_id") if k in self.extra}},
                        self.vocab_size)
        wrapper = self.extra.get("_wrapper", {})
        check_token_ids({k: wrapper[k] for k in SPECIAL_ID_OFFSETS if k in wrapper}, self.vocab_size, " (top level)")

    # ---- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The `text_config` / bare `kimi_linear` dict (metadata from `extra` merged back)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            if f.name in _OPENK3_ONLY and v == f.default:
                continue
            # rope_theta means nothing to a NoPE model: written when it matters, when changed, or when the
            # file had it (extra["rope_theta"] marks that; the field's value is what is written)
            if f.name == "rope_theta" and _rope_theta_unused(self.mla_use_nope, v) and f.name not in self.extra:
                continue
            out[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        for k, v in self.extra.items():
            if k not in ("_wrapper", "_linear_attn_config"):  # the wrapper's other towers are not text_config fields
                out.setdefault(k, v)
        for k, v in self.extra.get("_linear_attn_config", {}).items():
            out["linear_attn_config"].setdefault(k, v)
        return out

    def to_json(self, path: str | os.PathLike) -> None:
        """Write a bare `kimi_linear` config.json atomically (temp file + rename)."""
        write_atomic(path, (json.dumps(self.to_dict(), indent=2) + "\n").encode())

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "K3Config":
        """Build from a bare `kimi_linear` dict or a `kimi_k3` wrapper (`text_config` nested).

        A K3 config (the wrapper, or a bare dict declaring a K3 feature) missing one of
        `K3_REQUIRED_FIELDS` raises ValueError naming it; a Kimi-Linear one keeps the defaults.
        Known metadata is kept in `extra`; unknown keys too, with a warning naming them (at any
        level: `extra`, `extra["_linear_attn_config"]`, the wrapper); the other towers of a wrapper
        (`vision_config`, ...) are set aside in `extra["_wrapper"]`. Special ids outside the
        vocabulary raise ValueError, at the wrapper's top level too.
        """
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if d.get("model_type") == "kimi_k3" or "text_config" in d:
            unknown = sorted(set(d) - _WRAPPER_KEYS)
            if unknown:  # kept in the wrapper, which a save writes back
                warn_unknown(source, unknown, _WRAPPER_KEYS, "top-level ")
            if "text_config" not in d:
                raise ValueError(f"{source}: kimi_k3 config has no 'text_config'")
            wrapper = {k: v for k, v in d.items() if k != "text_config"}
            cfg = cls._from_text(d["text_config"], f"{source}: text_config", k3_form=True)
            cfg.extra["_wrapper"] = wrapper
            try:
                cfg._check_token_ids()  # now with the wrapper's ids
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None
            return cfg
        return cls._from_text(d, source, k3_form=False)

    @classmethod
    def _from_text(cls, d: Any, source: str, *, k3_form: bool) -> "K3Config":
        """A `text_config` / bare `kimi_linear` dict; `k3_form` True for a wrapper's, else detected."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if d.get("model_type", "kimi_linear") != "kimi_linear":
            raise ValueError(f"{source}: field 'model_type' must be 'kimi_linear' or 'kimi_k3', "
                             f"got {d['model_type']!r}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names and k not in _TRANSFORMERS_DERIVED}
        if "rope_theta" in d and _rope_theta_unused(d.get("mla_use_nope", True), d["rope_theta"]):
            extra["rope_theta"] = d["rope_theta"]  # a field, but to_dict needs the mark to write it back
        derived = {k: v for k, v in d.items() if k in _TRANSFORMERS_DERIVED}
        unknown = sorted(set(d) - names - _METADATA_KEYS - _TRANSFORMERS_DERIVED)
        la = d.get("linear_attn_config")
        la_names = {f.name for f in dataclasses.fields(LinearAttnConfig)}
        la_unknown = sorted(set(la) - la_names) if isinstance(la, dict) else []
        if la_unknown:
            extra["_linear_attn_config"] = {k: la[k] for k in la_unknown}
            kwargs["linear_attn_config"] = {k: v for k, v in la.items() if k in la_names}
        if unknown:
            warn_unknown(source, unknown, names)
        if la_unknown:
            warn_unknown(source, la_unknown, la_names, "linear_attn_config.")
        markers = k3_markers(d)
        if k3_form or markers:
            missing = missing_k3_fields(d)
            if missing:
                why = "it is a kimi_k3 config" if k3_form else f"it declares K3 feature(s) {', '.join(markers)}"
                defaults = ", ".join(f"{n} {_default_of(n)!r}" for n in missing)
                hint = typo_hint(unknown + la_unknown, missing)
                raise ValueError(f"{source}: missing K3 field(s) {', '.join(repr(n) for n in missing)}{hint}: "
                                 f"{why}, and openk3's defaults ({defaults}) are Kimi-Linear's or differ between "
                                 "engines, so the model would silently differ; set them explicitly")
        if "max_position_embeddings" not in kwargs and isinstance(d.get("model_max_length"), int):
            kwargs["max_position_embeddings"] = d["model_max_length"]  # transformers' spelling of the same field
        if "linear_attn_config" in kwargs:
            kwargs["linear_attn_config"] = _build(LinearAttnConfig, kwargs["linear_attn_config"],
                                                  f"{source}: linear_attn_config", la_unknown)
        cfg = _build(cls, {**kwargs, "extra": extra}, source, unknown)
        cfg._check_transformers_derived(derived, source)
        return cfg

    def _check_transformers_derived(self, derived: dict[str, Any], source: str) -> None:
        """transformers' `save_pretrained` adds fields it derives from the release's ones; they are
        accepted (and dropped) only when they agree with what openk3 derives."""
        la = self.linear_attn_config
        L = range(self.num_hidden_layers)
        ours = {
            "layer_types": ["full_attention" if self.is_mla_layer(i) else "linear_attention" for i in L],
            "mlp_layer_types": ["sparse" if self.is_moe_layer(i) else "dense" for i in L],
            "linear_conv_kernel_dim": la.short_conv_kernel_size,
            "linear_head_dim": la.head_dim,
            "linear_num_heads": la.num_heads,
            "qk_head_dim": self.qk_head_dim,
        }
        for key, value in derived.items():
            if value != ours[key]:
                raise ValueError(f"{source}: field {key!r} = {value!r} contradicts the release fields, "
                                 f"which give {ours[key]!r}")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "K3Config":
        """Read a config.json (top-level `kimi_k3` with `text_config`, or a bare `kimi_linear`)."""
        return cls.from_dict(read_json(path), source=str(path))

    def replace(self, **changes: Any) -> "K3Config":
        """A copy with `changes` applied (dotted keys `linear_attn_config.x` allowed), re-validated.

        A new `vocab_size` moves the special ids that sit in K3's reserved block (the last 256 ids) to
        the same offsets in the new vocabulary, unless `changes` sets them (`eos_token_id`, `extra`).
        """
        d = dataclasses.asdict(self)
        old_v, new_v = self.vocab_size, changes.get("vocab_size", self.vocab_size)
        if isinstance(new_v, int) and not isinstance(new_v, bool) and new_v != old_v:
            if "eos_token_id" not in changes:
                d["eos_token_id"] = moved_id(d["eos_token_id"], old_v, new_v)
            if "extra" not in changes:
                for ids in (d["extra"], d["extra"].get("_wrapper", {})):
                    for k in SPECIAL_ID_OFFSETS.keys() & ids.keys():
                        ids[k] = moved_id(ids[k], old_v, new_v)
        for key, value in changes.items():
            target, leaf = d, key
            if "." in key:
                head, leaf = key.split(".", 1)
                target = d[head]
            if leaf not in target:
                raise ValueError(f"unknown config field {key!r}")
            target[leaf] = value
        if "extra" not in changes and not _rope_theta_unused(d["mla_use_nope"], d["rope_theta"]):
            d["extra"].pop("rope_theta", None)  # the field is written now (see to_dict): no mark needed
        d["linear_attn_config"] = LinearAttnConfig(**d["linear_attn_config"])
        return K3Config(**d)


_OPENK3_ONLY = frozenset({"mla_latent_norm_eps"})


def _rope_theta_unused(mla_use_nope: Any, rope_theta: Any) -> bool:
    """A NoPE model with the default RoPE base: `to_dict` leaves `rope_theta` out (K3's files have none)."""
    return mla_use_nope is True and rope_theta == _default_of("rope_theta")


# Fields transformers' KimiLinearConfig derives from the release fields and writes back on save.
_TRANSFORMERS_DERIVED = frozenset({"layer_types", "mlp_layer_types", "linear_conv_kernel_dim", "linear_head_dim",
                                   "linear_num_heads", "qk_head_dim"})


def _default_of(name: str) -> Any:
    head, _, leaf = name.rpartition(".")
    return {f.name: f.default for f in dataclasses.fields(LinearAttnConfig if head else K3Config)}[leaf]


def _build(cls: type, d: Any, source: str, set_aside: list[str] = ()) -> Any:
    """cls(**d) with ValueErrors that name the missing or unknown field; `set_aside`: the file's
    unknown keys (kept in `extra`), named when they look like a missing field (a typo)."""
    if isinstance(d, cls):
        return d
    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected an object, got {d!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"{source}: unknown field(s) {unknown}")
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING and n not in d]
    if missing:
        raise ValueError(f"{source}: missing required field(s) {missing}{typo_hint(set_aside, missing)}")
    try:
        return cls(**d)
    except ValueError as e:  # validate() names the field; say which file it came from
        raise ValueError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None


# ---- presets -------------------------------------------------------------------------------

def hybrid_layers(num_layers: int) -> list[int]:
    """K3's rule (spec §1.6): full attention at 1-idx layers 4, 8, ... plus the last layer."""
    return sorted(set(range(4, num_layers + 1, 4)) | {num_layers})


def _k3_family(*, vocab: int, hidden: int, layers: int, kda_heads: int, kda_dim: int, mla_heads: int,
               q_lora: int, kv_lora: int, nope: int, rope: int, v: int, dense: int, experts: int, topk: int,
               latent: int, moe_inter: int, block: int, max_pos: int) -> K3Config:
    return K3Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=mla_heads,
        num_key_value_heads=mla_heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=v, mla_use_nope=True, mla_use_output_gate=True,
        max_position_embeddings=max_pos, hidden_act="situ", activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0, intermediate_size=dense, first_k_dense_replace=1, moe_layer_freq=1,
        num_experts=experts, num_experts_per_token=topk, num_shared_experts=2, moe_intermediate_size=moe_inter,
        routed_expert_hidden_size=latent, latent_moe_use_norm=True, routed_scaling_factor=1.0,
        rms_norm_eps=1e-5, attn_res_block_size=block,
        linear_attn_config=LinearAttnConfig(
            num_heads=kda_heads, head_dim=kda_dim, short_conv_kernel_size=4, gate_lower_bound=-5.0,
            use_full_rank_gate=True, full_attn_layers=hybrid_layers(layers)),
    )


def nano() -> K3Config:
    """4.8M parameters, every structural feature of K3 (spec k3-configs.md). CI and unit tests."""
    return _k3_family(vocab=512, hidden=128, layers=9, kda_heads=4, kda_dim=32, mla_heads=4, q_lora=64, kv_lora=32,
                      nope=32, rope=16, v=32, dense=512, experts=32, topk=4, latent=64, moe_inter=64, block=3,
                      max_pos=4096)


def small() -> K3Config:
    """42M parameters (17.5M active): minutes-long CPU training runs."""
    return _k3_family(vocab=8192, hidden=256, layers=13, kda_heads=6, kda_dim=64, mla_heads=6, q_lora=96, kv_lora=64,
                      nope=64, rope=32, v=64, dense=1024, experts=64, topk=8, latent=128, moe_inter=96, block=5,
                      max_pos=8192)


def base() -> K3Config:
    """1.56B parameters (0.61B active), K3's exact head dims and real vocabulary: one GPU."""
    return _k3_family(vocab=163840, hidden=1024, layers=21, kda_heads=12, kda_dim=128, mla_heads=12, q_lora=384,
                      kv_lora=256, nope=128, rope=64, v=128, dense=4864, experts=256, topk=16, latent=512,
                      moe_inter=128, block=8, max_pos=131072)


def k3() -> K3Config:
    """The released Kimi K3 text model, exactly (spec §1.3-1.4)."""
    return _k3_family(vocab=163840, hidden=7168, layers=93, kda_heads=96, kda_dim=128, mla_heads=96, q_lora=1536,
                      kv_lora=512, nope=128, rope=64, v=128, dense=33792, experts=896, topk=16, latent=3584,
                      moe_inter=3072, block=12, max_pos=1048576)


def vllm_tiny() -> K3Config:
    """A K3-form model (every K3 feature) at head shapes vLLM's kernels take: K3's own MLA and KDA head dims
    (kv_lora_rank 512, rope 64, nope/v 128, KDA head_dim 128) as in vLLM's tiny-K3 test, 8 heads (tensor parallel
    up to 8), 4 layers (3 KDA + 1 MLA), small's vocabulary; MLA latent norms at rms_norm_eps, as vLLM computes
    them. For whoever checks `openk3 export vllm` on a GPU (docs/ecosystem.md); the shape limits are read from
    vLLM's tests, not documented by vLLM."""
    cfg = _k3_family(vocab=8192, hidden=512, layers=4, kda_heads=8, kda_dim=128, mla_heads=8, q_lora=384,
                     kv_lora=512, nope=128, rope=64, v=128, dense=1024, experts=16, topk=4, latent=256,
                     moe_inter=128, block=2, max_pos=8192)
    return cfg.replace(mla_latent_norm_eps=cfg.rms_norm_eps)


def kimi_linear_48b() -> K3Config:
    """moonshotai/Kimi-Linear-48B-A3B: softplus gate, low-rank output gate, no AttnRes, SwiGLU, plain MoE."""
    return K3Config(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_use_nope=True, mla_use_output_gate=False, max_position_embeddings=1048576, hidden_act="silu",
        intermediate_size=9216, first_k_dense_replace=1, moe_layer_freq=1, num_experts=256, num_experts_per_token=8,
        num_shared_experts=1, moe_intermediate_size=1024, routed_scaling_factor=2.446, rms_norm_eps=1e-5,
        linear_attn_config=LinearAttnConfig(num_heads=32, head_dim=128, short_conv_kernel_size=4,
                                            full_attn_layers=[4, 8, 12, 16, 20, 24, 27]),
    )


def as_kimi_linear(cfg: K3Config) -> K3Config:
    """The same shapes in the predecessor's form (what transformers' KimiLinear can run).

    Experts move from the latent to the full hidden width, so `moe_intermediate_size` is scaled by
    latent/hidden to keep the routed parameter count (and hence total and active counts) about equal.
    """
    inter = cfg.moe_intermediate_size
    if cfg.routed_expert_hidden_size is not None:
        inter = max(1, inter * cfg.routed_expert_hidden_size // cfg.hidden_size)
    return cfg.replace(hidden_act="silu", mla_use_output_gate=False, routed_expert_hidden_size=None,
                       latent_moe_use_norm=False, attn_res_block_size=None, moe_intermediate_size=inter,
                       **{"linear_attn_config.gate_lower_bound": None,
                          "linear_attn_config.use_full_rank_gate": False})


PRESETS = {
    "nano": nano,
    "small": small,
    "base": base,
    "k3": k3,
    "kimi-linear-48b": kimi_linear_48b,
    "vllm-tiny": vllm_tiny,
}


def preset(name: str) -> K3Config:
    """A preset by name; `<name>-kl` gives the same shapes in Kimi-Linear form (e.g. `small-kl`)."""
    if name.endswith("-kl") and name[:-3] in PRESETS:
        return as_kimi_linear(PRESETS[name[:-3]]())
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), 1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint}; choose from {sorted(PRESETS)} or '<preset>-kl'")
    return PRESETS[name]()
