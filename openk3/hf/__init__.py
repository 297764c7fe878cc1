"""openk3 in the Hugging Face stack (the `hf` extra: transformers, peft, accelerate). `import openk3` never
imports this; `import openk3.hf` registers `kimi_k3` with transformers' Auto classes.

    import openk3.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("runs/x", dtype=torch.bfloat16)   # any K3 folder openk3 opens
    from peft import LoraConfig, get_peft_model
    lora = LoraConfig(r=8, lora_dropout=0.0, target_modules=openk3.hf.lora_target_modules(model.config),
                      target_parameters=openk3.hf.lora_target_parameters(model.config))
    model = get_peft_model(model, lora)                                           # every target takes effect

`KimiK3ForConditionalGeneration` is openk3's own `K3ForCausalLM` (no second model) under transformers' API:
forward/loss, `generate` with a `K3Cache`, Trainer (gradient checkpointing, resume), PEFT. Exports for other
tools: `openk3.hf.export` (`openk3 export hf|vllm`). docs/ecosystem.md has the whole picture.
"""

from __future__ import annotations

from openk3.config import K3Config
from openk3.hf.cache import K3Cache
from openk3.hf.configuration import KimiK3Config, KimiK3TextConfig
from openk3.hf.modeling import KimiK3ForConditionalGeneration, KimiK3PreTrainedModel

__all__ = ["K3Cache", "KimiK3Config", "KimiK3ForConditionalGeneration", "KimiK3PreTrainedModel", "KimiK3TextConfig",
           "lora_target_modules", "lora_target_parameters", "register"]

_registered = False


def register() -> None:
    """Register `kimi_k3` with AutoConfig, AutoModelForCausalLM, AutoTokenizer and transformers'
    weight-conversion table (per-expert release tensors <-> stacked experts). Idempotent; run on import."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import MergeModulelist, WeightConverter

    AutoConfig.register("kimi_k3", KimiK3Config, exist_ok=True)
    AutoModelForCausalLM.register(KimiK3Config, KimiK3ForConditionalGeneration, exist_ok=True)
    # (not AutoModel: that names a model without its head, returning hidden states, which K3 with Block AttnRes
    # does not expose per layer; KimiK3ForConditionalGeneration is the head model)
    # openk3's loader reads the folders (from_pretrained); the table tells transformers' own tools (state-dict
    # conversion, reverting names on save) that the release stores routed experts one by one.
    register_checkpoint_conversion_mapping("KimiK3ForConditionalGeneration", [
        WeightConverter(source_patterns=rf"\.experts.*.{w}.weight", target_patterns=rf"\.experts.{w}",
                        operations=[MergeModulelist(dim=0)]) for w in ("w1", "w2", "w3")], overwrite=True)
    from openk3.hf.tokenizer import register_tokenizer

    register_tokenizer(KimiK3Config)
    _registered = True


def _k3(config) -> K3Config:
    if isinstance(config, K3Config):
        return config
    if isinstance(config, KimiK3Config):
        return config.to_k3()
    raise ValueError(f"expected a K3Config or KimiK3Config, got {type(config).__name__}")


def lora_target_modules(config) -> list[str]:
    """Every linear module where a LoRA adapter takes effect, in training and in cached decode, as full names
    under the text model (`model.layers.3.self_attn.kv_b_proj`; PEFT's `target_modules` matches them as suffixes
    of the wrapped model's names): KDA and MLA projections (`kv_b_proj` included: MLA reads its matrix through
    `openk3.model.layers.linear_weight`, which sees the adapter), the dense MLP and shared experts, the latent MoE
    projections, the AttnRes pseudo-queries. Left out: layer 0's `self_attention_res_proj` (the first layer has
    no earlier block to mix: the weight exists in the release but is never read), the router (`gate`, not a
    linear layer: fp32 scores, a bias kept by load balancing), `lm_head` (add it yourself if you want it). The
    routed experts are parameters: `lora_target_parameters`."""
    import torch.nn as nn

    from openk3.model.model import K3ForCausalLM

    cfg = _k3(config)
    model = K3ForCausalLM.build(cfg, device="meta")
    names = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or name == "lm_head":
            continue
        if name.endswith(".self_attention_res_proj") and name.split(".")[2] == "0":
            continue
        names.append(name)
    return names


def lora_target_parameters(config) -> list[str]:
    """The routed experts' stacked weights (`experts.w1`/`w3` [E, I, C], `w2` [E, C, I]) for PEFT's
    `target_parameters` (needs `lora_dropout=0`). The adapter applies inside `Experts.forward`, where every
    expert path (grouped, sparse, fused kernel) reads them. Empty for a config without MoE layers."""
    cfg = _k3(config)
    if not any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        return []
    return ["experts.w1", "experts.w3", "experts.w2"]


register()
