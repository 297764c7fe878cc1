"""openk3: Kimi K3, open and end to end.

`import openk3` stays light (no torch import): the config API is imported eagerly, the model classes
(and `openk3.LLM`, the generation/chat API) on first use.
"""

from openk3.config import PRESETS, K3Config, LinearAttnConfig, as_kimi_linear, preset

__version__ = "0.1.0"
__all__ = [
    "LLM", "PRESETS", "K3Config", "K3ForCausalLM", "LinearAttnConfig", "as_kimi_linear", "load", "preset", "save",
]


def __getattr__(name: str):
    if name == "K3ForCausalLM":
        from openk3.model.model import K3ForCausalLM

        return K3ForCausalLM
    if name == "LLM":
        from openk3.infer.llm import LLM

        return LLM
    if name in ("load", "save"):
        from openk3 import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'openk3' has no attribute {name!r}")
