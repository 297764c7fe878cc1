"""The `kimi_k3` configs for transformers: the release's wrapper (`KimiK3Config`) around its text model
(`KimiK3TextConfig`), both validated by openk3's own `K3Config` so that the two libraries read one file the same.

    cfg = AutoConfig.from_pretrained("runs/x")        # after `import openk3.hf`
    cfg.to_k3()                                       # the openk3.config.K3Config it describes
    KimiK3Config.from_k3(k3cfg)                       # and back (the wrapper openk3.save writes)

The text config keeps the release's `model_type = "kimi_linear"` (never registered, so transformers' native
KimiLinear, which lacks K3's features, is never picked for it). Its fields are whatever the file holds: K3Config
names them and checks them (a wrong or missing K3 field raises the same ValueError as `openk3.load`).
`quantization_config` (MXFP4 experts) is kept out of the transformers-side config: transformers would route the
release's experts to its compressed-tensors quantizer, whose ignore list the release leaves incomplete; openk3
dequantises them exactly on load instead (`KimiK3ForConditionalGeneration.from_pretrained`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from transformers import PreTrainedConfig

from openk3.config import K3Config

# Fields transformers' base config declares (and writes): not part of the K3 text model's description.
_HF_BASE = frozenset(f.name for f in dataclasses.fields(PreTrainedConfig)) - {"dtype", "architectures"}


class KimiK3TextConfig(PreTrainedConfig):
    """The `text_config` of a K3 checkpoint (a bare `kimi_linear` dict with K3's fields). Attributes are the file's
    keys (transformers' derived ones, such as `layer_types`, are accepted when they agree; none is added: openk3's
    model makes its own cache and masks)."""

    model_type = "kimi_linear"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __post_init__(self, **kwargs: Any) -> None:
        # kept under another name: transformers' quantizer looks for `quantization_config` on the text config
        self._release_quantization_config = kwargs.pop("quantization_config", None)
        super().__post_init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        quant = d.pop("_release_quantization_config", None)
        if quant is not None:
            d["quantization_config"] = copy.deepcopy(quant)
        return d

    def k3_dict(self) -> dict[str, Any]:
        """The text model's fields as a `kimi_linear` dict (what K3Config.from_dict reads)."""
        d = self.to_diff_dict()
        for k in _HF_BASE:
            d.pop(k, None)
        return d


class KimiK3Config(PreTrainedConfig):
    """The release's top-level `kimi_k3` config: `text_config` (the language model) and the other towers' configs
    (`vision_config`, kept as an opaque dict: openk3 is the text model)."""

    model_type = "kimi_k3"
    sub_configs_defaults = {"text_config": KimiK3TextConfig}
    keys_to_ignore_at_inference = ["past_key_values"]
    text_config: KimiK3TextConfig | dict | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        if self.text_config.to_diff_dict().keys() - {"model_type", "transformers_version"}:
            self.to_k3()  # a ValueError naming the field, now rather than when a model is built

    def to_k3(self) -> K3Config:
        """The `openk3.config.K3Config` this describes (the same object `openk3.checkpoint.read_config` gives)."""
        d = self.to_diff_dict()
        d.pop("transformers_version", None)
        d["text_config"] = self.text_config.k3_dict()
        d.pop("auto_map", None)  # the exported shims' pointer (openk3.hf.export), not the model's
        return K3Config.from_dict(d, source=f"{self.name_or_path or 'config'}")

    @classmethod
    def from_k3(cls, cfg: K3Config) -> "KimiK3Config":
        """The wrapper config for `cfg` (as `openk3.save(wrapper=True)` writes it, bf16 experts, its own dtype)."""
        from openk3.checkpoint.layout import config_files

        config = config_files(cfg, wrapper=True, experts_format="bf16", dtype=_dtype_of(cfg.to_dict()))[0]
        config.pop("transformers_version", None)
        return cls(**config)


def _dtype_of(text: dict[str, Any]):
    """The dtype a text config names (`dtype`, or the older `torch_dtype`); bfloat16 (the release's) otherwise."""
    import torch

    from openk3.common import resolve_dtype

    try:
        return resolve_dtype(text.get("dtype") or text.get("torch_dtype")) or torch.bfloat16
    except ValueError:
        return torch.bfloat16
