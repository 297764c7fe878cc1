"""`KimiK3ForConditionalGeneration`: openk3's own `K3ForCausalLM` as a transformers model (no second model).

    import openk3.hf                                   # registers kimi_k3 with the Auto classes
    model = AutoModelForCausalLM.from_pretrained("runs/x", dtype=torch.bfloat16)
    model.generate(ids, max_new_tokens=32, do_sample=False)
    model.save_pretrained("out")                       # the release's format: openk3.load reads it back

Module tree: `language_model` is the `K3ForCausalLM`, so parameter names are the release's tensor names
(`language_model.model.layers.N...`, `language_model.lm_head.weight`) except the routed experts, stacked per layer
(`...experts.w1` [E, I, C]); `load_state_dict` accepts the release's per-expert names too (what a transformers
Trainer checkpoint of this class holds), stacking them back.

Loading and saving go through openk3's reader and writer (`openk3.load`, `openk3.save`), not transformers' loader:
the same checks (every tensor present, shapes, NaN/inf, A_log padding), fp32 islands kept under any dtype, MXFP4
experts dequantised exactly. transformers' own quantizer never sees the release's `quantization_config`.

Legend: B rows, T tokens, D hidden, V vocabulary.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from openk3.hf.cache import K3Cache
from openk3.hf.configuration import KimiK3Config
from openk3.model.model import DecoderLayer, K3ForCausalLM

# A per-expert tensor of the release's layout, as a transformers checkpoint of this class holds them.
_PER_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(w[123])\.weight$")


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    base_model_prefix = "language_model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    # transformers' dtype plan keeps these in fp32 (patterns searched in tensor names); openk3 does the same itself
    _keep_in_fp32_modules_strict = ["conv1d", "A_log", "dt_bias", "self_attn.o_norm", "e_score_correction_bias"]
    # Recurrent state cannot be rolled back: assisted decoding refuses instead of giving wrong tokens.
    _is_stateful = True
    _supports_sdpa = False
    _can_compile_fullgraph = False

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate must not build a DynamicCache: forward makes a K3Cache

    def _init_weights(self, module: nn.Module) -> None:
        pass  # openk3 initialises every tensor itself (K3ForCausalLM.init_weights) or loads it


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel, GenerationMixin):
    """The K3 text model (`language_model`: an openk3 `K3ForCausalLM`) under transformers' API: forward with
    labels, `generate` (greedy, sampling, beam search) with a `K3Cache`, Trainer, PEFT, gradient checkpointing."""

    def __init__(self, config: KimiK3Config, language_model: K3ForCausalLM | None = None) -> None:
        super().__init__(config)
        if language_model is None:
            k3 = config.to_k3()
            dtype = torch.get_default_dtype()
            on_meta = torch.empty(0).device.type == "meta"  # (under init_empty_weights / a meta device context)
            language_model = K3ForCausalLM.build(k3, device="meta" if on_meta else "cpu", dtype=dtype, seed=0)
        self.language_model = language_model
        self._register_load_state_dict_pre_hook(_stack_experts_hook, with_module=True)
        self.post_init()

    # -- embeddings (Trainer / PEFT use them) -------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.language_model.lm_head = value

    # -- loading and saving through openk3 ----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, dtype=None, torch_dtype=None,
                        device_map=None, output_loading_info: bool = False, subfolder: str = "", **kwargs):
        """Open a local K3 checkpoint folder (release-format, bf16 or MXFP4 experts; wrapper or bare config) with
        `openk3.load`. `dtype`: a torch dtype, its name, or "auto"/None (as stored); islands stay fp32.
        `device_map`: None, a device ("cpu", "cuda:0") or {"": device}; the model is not split across devices.
        `config`: must describe the folder's model (edit its config.json to change the model); keyword
        arguments may set config attributes that do not change the model (`use_cache`, ...)."""
        for key in _IGNORED_LOAD_ARGS:
            kwargs.pop(key, None)
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in _CONFIG_ONLY_ARGS}
        if model_args or kwargs:
            raise ValueError(f"KimiK3ForConditionalGeneration.from_pretrained: unsupported arguments "
                             f"{sorted(kwargs) or list(model_args)} (a model field changes in the folder's "
                             f"config.json, not here)")
        path = Path(pretrained_model_name_or_path) / subfolder
        if not path.exists():
            raise ValueError(f"{path}: no such folder; openk3.hf opens local checkpoint folders only (download it "
                             f"first, e.g. `hf download REPO --local-dir DIR`)")
        dtype = dtype if dtype is not None else torch_dtype
        from openk3.checkpoint import load

        lm = load(path, dtype=None if dtype in (None, "auto") else dtype, device=_device_of(device_map))
        if isinstance(config, KimiK3Config):
            if _model_fields(config.to_k3()) != _model_fields(lm.config):
                raise ValueError(f"config= describes another model than {path / 'config.json'}; to change the "
                                 f"model, edit that file (or build one with KimiK3ForConditionalGeneration(config))")
            hf_config = config
        elif config is None:
            hf_config = KimiK3Config.from_k3(lm.config)
        else:
            raise ValueError(f"config must be a KimiK3Config, got {type(config).__name__}")
        for key, value in overrides.items():
            setattr(hf_config, key, value)
        hf_config.name_or_path = str(pretrained_model_name_or_path)
        model = cls(hf_config, language_model=lm)
        model.eval()  # (as transformers' from_pretrained leaves a model)
        if (path / "generation_config.json").is_file():
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(str(path))
        if output_loading_info:
            return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
        return model

    @classmethod
    def _from_config(cls, config: KimiK3Config, **kwargs):
        dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
        model = cls(config)
        if dtype is not None:
            model.language_model.cast(dtype)
        return model

    def save_pretrained(self, save_directory: str | os.PathLike, *, experts_format: str = "bf16",
                        dtype: torch.dtype | str | None = None, max_shard_size: int | str | None = None,
                        state_dict: dict | None = None, is_main_process: bool = True, **kwargs) -> None:
        """Write the release's format with `openk3.save` (wrapper config, `language_model.` names, per-expert
        tensors). `experts_format`: "bf16" (routed experts unquantised, in `dtype`: exact) or "mxfp4" (the
        release's quantisation). `dtype`: None keeps the model's. `is_main_process` False writes nothing (the
        other ranks of a distributed run). A `state_dict` (a Trainer passes one) is only accepted when it is this
        model's own, unsharded: a sharded run (FSDP, ZeRO-3) saves with openk3's distributed checkpoints
        (docs/distributed.md). Other transformers arguments (safe_serialization, ...) are accepted and ignored:
        the files are always safetensors."""
        from openk3.checkpoint import save
        from openk3.config_types import parse_bytes

        if not is_main_process:
            return
        lm = _plain_model(self)
        if state_dict is not None:
            own = self.state_dict()
            if state_dict.keys() != own.keys() or any(type(v) is not torch.Tensor or v.data_ptr() != own[k].data_ptr()
                                                      for k, v in state_dict.items()):
                raise ValueError("save_pretrained(state_dict=...) with tensors other than this model's own (a sharded "
                                 "or gathered copy): save the model itself, or use openk3's distributed checkpoints")
        shard = 5 * 2**30 if max_shard_size is None else parse_bytes(max_shard_size, "max_shard_size")
        save(lm, save_directory, wrapper=True, experts_format=experts_format,
             dtype=dtype if dtype is not None else "auto", max_shard_bytes=shard)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, *args, **kwargs) -> nn.Embedding:
        """transformers' resize, then the K3 config follows (vocab_size; special ids keep their ids)."""
        emb = super().resize_token_embeddings(new_num_tokens, *args, **kwargs)
        cfg = self.language_model.config
        vocab = emb.weight.shape[0]
        if vocab != cfg.vocab_size:
            new = cfg.replace(vocab_size=vocab, eos_token_id=cfg.eos_token_id, extra=cfg.extra)
            self.language_model.config = self.language_model.model.config = new
            self.config.text_config.vocab_size = vocab
        return emb

    # -- gradient checkpointing ---------------------------------------------------------------------------------
    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1) -> None:
        """A decoder layer has no single forward to wrap (Block AttnRes mixes between its sub-layers), so each
        layer's token mixer and FFN are recomputed through `DecoderLayer.sublayer_wrapper`, as
        `openk3.parallel.ac` does."""
        if gradient_checkpointing_func is None:
            from openk3.parallel.ac import checkpointed as wrap
        else:
            def wrap(fn, *args):
                return gradient_checkpointing_func(fn, *args) if torch.is_grad_enabled() else fn(*args)

        layers = [m for m in self.modules() if isinstance(m, DecoderLayer)]
        for i, layer in enumerate(layers):
            layer.sublayer_wrapper = wrap if enable and i % every_n_layers == 0 else None
        self.gradient_checkpointing = enable

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(m.sublayer_wrapper is not None for m in self.modules() if isinstance(m, DecoderLayer))

    # -- forward -------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: K3Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """Token ids [B, T] (or `inputs_embeds` [B, T, D]) -> logits [B, T', V], and the loss given `labels`
        (transformers' convention: the inputs themselves, shifted inside; -100 ignored).

        `attention_mask`: zeros mark padding. Without a cache each run of pads or tokens is attended as its own
        document (left padding gives each row exactly its unpadded result; K3's MLA has no positions). With a
        cache (decoding) a mask with zeros raises ValueError: KDA state would take the pads in. `position_ids`:
        only their resets to 0 matter (packed sequences, as transformers' DataCollatorWithFlattening makes):
        each starts a document. `use_cache` (default: only when `past_key_values` is given; `generate` turns it on)
        returns a `K3Cache` to continue from.
        """
        if kwargs.pop("output_hidden_states", None) or kwargs.pop("output_attentions", None):
            raise ValueError("output_hidden_states / output_attentions are not supported: with Block AttnRes a K3 "
                             "layer has no residual stream to report; for the final hidden states call "
                             "model.language_model.model(input_ids)")
        for key in ("cache_position", "return_dict"):
            kwargs.pop(key, None)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = input_ids if input_ids is not None else inputs_embeds
        B, T = x.shape[0], x.shape[1]
        if use_cache is None:  # (generate passes True; a plain call computes exactly what K3ForCausalLM does)
            use_cache = past_key_values is not None
        if past_key_values is not None and not isinstance(past_key_values, K3Cache):
            raise ValueError(f"past_key_values must be an openk3.hf.K3Cache (or None: one is made), got "
                             f"{type(past_key_values).__name__}; K3 keeps KDA recurrent state, which "
                             f"transformers' DynamicCache does not hold")
        cache = None
        if use_cache:
            if past_key_values is None:
                past_key_values = K3Cache(self.language_model.config.num_hidden_layers)
            cache = past_key_values.dense
        seg_BT = _segments(attention_mask, position_ids, B, T, cache is not None)
        lm = self.language_model
        last_only = isinstance(logits_to_keep, int) and logits_to_keep == 1
        # MLA as openk3's engine runs it: the naive form over a prompt (the same arithmetic as training and as a
        # forward without cache: equal logits), the absorbed one for a decode step
        mla_impl = "absorbed" if cache is not None and T == 1 else "naive"
        logits = lm(input_ids, seg_BT=seg_BT, cache=cache, mla_impl=mla_impl, last_only=last_only,
                    inputs_embeds_BTD=inputs_embeds)
        if isinstance(logits_to_keep, int) and logits_to_keep > 1:
            logits = logits[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values if use_cache else None)


# from_pretrained arguments about where files come from (openk3 reads local folders) or how transformers' own
# loader works: accepted and ignored.
_IGNORED_LOAD_ARGS = ("trust_remote_code", "local_files_only", "revision", "cache_dir", "use_safetensors",
                      "low_cpu_mem_usage", "attn_implementation", "_from_auto", "_from_pipeline", "adapter_kwargs",
                      "token", "force_download", "proxies", "code_revision", "key_mapping")
# ... and config attributes that do not change the model, set on the config as transformers does.
_CONFIG_ONLY_ARGS = ("use_cache", "return_dict", "output_attentions", "output_hidden_states")


def _model_fields(cfg) -> dict:
    """A K3Config's fields that decide the model (metadata and the wrapper's other towers left out)."""
    meta = ("dtype", "torch_dtype", "transformers_version", "quantization_config", "_name_or_path", "auto_map",
            "bos_token_id", "pad_token_id")
    return {k: v for k, v in cfg.to_dict().items() if k not in meta}


def _device_of(device_map) -> str | torch.device:
    if device_map is None:
        return "cpu"
    if isinstance(device_map, (str, torch.device)) and str(device_map) not in ("auto", "balanced", "sequential"):
        return device_map
    if isinstance(device_map, dict) and set(device_map) == {""}:
        return device_map[""]
    raise ValueError(f"device_map={device_map!r}: openk3's K3 model runs on one device (or under FSDP/DDP); "
                     f"pass a device such as 'cpu' or 'cuda:0'")


def _segments(mask_BT: torch.Tensor | None, pos_BT: torch.Tensor | None, B: int, T: int,
              cached: bool) -> torch.Tensor | None:
    """Document index per token [B, T] (non-decreasing per row), or None for one document per row."""
    seg = None
    if mask_BT is not None:
        mask_BT = mask_BT[:, -T:] if mask_BT.shape[1] >= T else mask_BT
        if bool((mask_BT == 0).any()):
            if cached:
                raise ValueError("a padded batch (attention_mask with zeros) cannot be decoded with a cache: KDA's "
                                 "recurrent state would take the pads in. Generate rows of equal length (or one "
                                 "row at a time), or pass use_cache=False")
            change = torch.zeros_like(mask_BT, dtype=torch.long)
            change[:, 1:] = (mask_BT[:, 1:] != mask_BT[:, :-1]).long()
            seg = change.cumsum(1)
    if pos_BT is not None and T > 1 and pos_BT.shape[-1] == T:
        pos_BT = pos_BT.expand(B, T) if pos_BT.shape[0] == 1 else pos_BT
        if bool((pos_BT[:, 1:] == 0).any()):
            if cached:
                raise ValueError("position_ids restarting at 0 (packed sequences) cannot be decoded with a cache")
            starts = torch.zeros((B, T), dtype=torch.long, device=pos_BT.device)
            starts[:, 1:] = (pos_BT[:, 1:] == 0).long()
            seg = starts.cumsum(1) if seg is None else (seg * (T + 1) + starts.cumsum(1))
    return seg


def _plain_model(model: KimiK3ForConditionalGeneration) -> K3ForCausalLM:
    """The `K3ForCausalLM` to save; refuses one that still carries adapter layers (merge or save the adapter)."""
    lm = model.language_model
    for name, mod in lm.named_modules():
        if hasattr(mod, "base_layer"):
            raise ValueError(f"{name}: the model still holds adapter layers ({type(mod).__name__}); save the "
                             f"adapter (peft_model.save_pretrained) or merge it first (merge_and_unload)")
    return lm


def _stack_experts_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                        error_msgs) -> None:
    """`load_state_dict` pre-hook: the release's per-expert tensors (`...experts.{e}.w1.weight`) become the
    model's stacked ones (`...experts.w1` [E, I, C]), and A_log takes the model's shape from the release's
    Kimi-Linear form [1, 1, H, 1]. A Trainer resume reads a checkpoint's raw safetensors this way; without it the
    experts would silently keep their current values."""
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        m = _PER_EXPERT.match(key[len(prefix):])
        if m:
            groups.setdefault(prefix + m.group(1) + m.group(3), {})[int(m.group(2))] = state_dict.pop(key)
    params = dict(module.named_parameters())
    for name, parts in groups.items():
        p = params.get(name[len(prefix):])
        ids = sorted(parts)
        if p is None:  # not this model's: left for load_state_dict to report as unexpected
            state_dict.update({f"{name[:-2]}{e}.{name[-2:]}.weight": parts[e] for e in ids})
        elif ids == list(range(p.shape[0])):  # every expert: load_state_dict copies (and checks) the stack
            state_dict[name] = torch.stack([parts[e] for e in ids])
        else:  # part of a layer's experts (a sharded checkpoint read shard by shard): copied in place
            with torch.no_grad():
                for e in ids:
                    if e >= p.shape[0] or parts[e].shape != p.shape[1:]:
                        error_msgs.append(f"{name}: expert {e} of shape {list(parts[e].shape)} does not fit "
                                          f"{list(p.shape)}")
                    else:
                        p[e].copy_(parts[e])
    for key in [k for k in state_dict if k.endswith("A_log")]:
        local = key[len(prefix):]
        p = params.get(local)
        t = state_dict[key]
        if p is not None and t.shape != p.shape and t.dim() == 4:  # Kimi-Linear form: pad to the model's size
            padded = torch.zeros(p.shape, dtype=t.dtype)
            padded[: t.numel()] = t.reshape(-1)
            state_dict[key] = padded
