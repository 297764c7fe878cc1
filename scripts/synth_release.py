"""Write a release-shaped Kimi K3 checkpoint with K3's real widths and a few layers, for streaming tests and
benchmarks without the 1.56 TB release.

    python scripts/synth_release.py OUT [--layers 3] [--vocab 8192] [--shard-gb 4] [--seed 0]
    python scripts/synth_release.py OUT --tiny          # nano widths: seconds, for tests

What matches the release (spec §2, §6): the `kimi_k3` wrapper config.json (`text_config` with hidden 7168, 896
experts of width 3072 in a 3584-wide latent, top-16, 96 KDA heads, MXFP4 `quantization_config`), the
`language_model.` tensor names, dtypes (bf16 trunk, fp32 islands, uint8 MXFP4 experts), shards written by the
`safetensors` library itself (so tensors are ordered by dtype, then name, and each expert's six tensors lie back
to back: one read per expert, at the shard's own misalignment), `model.safetensors.index.json`. What does not:
the number of layers (default 3: a dense layer and two MoE layers, 2 x 15.7 GB of experts), the vocabulary
(default 8,192 with a byte-level tokenizer written beside it, so `openk3 generate` runs), and the values:
random (matrices ~N(0, 1/fan_in), norms 1, MXFP4 codes uniform bytes with scale bytes 112..122 as released,
never 255). Every byte is written (no sparse files: a hole would read without I/O and flatter a benchmark).

Peak memory is about twice one shard (`--shard-gb`): the safetensors writer copies each tensor once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from openk3.checkpoint.files import INDEX, shard_name, write_json
from openk3.checkpoint.layout import PREFIX, config_files, layout
from openk3.config import K3Config, preset

SCALE_LO, SCALE_HI = 112, 122  # E8M0 bytes seen in the release's experts


def synth_config(layers: int, vocab: int, tiny: bool) -> K3Config:
    """K3 (or nano, `tiny`) cut to `layers` layers (layer 1 dense as in K3, every 4th MLA) and `vocab` ids."""
    cfg = preset("nano" if tiny else "k3")
    if layers < 2:
        raise ValueError(f"--layers must be at least 2 (a dense layer, then MoE layers), got {layers}")
    la = dataclasses.replace(cfg.linear_attn_config, kda_layers=[i for i in range(1, layers + 1) if i % 4],
                             full_attn_layers=[i for i in range(1, layers + 1) if i % 4 == 0])
    if tiny:
        return dataclasses.replace(cfg, num_hidden_layers=layers, linear_attn_config=la)
    if vocab % 256 or vocab < 1024:
        raise ValueError(f"--vocab must be a multiple of 256 and at least 1024 (K3's 256 special ids end it), "
                         f"got {vocab}")
    return dataclasses.replace(cfg, num_hidden_layers=layers, vocab_size=vocab, linear_attn_config=la,
                               eos_token_id=cfg.eos_token_id - cfg.vocab_size + vocab)


def _tensor(entry, gen: torch.Generator, cfg: K3Config) -> torch.Tensor:
    name, shape = entry.name, entry.shape
    if entry.kind == "packed":
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    if entry.kind == "scale":
        return torch.randint(SCALE_LO, SCALE_HI + 1, shape, dtype=torch.uint8, generator=gen)
    dtype = torch.float32 if entry.kind == "island" else torch.bfloat16
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("A_log"):
        H = cfg.linear_attn_config.num_heads
        t = torch.zeros(shape, dtype=torch.float32).reshape(-1)
        t[:H] = torch.empty(H).uniform_(0, math.log(16), generator=gen)
        return t.reshape(shape)
    if name.endswith("e_score_correction_bias") or leaf == "dt_bias":
        return torch.zeros(shape, dtype=dtype)
    if "norm" in name or len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) / math.sqrt(shape[-1])).to(dtype)  # ~N(0, 1/fan_in)


def _byte_tokenizer(vocab: int):
    """Byte-level ranks: the 256 bytes, then two-byte pairs of printable ASCII, up to `vocab` - 256 ids (the last 256
    are K3's special block)."""
    from openk3.tokenizer import Tokenizer

    ranks = {bytes([b]): b for b in range(256)}
    printable = range(32, 127)
    for a in printable:
        for b in printable:
            if len(ranks) >= vocab - 256:
                break
            ranks[bytes([a, b])] = len(ranks)
    return Tokenizer(ranks)


def write(out: Path, cfg: K3Config, shard_bytes: int, seed: int, *, tokenizer: bool = True, log=print) -> dict:
    """Write the checkpoint into `out` (created; must not exist or be empty). Returns a summary."""
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ValueError(f"{out}: not empty")
    from safetensors.torch import save_file

    entries = layout(cfg, "mxfp4")
    nbytes = [math.prod(e.shape) * (1 if e.kind in ("packed", "scale") else 4 if e.kind == "island" else 2)
              for e in entries]
    shards: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(nbytes):
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    t0 = time.perf_counter()
    for k, shard in enumerate(shards, 1):
        name = shard_name(k, len(shards))
        tensors = {PREFIX + entries[i].name: _tensor(entries[i], gen, cfg) for i in shard}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in tensors})
        del tensors
        log(f"[synth] {name}: {sum(nbytes[i] for i in shard) / 1e9:.2f} GB ({time.perf_counter() - t0:.0f} s)")
    write_json(out / INDEX, {"metadata": {"total_size": sum(nbytes)}, "weight_map": dict(sorted(weight_map.items()))})
    config, gen_cfg = config_files(cfg, wrapper=True, experts_format="mxfp4", dtype=torch.bfloat16)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", gen_cfg)
    if tokenizer:
        _byte_tokenizer(cfg.vocab_size).save(str(out))
    experts = sum(n for e, n in zip(entries, nbytes, strict=True) if e.kind in ("packed", "scale"))
    return {"folder": str(out), "bytes": sum(nbytes), "expert_bytes": experts, "shards": len(shards),
            "layers": cfg.num_hidden_layers,
            "moe_layers": sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=3, help="layers (the first dense, the rest MoE; default 3)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (default 8192; K3's is 163840)")
    p.add_argument("--shard-gb", type=float, default=4.0, help="shard size in GB (default 4; peak memory ~2x)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="nano widths (for tests): a few MB")
    args = p.parse_args(argv)
    try:
        cfg = synth_config(args.layers, args.vocab, args.tiny)
        summary = write(args.out, cfg, int(args.shard_gb * 1e9) if not args.tiny else 200_000, args.seed)
    except ValueError as e:
        print(f"synth_release: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
