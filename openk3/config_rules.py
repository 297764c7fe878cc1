"""What a config file must say beyond its fields' types (docs/architecture.md, *Reading a config file*).

* K3 form: the defaults of `K3Config` are Kimi-Linear's, so a K3 config file (a `kimi_k3` wrapper, or
  a bare `kimi_linear` file declaring a K3 feature) must set every field in `K3_REQUIRED_FIELDS`.
* Special ids: K3's 256 reserved ids are the top of the vocabulary (spec §7.1), so `[BOS]`,
  `<|end_of_msg|>` (the config's eos), `<|media_pad|>` and `[PAD]` sit at `vocab_size - 256 + offset`;
  declared ids must lie in the vocabulary, and resizing it moves the ids of the reserved block.
* Unknown keys are kept by `openk3.config`, with a warning from `warn_unknown`.

Stdlib only: `openk3.config` imports this and must not load torch (or the tokenizer package, whose
table of offsets a test keeps in step with `SPECIAL_ID_OFFSETS`).
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable
from typing import Any

# Fields a K3 config file must set: each default is Kimi-Linear's, or differs between engines
# (rms_norm_eps 1e-6 and first_k_dense_replace 0 in the Kimi-Linear remote code, SiTU betas 1.0 in
# some ports), so a missing one would silently compute a different model. `linear_attn_config.` names
# the nested object; the SiTU betas are required only when `hidden_act` is "situ".
K3_REQUIRED_FIELDS = (
    "hidden_act", "activation_situ_beta", "activation_situ_linear_beta",  # SiTU-GLU vs SwiGLU
    "attn_res_block_size",  # Block AttnRes vs the plain residual stream
    "routed_expert_hidden_size", "latent_moe_use_norm",  # LatentMoE vs full-width experts
    "num_shared_experts", "moe_renormalize", "routed_scaling_factor", "first_k_dense_replace",  # MoE / router
    "mla_use_output_gate", "q_lora_rank",  # MLA form
    "rms_norm_eps",
    "linear_attn_config.gate_lower_bound", "linear_attn_config.use_full_rank_gate",  # KDA gate forms
)
# A bare `kimi_linear` file is in K3 form when it declares any of these with a value other than the
# Kimi-Linear one (the SiTU betas count by their mere presence: only K3 carries them).
_K3_MARKERS = {"hidden_act": "silu", "attn_res_block_size": None, "routed_expert_hidden_size": None,
               "latent_moe_use_norm": False, "mla_use_output_gate": False}
_K3_LA_MARKERS = {"gate_lower_bound": None, "use_full_rank_gate": False}

# Offsets into the reserved block as in openk3/tokenizer/special.py ([BOS] 0, <|end_of_msg|> 2,
# <|media_pad|> 21, [PAD] 255).
NUM_RESERVED_SPECIALS = 256
SPECIAL_ID_OFFSETS = {"bos_token_id": 0, "eos_token_id": 2, "media_placeholder_token_id": 21, "pad_token_id": 255}


# ---- K3 form -------------------------------------------------------------------------------------

def k3_markers(d: dict[str, Any]) -> list[str]:
    """The K3 features a bare config dict declares (empty for a Kimi-Linear one)."""
    found = [k for k, kimi_linear in _K3_MARKERS.items() if k in d and d[k] != kimi_linear]
    found += [k for k in ("activation_situ_beta", "activation_situ_linear_beta") if k in d]
    la = d.get("linear_attn_config")
    if isinstance(la, dict):
        found += [f"linear_attn_config.{k}" for k, kimi_linear in _K3_LA_MARKERS.items()
                  if k in la and la[k] != kimi_linear]
    return found


def missing_k3_fields(d: dict[str, Any]) -> list[str]:
    """The names of `K3_REQUIRED_FIELDS` that the config dict `d` does not set (a null value is set)."""
    def has(name: str) -> bool:
        head, _, leaf = name.rpartition(".")
        obj = d.get(head) if head else d
        return isinstance(obj, dict) and leaf in obj

    missing = [n for n in K3_REQUIRED_FIELDS if not has(n)]
    if d.get("hidden_act") != "situ":  # the SiTU betas mean nothing to SwiGLU
        missing = [n for n in missing if not n.startswith("activation_situ")]
    return missing


def typo_hint(unknown: Iterable[str], missing: list[str]) -> str:
    """" (misspelt? the file has 'hiden_act' for 'hidden_act')" for unknown keys that look like a
    missing field (compared by their last dotted part), else ""."""
    leaves = {n.rpartition(".")[2]: n for n in missing}
    typos = [f"{u!r} for {leaves[m[0]]!r}" for u in unknown
             if (m := difflib.get_close_matches(u.rpartition(".")[2], list(leaves), 1))]
    return f" (misspelt? the file has {', '.join(typos)})" if typos else ""


def warn_unknown(source: str, unknown: list[str], known: Iterable[str], prefix: str = "") -> None:
    """Warn naming the file and its unknown keys (the release's config may carry keys the spec does not list)."""
    known = list(known)
    hints = [f"{prefix}{u} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(u, known, 1)) else prefix + u
             for u in unknown]
    warnings.warn(f"{source}: unknown field(s) {', '.join(hints)}: kept as they are (and written back on save), "
                  "not used by openk3", UserWarning, stacklevel=4)


# ---- special ids ---------------------------------------------------------------------------------

def k3_special_id(vocab_size: int, key: str) -> int | None:
    """The id of `key` ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id")
    in K3's layout for a vocabulary of `vocab_size` (163840 -> the release's 163584/163586/163839/163605),
    or None when the vocabulary is too small to hold the reserved block."""
    if vocab_size < NUM_RESERVED_SPECIALS:
        return None
    return vocab_size - NUM_RESERVED_SPECIALS + SPECIAL_ID_OFFSETS[key]


def check_token_ids(ids: dict[str, Any], vocab_size: int, where: str = "") -> None:
    """ValueError naming the first id of `ids` (key -> value) that is neither null nor a token id in
    [0, vocab_size); `eos_token_id` may be a list of ids."""
    for key, value in ids.items():
        values = value if key == "eos_token_id" and isinstance(value, list) else [value]
        if value is None or all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in values):
            continue
        k3 = k3_special_id(vocab_size, key) if key in SPECIAL_ID_OFFSETS else None
        hint = f" (K3's layout puts it at {k3} for this vocabulary)" if k3 is not None else ""
        raise ValueError(f"config field {key!r}{where} must be a token id in [0, {vocab_size}) (vocab_size) or null, "
                         f"got {value!r}{hint}")


def moved_id(value: Any, old_vocab: int, new_vocab: int) -> Any:
    """`value` (an id, a list of ids or None) with ids in the old vocabulary's reserved block moved to
    the same offset in the new one (dropped when the new one has no block); other ids unchanged."""
    if isinstance(value, list):
        moved = [m for v in value if (m := moved_id(v, old_vocab, new_vocab)) is not None]
        return moved or None
    if isinstance(value, int) and old_vocab - NUM_RESERVED_SPECIALS <= value < old_vocab:
        new = value - old_vocab + new_vocab
        return new if new_vocab >= NUM_RESERVED_SPECIALS else None
    return value
