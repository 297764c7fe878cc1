"""Where each routed expert's bytes are in a release-format checkpoint, and where they go in a cache slot.

An expert is six tensors (`moe_mxfp4_cpu.BUFFERS` order: gate codes, gate scales, up codes, up scales, down
codes, down scales). In the release they sit back to back in one shard (`w1p w1s w2p w2s w3p w3s`, spec §2), so
an expert is one read of 17,547,264 bytes. `ExpertIndex` reads the safetensors headers of the shards (8-byte
length + JSON; no tensor data), finds each expert's tensors' absolute file offsets, merges those that touch into
extents (one read each: one per expert in the release, up to six in a file written in another order) and gives
each extent a region of a cache slot:

    slot  |<-- region of extent 0: d0 pad | extent bytes | round-up -->|<-- region of extent 1 ... -->|
          ^ ALIGN-aligned                                              ^ ALIGN-aligned

A region starts ALIGN-aligned and its extent's bytes land d = (file offset mod ALIGN) into it, so the same
region serves a direct read (O_DIRECT: file offset, length and memory all ALIGN-aligned; the read starts d
bytes before the extent) and a buffered one (exactly the extent's bytes, at region + d). In the release all
experts of a shard share one d (their lengths are multiples of 4 KiB) but shards differ; each expert keeps its
own tensor offsets, so the kernel's address table (`experts_mxfp4_table`) absorbs any d and any order.

Legend: L MoE layers, E experts per layer.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 4096  # O_DIRECT alignment that holds on every Linux filesystem and device we target (logical block <= 4 KiB)
_KERNEL_ORDER = {("w1", "packed"): 0, ("w1", "scale"): 1, ("w3", "packed"): 2, ("w3", "scale"): 3,
                 ("w2", "packed"): 4, ("w2", "scale"): 5}
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header


@dataclass(frozen=True, slots=True)
class Extent:
    """One read: `length` bytes of `file` at `offset`, landing at `region + (offset % ALIGN)` of a slot."""

    file: str
    offset: int  # absolute byte offset in the file
    length: int
    region: int  # slot offset of this extent's ALIGN-aligned region

    @property
    def pad(self) -> int:
        return self.offset % ALIGN

    @property
    def region_bytes(self) -> int:
        return _round_up(self.pad + self.length, ALIGN)


@dataclass(frozen=True, slots=True)
class ExpertLoc:
    """Expert (layer, e): its extents and the slot offsets of its six tensors (kernel order)."""

    extents: tuple[Extent, ...]
    tensor_offsets: tuple[int, int, int, int, int, int]

    @property
    def nbytes(self) -> int:
        return sum(x.length for x in self.extents)

    @property
    def first_offset(self) -> tuple[str, int]:
        return self.extents[0].file, self.extents[0].offset


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def shard_header(path: Path) -> tuple[int, dict]:
    """(data start, {tensor: (dtype, shape, begin, end)}) of a safetensors file, from its header alone; ValueError
    naming the file for a header that is not one, or a tensor whose bytes lie outside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError(f"{path}: not a safetensors file (header length {n} at offset 0 exceeds the file "
                                 f"of {size} bytes)")
            meta = json.loads(fh.read(n))
    except OSError as e:
        raise ValueError(f"{path}: cannot read the safetensors header ({e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the safetensors header (offset 8) is not JSON ({e})") from None
    start = 8 + n
    out = {}
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: the safetensors header (offset 8) is not a JSON object")
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            b, e = (int(v) for v in info["data_offsets"])
            dtype, shape = info["dtype"], info["shape"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name} has no valid dtype/shape/data_offsets in the header") from None
        if not (0 <= b <= e and start + e <= size):
            raise ValueError(f"{path}: tensor {name} points outside the file: bytes {start + b}..{start + e} of a "
                             f"{size}-byte file (a truncated shard?)")
        out[name] = (dtype, shape, start + b, start + e)
    return start, out


class ExpertIndex:
    """Every routed expert of an MXFP4 release-format checkpoint: `loc(layer, e)` -> `ExpertLoc`.

    Built from an `openk3.checkpoint.load.Inventory` (names, shapes and dtypes already checked against the
    config) plus the shards' headers (the offsets). `slot_bytes` is the largest expert's regions, so any expert
    fits any slot.
    """

    def __init__(self, folder: Path, layers: dict[int, dict[int, list]], num_experts: int, dim: int,
                 hidden: int) -> None:
        self.folder = folder
        self.layers = sorted(layers)
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self._locs: dict[int, list[ExpertLoc]] = {}
        slot = 0
        for layer, experts in layers.items():
            row = []
            for e in range(num_experts):
                loc = _place(experts[e])
                row.append(loc)
                slot = max(slot, sum(x.region_bytes for x in loc.extents))
            self._locs[layer] = row
        self.slot_bytes = slot
        # per layer, [E, 6] int64 slot offsets of each expert's tensors (added to a slot's address)
        self.tensor_offsets = {layer: torch.tensor([loc.tensor_offsets for loc in row], dtype=torch.int64)
                               for layer, row in self._locs.items()}

    def loc(self, layer: int, e: int) -> ExpertLoc:
        return self._locs[layer][e]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert as stored (codes and scales)."""
        return self._locs[self.layers[0]][0].nbytes

    def files(self) -> list[str]:
        return sorted({x.file for row in self._locs.values() for loc in row for x in loc.extents})

    def pads(self) -> dict[int, int]:
        """{d: experts}: how many experts start d bytes past an ALIGN boundary (one read each in the release)."""
        out: dict[int, int] = {}
        for row in self._locs.values():
            for loc in row:
                out[loc.extents[0].pad] = out.get(loc.extents[0].pad, 0) + 1
        return dict(sorted(out.items()))

    @classmethod
    def from_inventory(cls, inv) -> ExpertIndex:
        """The index of an inventoried MXFP4 checkpoint (`openk3.checkpoint.load.inventory`)."""
        if inv.experts_format != "mxfp4":
            raise ValueError(f"{inv.folder}: streamed experts need MXFP4 experts (the release's format); this "
                             f"checkpoint stores them as {inv.experts_format} (write an MXFP4 copy with "
                             f"`openk3 convert SRC DST --experts mxfp4`)")
        cfg = inv.cfg
        headers: dict[str, dict] = {}
        layers: dict[int, dict[int, list]] = {}
        for entry in inv.entries:
            if entry.kind not in ("packed", "scale"):
                continue
            name = inv.src[inv.prefix + entry.name]
            file = inv.weight_map[name]
            if file not in headers:
                headers[file] = shard_header(inv.folder / file)[1]
            dtype, shape, b, e = headers[file][name]
            layer = int(entry.param.split(".")[2])
            k = _KERNEL_ORDER[(entry.param.rsplit(".", 1)[1], entry.kind)]
            layers.setdefault(layer, {}).setdefault(entry.expert, [None] * 6)[k] = (file, b, e - b)
        if not layers:
            raise ValueError(f"{inv.folder}: the config has no MoE layers: nothing to stream")
        return cls(inv.folder, layers, cfg.num_experts, cfg.expert_in_dim, cfg.moe_intermediate_size)


def _place(tensors: list) -> ExpertLoc:
    """Merge an expert's six (file, offset, length) into extents (touching tensors of one file) and lay the
    extents' regions out one after another in a slot."""
    assert all(t is not None for t in tensors)
    order = sorted(range(6), key=lambda k: (tensors[k][0], tensors[k][1]))
    groups: list[list[int]] = []
    for k in order:
        f, off, _ = tensors[k]
        if groups:
            pf, poff, plen = tensors[groups[-1][-1]]
            if pf == f and poff + plen == off:
                groups[-1].append(k)
                continue
        groups.append([k])
    extents, offsets, region = [], [0] * 6, 0
    for g in groups:
        f, off, _ = tensors[g[0]]
        last = tensors[g[-1]]
        x = Extent(f, off, last[1] + last[2] - off, region)
        for k in g:
            offsets[k] = region + x.pad + tensors[k][1] - off
        extents.append(x)
        region += x.region_bytes
    return ExpertLoc(tuple(extents), tuple(offsets))
