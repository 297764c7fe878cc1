"""openk3: Kimi K3, open and end to end.

`import openk3` stays light (no torch import): the config API is imported eagerly, the model classes
on first use.
"""

from openk3.config import PRESETS, K3Config, LinearAttnConfig, as_kimi_linear, preset

__version__ = "0.1.0"
__all__ = ["PRESETS", "K3Config", "K3ForCausalLM", "LinearAttnConfig", "as_kimi_linear", "preset"]


def __getattr__(name: str):
    if name == "K3ForCausalLM":
        from openk3.model.model import K3ForCausalLM

        return K3ForCausalLM
    raise AttributeError(f"module 'openk3' has no attribute {name!r}")
