"""Checkpoint folders in the release's format (spec §1-§2, §6): `save`, `load`, `read_config`.

A checkpoint is a HF-style folder: `config.json` (top-level `kimi_k3` wrapper with the text model in
`text_config`, or a bare `kimi_linear` config), `generation_config.json`, and `model.safetensors` or
`model-0000i-of-0000N.safetensors` shards plus `model.safetensors.index.json`. Tensor names, shapes
and on-disk dtypes follow spec §2 exactly; docs/file-format.md is the full description.

    openk3.save(model, "runs/x")                          # experts as loaded (else bf16), wrapper iff K3 form
    openk3.save(model, "runs/x-q", experts_format="mxfp4")  # routed experts MXFP4 (compressed-tensors)
    model = openk3.load("runs/x", dtype=torch.float32)      # islands stay fp32; or a run folder (latest)
    cfg = openk3.checkpoint.read_config("runs/x")

Saving is atomic (temp sibling folder, fsync, rename swap); loading builds the model on the meta
device and fills it tensor by tensor from the safetensors files (peak memory ~ the model once), and
rejects anything that does not match the config, and any NaN/inf weight, with a ValueError that names it.
A training run's checkpoints/ folder (its `step_N` checkpoints and `latest`) is `runs.py`; writing one
atomically and reading back the newest intact one (with the trainer's state) is `steps.py`.
"""

from openk3.checkpoint.layout import LoadedFormat, mxfp4_quantization_config
from openk3.checkpoint.load import load, read_config, resolve_checkpoint
from openk3.checkpoint.save import save

__all__ = ["LoadedFormat", "load", "mxfp4_quantization_config", "read_config", "resolve_checkpoint", "save"]
