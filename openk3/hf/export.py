"""Exports of a K3 checkpoint for other tools: a self-contained transformers folder, and the release-path folder
that vLLM's native `kimi_k3` reads.

    openk3 export hf runs/x out-hf          # AutoModelForCausalLM / AutoTokenizer, trust_remote_code=True
    openk3 export vllm runs/x out-vllm      # vllm serve out-vllm (a GPU machine with vLLM's K3 support)

`export_hf` writes the release's format (wrapper config, `language_model.` names, per-expert tensors) plus
`auto_map` pointing at two shim files (`configuration_openk3.py`, `modeling_openk3.py`) that import `openk3.hf`:
`from_pretrained(OUT, trust_remote_code=True)` then needs only openk3 installed, no `import openk3.hf`. The
tokenizer goes along as `tokenizer.json` (converted from the tiktoken ranks, `openk3.hf.tokenizer`) beside
openk3's own files. `export_vllm` writes the wrapper with every field vLLM's config reads set explicitly, no
`auto_map` (vLLM runs its own K3 code), and the same tokenizer files. Both write into a temporary sibling and
swap it in, so OUT is either the old folder or the complete new one.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

#: transformers' auto classes -> the shim modules an exported folder ships.
AUTO_MAP = {
    "AutoConfig": "configuration_openk3.KimiK3Config",
    "AutoModelForCausalLM": "modeling_openk3.KimiK3ForConditionalGeneration",
}
SHIMS = {
    "configuration_openk3.py": "# openk3's K3 config for transformers (pip install 'openk3[hf]').\n"
                               "from openk3.hf.configuration import KimiK3Config, KimiK3TextConfig  # noqa: F401\n",
    "modeling_openk3.py": "# openk3's K3 model for transformers (pip install 'openk3[hf]').\n"
                          "from openk3.hf.modeling import KimiK3ForConditionalGeneration  # noqa: F401\n",
}

#: `text_config` fields vLLM's K3 model and config read (vllm/transformers_utils/configs/kimi_k3.py and the
#: KimiLinear model it builds; see docs/ecosystem.md). `export_vllm` writes each explicitly.
VLLM_TEXT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "moe_intermediate_size", "num_experts", "num_experts_per_token", "num_shared_experts", "moe_renormalize",
    "moe_router_activation_func", "routed_scaling_factor", "use_grouped_topk", "num_expert_group", "topk_group",
    "first_k_dense_replace", "moe_layer_freq", "routed_expert_hidden_size", "latent_moe_use_norm", "hidden_act",
    "activation_situ_beta", "activation_situ_linear_beta", "rms_norm_eps", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate",
    "attn_res_block_size", "num_nextn_predict_layers", "tie_word_embeddings", "linear_attn_config",
)
VLLM_LINEAR_ATTN_FIELDS = ("num_heads", "head_dim", "short_conv_kernel_size", "kda_layers", "full_attn_layers",
                           "gate_lower_bound", "use_full_rank_gate")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _source(src: str | os.PathLike, tokenizer: str | os.PathLike | None):
    from openk3.checkpoint import read_config, resolve_checkpoint
    from openk3.tokenizer import Tokenizer

    src = resolve_checkpoint(src)
    tok_dir = Path(tokenizer) if tokenizer is not None else src
    if not (tok_dir / "tiktoken.model").is_file():
        raise ValueError(f"{tok_dir}: no tokenizer (tiktoken.model); an export ships one: pass --tokenizer DIR "
                         f"(a folder with tiktoken.model and tokenizer_config.json)")
    tok = Tokenizer.from_dir(str(tok_dir))
    cfg = read_config(src)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"{tok_dir}: the tokenizer has {tok.vocab_size} ids, more than the model's vocab_size "
                         f"{cfg.vocab_size} ({src / 'config.json'})")
    return src, tok


def _write(src, out, tokenizer, experts_format: str | None, dtype, *, remote_code: bool, patch) -> Path:
    from openk3.checkpoint import files, save
    from openk3.checkpoint.load import load_to_rewrite
    from openk3.hf.tokenizer import save_hf_tokenizer

    src, tok = _source(src, tokenizer)
    out = Path(out)
    if out.resolve() == src.resolve():
        raise ValueError("SRC and OUT must differ")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a folder")
    model, experts_format = load_to_rewrite(src, experts_format)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = files.temp_sibling(out, "export")
    try:
        save(model, tmp, wrapper=True, experts_format=experts_format, dtype=dtype or "auto")
        config = json.loads((tmp / "config.json").read_text())
        patch(config, model.config)
        # (transformers reads a tokenizer folder's config.json; without this key it warns, falsely, that K3's
        # large-vocabulary regex is Mistral's broken one)
        config.setdefault("transformers_version", _transformers_version())
        files.write_json(tmp / "config.json", config)
        save_hf_tokenizer(tok, tmp, remote_code=remote_code)
        if remote_code:
            for name, text in SHIMS.items():
                (tmp / name).write_text(text)
        files.swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not remote_code:  # an earlier `export hf` into OUT left its shims (swap_in keeps files it does not write)
        from openk3.hf.tokenizer import REMOTE_CODE_FILE, remove_own_shim

        remove_own_shim(str(out / REMOTE_CODE_FILE))
        for name, text in SHIMS.items():
            if (out / name).is_file() and (out / name).read_text() == text:
                (out / name).unlink()
    return out


def export_hf(src: str | os.PathLike, out: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None,
              experts_format: str | None = None, dtype=None) -> Path:
    """A transformers folder: `AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)` and
    `AutoTokenizer.from_pretrained(out)` work with openk3 installed (no import needed). `experts_format`: None =
    as in `src`; `dtype`: None = as stored. Returns `out`."""

    def patch(config: dict[str, Any], cfg) -> None:
        config["auto_map"] = dict(AUTO_MAP)

    return _write(src, out, tokenizer, experts_format, dtype, remote_code=True, patch=patch)


def vllm_text_config(cfg, text: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `text_config` for vLLM: `text` (default `cfg.to_dict()`) plus every field of `VLLM_TEXT_FIELDS` written
    explicitly (defaults openk3 leaves out of config.json included)."""
    text = copy.deepcopy(text) if text is not None else cfg.to_dict()
    for name in VLLM_TEXT_FIELDS:
        if name not in text:
            text[name] = getattr(cfg, name)
    la = text["linear_attn_config"]
    for name in VLLM_LINEAR_ATTN_FIELDS:
        if la.get(name) is None and name in ("kda_layers", "full_attn_layers"):
            raise ValueError(f"linear_attn_config.{name} is not set; vLLM requires it")
        la.setdefault(name, getattr(cfg.linear_attn_config, name))
    if not text["mla_use_nope"]:
        raise ValueError("mla_use_nope is false (RoPE MLA): vLLM's K3 model implements NoPE MLA only")
    return text


def export_vllm(src: str | os.PathLike, out: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None,
                experts_format: str | None = None, dtype=None) -> tuple[Path, list[str]]:
    """The release-path folder vLLM's native `kimi_k3` reads (no remote code). Returns (`out`, notes): what vLLM
    will compute differently (the MLA latent-norm eps)."""
    notes: list[str] = []

    def patch(config: dict[str, Any], cfg) -> None:
        config.pop("auto_map", None)
        config["text_config"] = vllm_text_config(cfg, config["text_config"])
        if cfg.mla_latent_norm_eps != cfg.rms_norm_eps:
            notes.append(f"vLLM normalises the MLA latents with rms_norm_eps ({cfg.rms_norm_eps}); this model uses "
                         f"mla_latent_norm_eps {cfg.mla_latent_norm_eps}: expect small logit differences")

    return _write(src, out, tokenizer, experts_format, dtype, remote_code=False, patch=patch), notes
