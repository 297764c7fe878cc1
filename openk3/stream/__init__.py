"""Routed experts streamed from a release-format checkpoint's own shards (`openk3.load(..., experts="stream")`).

Only 16 of K3's 896 experts per layer serve a token, so a model whose experts (1.45 TB in MXFP4) do not fit in
memory can still decode: each MoE layer reads the experts its tokens pick, with one aligned read each, into a
per-layer cache (`cache.ExpertCache`), and computes from the cached bytes with the MXFP4 kernel, bit for bit as
the in-memory packed model (`keep_packed=True`) does.

* `index.py`: where each expert's bytes are (shard headers) and where they go in a slot.
* `io.py`: the reads (O_DIRECT where allowed, a small thread pool), errors naming file and offset.
* `cache.py`: per-layer LRU slots, quotas that follow the hits, counters.
* `experts.py`: `StreamedExperts`, the module `SparseMoE` runs.
"""

from __future__ import annotations

import os
import weakref

from openk3.config_types import parse_bytes
from openk3.stream.cache import ExpertCache
from openk3.stream.experts import StreamedExperts
from openk3.stream.index import ExpertIndex
from openk3.stream.io import ExpertReadError, Reader

__all__ = ["ExpertCache", "ExpertIndex", "ExpertReadError", "Reader", "StreamedExperts", "attach",
           "default_cache_bytes", "parse_bytes", "stats"]


def available_memory() -> int:
    """Bytes the kernel says can be taken without swapping (MemAvailable: free plus reclaimable page cache)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def default_cache_bytes(index: ExpertIndex) -> int:
    """Half the memory available now (after the trunk has loaded), at most every expert, at least one per MoE
    layer."""
    avail = available_memory()
    every = len(index.layers) * index.num_experts * index.slot_bytes
    return max(len(index.layers) * index.slot_bytes, min(avail // 2, every))


def attach(model, index: ExpertIndex, expert_cache: int | str | None = None, *, io_threads: int = 4,
           direct: bool | None = None, max_scale_byte: int = 252) -> ExpertCache:
    """Replace every MoE layer's experts of `model` (of the checkpoint `index` describes) by `StreamedExperts` over
    one new `ExpertCache`, kept as `model.expert_stream`. Returns the cache."""
    size = default_cache_bytes(index) if expert_cache is None else parse_bytes(expert_cache, "expert_cache")
    reader = Reader(index.folder, index.files(), threads=io_threads, direct=direct)
    try:
        cache = ExpertCache(index, reader, size, max_scale_byte=max_scale_byte)
    except BaseException:
        reader.close()
        raise
    for name, mod in model.named_modules():
        if type(mod).__name__ == "SparseMoE":
            layer = int(name.split(".")[2])  # model.layers.{i}.block_sparse_moe
            mod.experts = StreamedExperts(cache, layer, index.num_experts, index.dim, index.hidden)
    model.__dict__["expert_stream"] = cache
    weakref.finalize(model, cache.close)  # shard descriptors and I/O threads go with the model
    return cache


def stats(model) -> dict | None:
    """The expert cache's counters (`ExpertCache.stats`) of a model loaded with experts="stream"; None otherwise."""
    cache = model.__dict__.get("expert_stream")
    return None if cache is None else cache.stats()
