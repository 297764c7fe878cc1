"""Hardware catalogue for `openk3 plan`: one `Hardware` per device the planner can size a deployment for.

Every number carries a citation in `Hardware.sources` ("<document>, <URL>", plus "(derived: ...)" for any
arithmetic and "(as of <month year>)" for prices). Conventions, so the devices compare like for like:

* FLOP/s are dense peaks (no 2:4 sparsity). Vendors mostly print sparse figures; those are halved.
* Interconnect bandwidth is per device and per direction. Vendors mostly print bidirectional totals: halved.
* memory_bytes is decimal as the vendor states it (80 GB -> 80 * 10**9); a "device" is one GPU, or the
  whole machine for the Apple and CPU entries.
* Prices are USD per device-hour at on-demand list rates (Apple: purchase price amortised over 3 years).

Vendor pages missing from the offline corpus used for checking are cited with where the figure was cross-checked,
or "(not verified in the offline corpus)". Standard library only: no torch, nothing else from openk3.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

KINDS = ("gpu", "apple", "cpu")
FORMATS = ("bf16", "fp8", "fp4")  # widest first
_FALLBACK = {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16"), "bf16": ("bf16",)}
_NUMERIC = ("memory_bytes", "memory_bandwidth", "interconnect_bandwidth", "devices_per_node", "price_per_hour")
_HOURS_3Y = 3 * 8760  # amortisation period for bought hardware


@dataclass(frozen=True)
class Hardware:
    key: str  # CLI name
    name: str  # product name + variant
    kind: str  # "gpu", "apple" or "cpu"
    memory_bytes: int  # one device, decimal bytes as the vendor states it
    memory_bandwidth: float  # peak, bytes/s
    flops: dict  # dense peak FLOP/s by compute format ("bf16" / "fp8" / "fp4"); absent = no native support
    interconnect: str
    interconnect_bandwidth: float  # bytes/s per device per direction (0.0: nothing to talk to)
    devices_per_node: int  # devices sharing the scale-up domain
    price_per_hour: float  # USD per device-hour
    sources: dict  # citation per numeric field: "memory_bytes", ..., "flops.bf16", "flops.fp8", "flops.fp4"
    notes: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.key}: kind {self.kind!r} not in {KINDS}")
        if "bf16" not in self.flops or not set(self.flops) <= set(FORMATS):
            raise ValueError(f"{self.key}: flops keys {sorted(self.flops)} must include bf16 and be among {FORMATS}")
        if self.devices_per_node > 1 and not self.interconnect_bandwidth > 0:  # TP groups must talk
            raise ValueError(f"{self.key}: {self.devices_per_node} devices per node need an interconnect bandwidth")
        wanted = {*_NUMERIC, *(f"flops.{f}" for f in self.flops)}
        if set(self.sources) != wanted:
            raise ValueError(f"{self.key}: sources {sorted(self.sources)} != cited fields {sorted(wanted)}")

    def __hash__(self):  # the dict fields are unhashable; the key identifies a device
        return hash(self.key)

    def flops_for(self, fmt: str) -> tuple[float, str]:
        """Peak dense FLOP/s for computing in `fmt` ("bf16" | "fp8" | "fp4"); a format the device lacks falls
        back to the next wider one that it has (fp4 -> fp8 -> bf16). Returns (flops, format_used)."""
        if fmt not in _FALLBACK:
            raise ValueError(f"unknown compute format {fmt!r}; choices: {', '.join(FORMATS)}")
        used = next(f for f in _FALLBACK[fmt] if f in self.flops)  # bf16 is always present (__post_init__)
        return float(self.flops[used]), used


def _src(title: str, url: str, *, derived: str = "", check: str = "", asof: str = "", unverified: bool = False):
    """One citation: "<title>, <url>" + optional derivation, cross-check, date and verification notes."""
    out = f"{title}, {url}"
    if derived:
        out += f" (derived: {derived})"
    if check:
        out += f" (vendor page not in the offline corpus; checked against {check})"
    if unverified:
        out += " (not verified in the offline corpus)"
    if asof:
        out += f" (as of {asof})"
    return out


# Documents cited more than once.
_H100 = ("NVIDIA H100 Tensor Core GPU, H100 SXM column", "https://www.nvidia.com/en-us/data-center/h100/")
_H200 = ("NVIDIA H200 Tensor Core GPU, H200 SXM column", "https://www.nvidia.com/en-us/data-center/h200/")
_HGX = ("NVIDIA HGX platform, Blackwell specifications table", "https://www.nvidia.com/en-us/data-center/hgx/")
_NVL72 = ("NVIDIA GB200 NVL72 specifications", "https://www.nvidia.com/en-us/data-center/gb200-nvl72/")
_A100 = ("NVIDIA A100 Tensor Core GPU, A100 80GB SXM column", "https://www.nvidia.com/en-us/data-center/a100/")
_MI300X = ("AMD Instinct MI300X accelerator", "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html")
_MI355X = ("AMD Instinct MI355X GPU", "https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html")
_R4090 = ("NVIDIA GeForce RTX 4090", "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/")
_R5090 = ("NVIDIA GeForce RTX 5090", "https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5090/")
_MAC = ("Apple Mac Studio (2025) technical specifications", "https://www.apple.com/mac-studio/specs/")
_R7I = ("Amazon EC2 R7i instances", "https://aws.amazon.com/ec2/instance-types/r7i/")
_PCIE = ("PCI Express, Wikipedia", "https://en.wikipedia.org/wiki/PCI_Express")
_KLOCK_H100 = "Glenn Lockwood, H100, https://glennklockwood.com/garden/processors/h100"
_KLOCK_B200 = "Glenn Lockwood, B200, https://glennklockwood.com/garden/processors/B200"
_KLOCK_B300 = "Glenn Lockwood, B300, https://glennklockwood.com/garden/processors/B300"
_KLOCK_A100 = "Glenn Lockwood, A100, https://glennklockwood.com/garden/processors/A100"
_DGXB200 = ("NVIDIA-DGX-B200 wiki page (quotes the DGX B200 data sheet)",
            "https://brent-newsom-nvidia.github.io/AIPS-Boom/wiki/NVIDIA-DGX-B200")
_SPHERON_MAR = ("Spheron, NVIDIA H200 vs B200 vs GB200 (Spheron on-demand prices)",
                "https://www.spheron.network/blog/nvidia-h200-vs-b200-vs-gb200")
_SPHERON_MAY = ("Spheron, RTX 5090 vs RTX 4090 for AI (Spheron on-demand prices)",
                "https://www.spheron.network/blog/rtx-5090-vs-rtx-4090/")
_CLIFF = ("Cliff Center research note, AMD inference economics", "https://www.cliffcenter.com/research/amd-inference-economics")
_NVLINK4 = "https://www.aiminingco.com/gpu/h200/specs"  # 900 GB/s bidirectional NVLink 4, 8-GPU HGX boards
_MI300X_CHECK = "https://github.com/alpharomercoma/MI300X-vs-H200 (METHODOLOGY.md spec table)"
_BW_SPARSE = "{} bidirectional / 2"


def _nv_hopper(title_url, sparse: str, check: str) -> str:  # Hopper pages print sparse tensor FLOP/s
    return _src(*title_url, derived=f"NVIDIA prints {sparse} TFLOP/s with sparsity; / 2", check=check)


_ENTRIES = [
    Hardware(
        key="h100", name="NVIDIA H100 SXM5 80 GB", kind="gpu",
        memory_bytes=80 * 10**9, memory_bandwidth=3.35e12, flops={"bf16": 989.5e12, "fp8": 1979e12},
        interconnect="NVLink 4 (NVSwitch)", interconnect_bandwidth=450e9, devices_per_node=8, price_per_hour=2.99,
        sources={
            "memory_bytes": _src(*_H100, check="https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html"),
            "memory_bandwidth": _src(*_H100, check="https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html"),
            "flops.bf16": _nv_hopper(_H100, "1,979", _KLOCK_H100 + " (989.4 dense)"),
            "flops.fp8": _nv_hopper(_H100, "3,958", _KLOCK_H100 + " (1978.9 dense)"),
            "interconnect_bandwidth": _src(*_H100, derived=_BW_SPARSE.format("NVLink 900 GB/s"), check=_KLOCK_H100),
            "devices_per_node": _src(*_HGX, derived="HGX H100 board = 8 GPUs", check=_NVLINK4),
            "price_per_hour": _src(*_CLIFF, derived="Lambda on-demand H100 SXM $2.99/GPU-h", asof="May 2026"),
        },
        notes="No fp4 tensor cores: fp4 weights compute through fp8."),
    Hardware(
        key="h200", name="NVIDIA H200 SXM 141 GB", kind="gpu",
        memory_bytes=141 * 10**9, memory_bandwidth=4.8e12, flops={"bf16": 989.5e12, "fp8": 1979e12},
        interconnect="NVLink 4 (NVSwitch)", interconnect_bandwidth=450e9, devices_per_node=8, price_per_hour=4.54,
        sources={
            "memory_bytes": _src(*_H200, check="https://aiwiki.ai/wiki/nvidia_h200/raw"),
            "memory_bandwidth": _src(*_H200, check="https://aiwiki.ai/wiki/nvidia_h200/raw"),
            "flops.bf16": _nv_hopper(_H200, "1,979", "https://lzwjava.github.io/nvidia-h200-gpu-specs-en"),
            "flops.fp8": _nv_hopper(_H200, "3,958", "https://lzwjava.github.io/nvidia-h200-gpu-specs-en"),
            "interconnect_bandwidth": _src(*_H200, derived=_BW_SPARSE.format("NVLink 900 GB/s"), check=_NVLINK4),
            "devices_per_node": _src(*_HGX, derived="HGX H200 board = 8 GPUs", check=_NVLINK4),
            "price_per_hour": _src(*_SPHERON_MAR, derived="H200 SXM $4.54/GPU-h", asof="March 2026"),
        },
        notes="Same GH100 compute as the H100 with more, faster HBM3e. No fp4: fp4 weights compute through fp8."),
    Hardware(
        key="b200", name="NVIDIA B200 (HGX B200) 180 GB", kind="gpu",
        memory_bytes=180 * 10**9, memory_bandwidth=8e12, flops={"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9e15},
        interconnect="NVLink 5 (NVSwitch)", interconnect_bandwidth=900e9, devices_per_node=8, price_per_hour=6.03,
        sources={
            "memory_bytes": _src(*_DGXB200, derived="DGX B200: 1,440 GB HBM3e / 8 GPUs"),
            "memory_bandwidth": _src(*_DGXB200, derived="DGX B200: 64 TB/s HBM3e / 8 GPUs"),
            "flops.bf16": _src(*_HGX, derived="HGX B200 FP16/BF16 36 PFLOPS sparse / 8 GPUs / 2", check=_KLOCK_B200),
            "flops.fp8": _src(*_HGX, derived="HGX B200 FP8 72 PFLOPS sparse / 8 GPUs / 2", check=_KLOCK_B200),
            "flops.fp4": _src(*_DGXB200, derived="FP4 144 PFLOPS sparse / 72 dense per 8 GPUs; 72 / 8"),
            "interconnect_bandwidth": _src(*_HGX, derived=_BW_SPARSE.format("NVLink 5 GPU-to-GPU 1.8 TB/s"),
                                           check="https://docs.vultr.com/inference-cookbook/cuda/getting-started/"
                                                 "hardware-overview"),
            "devices_per_node": _src(*_DGXB200, derived="8 Blackwell GPUs per system"),
            "price_per_hour": _src(*_SPHERON_MAR, derived="B200 SXM $6.03/GPU-h", asof="March 2026"),
        },
        notes="NVIDIA lists 180 GB per GPU; the HBM3e stacks total 192 GB and Vultr's nvidia-smi-based spec shows "
              "179 GB. Planner uses the vendor's 180 GB."),
    Hardware(
        key="b300", name="NVIDIA B300 (HGX B300, Blackwell Ultra) 288 GB", kind="gpu",
        memory_bytes=288 * 10**9, memory_bandwidth=8e12, flops={"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 13.5e15},
        interconnect="NVLink 5 (NVSwitch)", interconnect_bandwidth=900e9, devices_per_node=8, price_per_hour=6.125,
        sources={
            "memory_bytes": _src("NVIDIA DGX B300", "https://www.nvidia.com/en-us/data-center/dgx-b300/",
                                 derived="2.3 TB HBM3e / 8 GPUs = 288 GB",
                                 check=_KLOCK_B300 + " and https://aiwiki.ai/wiki/nvidia_dgx_b300"),
            "memory_bandwidth": _src(*_HGX, check=_KLOCK_B300 + " (8 TB/s)"),
            "flops.bf16": _src(*_HGX, derived="HGX B300 FP16/BF16 36 PFLOPS sparse / 8 GPUs / 2",
                               check="https://verda.com/blog/gb300-nvl72-architecture (B300 2.25 PF dense)"),
            "flops.fp8": _src(*_HGX, derived="HGX B300 FP8 72 PFLOPS sparse / 8 GPUs / 2",
                              check="https://verda.com/blog/gb300-nvl72-architecture (B300 4.5 PF dense)"),
            "flops.fp4": _src(*_HGX, derived="HGX B300 FP4 144 | 108 PFLOPS sparse | dense; 108 / 8",
                              check="third-party copies of the HGX table in the offline corpus; " + _KLOCK_B300
                                    + " has 13.1 PF from an earlier 105 PF board figure"),
            "interconnect_bandwidth": _src(*_HGX, derived=_BW_SPARSE.format("NVLink 5 GPU-to-GPU 1.8 TB/s"),
                                           check="https://fibermall.com/blog/?p=17161"),
            "devices_per_node": _src(*_HGX, derived="HGX B300 = 8 Blackwell Ultra GPUs",
                                     check="https://aiwiki.ai/wiki/nvidia_dgx_b300"),
            "price_per_hour": _src("Ornn, NVIDIA B200 vs B300", "https://www.ornnai.com/research/nvidia-b200-vs-b300-"
                                   "why-use-one-instead-of-the-other", derived="midpoint of the $5.00-7.25/GPU-h "
                                   "neocloud on-demand range", asof="2026; the page gives no month"),
        },
        notes="fp4 is NVFP4. NVIDIA's HGX page prints 2.1 TB per 8 GPUs (288 GB = 268 GiB, so that figure reads as "
              "TiB); DGX B300 prints 2.3 TB. FP64 is cut to ~1.25 TF, irrelevant here."),
    Hardware(
        key="gb200", name="NVIDIA GB200 NVL72 (per Blackwell GPU) 186 GB", kind="gpu",
        memory_bytes=186 * 10**9, memory_bandwidth=8e12, flops={"bf16": 2.5e15, "fp8": 5e15, "fp4": 10e15},
        interconnect="NVLink 5 (72-GPU NVLink Switch domain)", interconnect_bandwidth=900e9, devices_per_node=72,
        price_per_hour=4.54,
        sources={
            "memory_bytes": _src(*_NVL72, derived="13.4 TB HBM3e / 72 GPUs",
                                 check="https://aiwiki.ai/wiki/nvidia_gb200_nvl72/raw and " + _SPHERON_MAR[1]),
            "memory_bandwidth": _src(*_NVL72, derived="576 TB/s / 72 GPUs",
                                     check="https://gpu.blog/gpus/nvidia-gb200-nvl72 (8 TB/s)"),
            "flops.bf16": _src(*_NVL72, derived="FP16/BF16 360 PFLOPS sparse / 72 / 2",
                               check=_KLOCK_B200 + " (GB200 at 1,200 W: BF16 2,500 dense)"),
            "flops.fp8": _src(*_NVL72, derived="FP8 720 PFLOPS sparse / 72 / 2",
                              check="https://aiwiki.ai/wiki/nvidia_gb200_nvl72/raw (720 PF FP8)"),
            "flops.fp4": _src(*_NVL72, derived="FP4 1,440 PFLOPS sparse / 72 / 2",
                              check="https://aiwiki.ai/wiki/nvidia_gb200_nvl72/raw (1.4 EF FP4)"),
            "interconnect_bandwidth": _src(*_NVL72, derived="130 TB/s NVLink / 72 = 1.8 TB/s bidirectional / 2",
                                           check="https://aiwiki.ai/wiki/nvidia_gb200_nvl72/raw"),
            "devices_per_node": _src(*_NVL72, derived="72 Blackwell GPUs in one NVLink domain",
                                     check="https://aiwiki.ai/wiki/nvidia_gb200_nvl72/raw"),
            "price_per_hour": _src(*_SPHERON_MAR, derived="GB200 $9.08/h per Superchip / 2 GPUs", asof="March 2026"),
        },
        notes="Rented by the tray or rack, not per GPU. A $42.00/h 4-GPU listing (~$10.50/GPU-h) appears at "
              "https://gpu.blog/gpus/nvidia-gb200-nvl72; costs scale linearly with this price."),
    Hardware(
        key="mi300x", name="AMD Instinct MI300X 192 GB", kind="gpu",
        memory_bytes=192 * 10**9, memory_bandwidth=5.3e12, flops={"bf16": 1307.4e12, "fp8": 2614.9e12},
        interconnect="Infinity Fabric (7 xGMI links, full mesh)", interconnect_bandwidth=448e9, devices_per_node=8,
        price_per_hour=1.85,
        sources={
            "memory_bytes": _src(*_MI300X, check=_MI300X_CHECK),
            "memory_bandwidth": _src(*_MI300X, check=_MI300X_CHECK),
            "flops.bf16": _src(*_MI300X, derived="AMD prints dense peaks; sparsity is listed separately",
                               check=_MI300X_CHECK),
            "flops.fp8": _src(*_MI300X, derived="dense peak", check=_MI300X_CHECK),
            "interconnect_bandwidth": _src(*_MI300X, derived="7 links x 128 GB/s bidirectional = 896 GB/s; / 2",
                                           check="https://www.wheelersnetwork.com/2024/01/"),
            "devices_per_node": _src("MLCommons Inference v4.1, AMD 8xMI300X system description",
                                     "https://github.com/mlcommons/inference_results_v4.1/blob/main/closed/AMD/"
                                     "systems/8xMI300X_2xEPYC-9374F.json", derived="accelerators_per_node = 8"),
            "price_per_hour": _src(*_CLIFF, derived="Vultr on-demand MI300X $1.85/GPU-h", asof="May 2026"),
        },
        notes="No fp4: fp4 weights compute through fp8. The mesh gives 64 GB/s per direction to any one peer."),
    Hardware(
        key="mi355x", name="AMD Instinct MI355X 288 GB", kind="gpu",
        memory_bytes=288 * 10**9, memory_bandwidth=8e12, flops={"bf16": 2.5e15, "fp8": 5e15, "fp4": 10.05e15},
        interconnect="Infinity Fabric (7 xGMI links, full mesh)", interconnect_bandwidth=537.6e9, devices_per_node=8,
        price_per_hour=2.95,
        sources={
            "memory_bytes": _src(*_MI355X, check="https://www.theregister.com/2025/06/12/amd_mi355x/"),
            "memory_bandwidth": _src(*_MI355X, check="https://www.theregister.com/2025/06/12/amd_mi355x/"),
            "flops.bf16": _src(*_MI355X, derived="dense FP16/BF16 2.5 PF", unverified=True),
            "flops.fp8": _src(*_MI355X, derived="dense FP8 5 PF",
                              check="https://www.world-today-news.com/?p=7253162 (ISSCC 2026: FP8 five petaflops)"),
            "flops.fp4": _src(*_MI355X, derived="MXFP4 20.1 PFLOPS with sparsity / 2",
                              check="https://www.tomshardware.com/pc-components/gpus/amds-instinct-mi355x-accelerator-"
                                    "will-consume-1-400-watts"),
            "interconnect_bandwidth": _src(*_MI355X, derived="7 links x 153.6 GB/s bidirectional; / 2",
                                           check="https://humeconsulting.co/amd-mi355x-strong-node-level-inference-"
                                                 "but-not-yet-rack-scale (~153 GB/s per link)"),
            "devices_per_node": _src("Tom's Hardware, AMD's Instinct MI355X accelerator will consume 1,400 watts",
                                     "https://www.tomshardware.com/pc-components/gpus/amds-instinct-mi355x-"
                                     "accelerator-will-consume-1-400-watts", derived="scale-up world size 8 GPUs"),
            "price_per_hour": _src("TensorWave", "https://tensorwave.com", derived="on-demand MI355X $2.95/GPU-h as "
                                   "reported by a May 2026 price survey in the offline corpus", asof="May 2026"),
        },
        notes="fp4 is OCP MXFP4, not NVFP4."),
    Hardware(
        key="a100", name="NVIDIA A100 SXM4 80 GB", kind="gpu",
        memory_bytes=80 * 10**9, memory_bandwidth=2.039e12, flops={"bf16": 312e12},
        interconnect="NVLink 3 (NVSwitch)", interconnect_bandwidth=300e9, devices_per_node=8, price_per_hour=1.30,
        sources={
            "memory_bytes": _src(*_A100, check=_KLOCK_A100),
            "memory_bandwidth": _src(*_A100, check=_KLOCK_A100 + " and https://www.thundercompute.com/blog/"
                                     "nvidia-a100-specs-full-guide (2,039 GB/s)"),
            "flops.bf16": _src(*_A100, derived="NVIDIA prints 624 TFLOP/s with sparsity; / 2", check=_KLOCK_A100),
            "interconnect_bandwidth": _src(*_A100, derived=_BW_SPARSE.format("NVLink 600 GB/s"), check=_KLOCK_A100),
            "devices_per_node": _src("Lambda, A100 server total cost of ownership", "https://lambdalabs.com/blog/"
                                     "tesla-a100-server-total-cost-of-ownership/", derived="8x A100 SXM4 per HGX node"),
            "price_per_hour": _src("Mercatus, Cloud GPU pricing", "https://www.mercatus-ai.com/blog/cloud-gpu-pricing",
                                   derived="midpoint of the $1.10-1.50 specialty-cloud on-demand range, A100 80GB",
                                   asof="May 2026"),
        },
        notes="No fp8 or fp4 tensor cores: those weights compute through bf16."),
    Hardware(
        key="rtx4090", name="NVIDIA GeForce RTX 4090 24 GB", kind="gpu",
        memory_bytes=24 * 10**9, memory_bandwidth=1.008e12, flops={"bf16": 165.2e12, "fp8": 330.3e12},
        interconnect="PCIe 4.0 x16 (no NVLink)", interconnect_bandwidth=31.5e9, devices_per_node=6,
        price_per_hour=0.53,
        sources={
            "memory_bytes": _src(*_R4090, check="https://waredb.com/processor/nvidia-geforce-rtx-4090"),
            "memory_bandwidth": _src(*_R4090, check="https://waredb.com/processor/nvidia-geforce-rtx-4090"),
            "flops.bf16": _src(*_R4090, derived="FP32-accumulate rate, 330.4 sparse / 2",
                               check="https://waredb.com/processor/nvidia-geforce-rtx-4090 (165.15 dense)"),
            "flops.fp8": _src(*_R4090, derived="FP8 with FP32 accumulate, 660.6 sparse / 2",
                              check="https://waredb.com/processor/nvidia-geforce-rtx-4090 (330.30 dense)"),
            "interconnect_bandwidth": _src(*_PCIE, derived="16 GT/s x 16 lanes x 128/130 / 8 bits = 31.5 GB/s",
                                           unverified=True),
            "devices_per_node": _src("tinygrad docs, tinybox", "https://docs.tinygrad.org/tinybox/",
                                     derived="tinybox green = six RTX 4090 in one box"),
            "price_per_hour": _src(*_SPHERON_MAY, derived="RTX 4090 from $0.53/h", asof="May 2026"),
        },
        notes="GPUs talk over PCIe only. With FP16 accumulation GeForce doubles these rates; planner assumes "
              "bf16/fp8 GEMMs accumulate in FP32. No fp4: fp4 weights compute through fp8."),
    Hardware(
        key="rtx5090", name="NVIDIA GeForce RTX 5090 32 GB", kind="gpu",
        memory_bytes=32 * 10**9, memory_bandwidth=1.792e12, flops={"bf16": 209.6e12, "fp8": 419.2e12, "fp4": 1676e12},
        interconnect="PCIe 5.0 x16 (no NVLink)", interconnect_bandwidth=63.0e9, devices_per_node=4,
        price_per_hour=0.86,
        sources={
            "memory_bytes": _src(*_R5090, check="https://www.spheron.network/blog/nvidia-rtx-5090-specs/"),
            "memory_bandwidth": _src(*_R5090, check="https://www.spheron.network/blog/nvidia-rtx-5090-specs/"),
            "flops.bf16": _src(*_R5090, derived="838.4 sparse FP16 (FP16 accumulate) / 2 / 2 for FP32 accumulate, "
                               "the halving hmc-tech tabulates for the GB202-based RTX PRO 5000 at https://hmc-tech"
                               ".com/gpus/nvidia-geforce-rtx-4090-vs-nvidia-rtx-pro-5000-blackwell; not stated for "
                               "the 5090 itself", check="https://www.spheron.network/blog/nvidia-rtx-5090-specs/"),
            "flops.fp8": _src(*_R5090, derived="1,676.8 sparse / 2 / 2 for FP32 accumulate (as for bf16)",
                              check="https://www.spheron.network/blog/nvidia-rtx-5090-specs/"),
            "flops.fp4": _src(*_R5090, derived="3,352 AI TOPS = FP4 with sparsity; / 2",
                              check="https://pocketmags.com/linux-format-magazine/may-2025/articles/nvidia-geforce-"
                                    "rtx-5090"),
            "interconnect_bandwidth": _src(*_PCIE, derived="32 GT/s x 16 lanes x 128/130 / 8 bits = 63.0 GB/s",
                                           unverified=True),
            "devices_per_node": _src("tiny corp, tinybox", "https://tinygrad.org",
                                     derived="tinybox green v2 = four RTX 5090", unverified=True),
            "price_per_hour": _src(*_SPHERON_MAY, derived="RTX 5090 from $0.86/h", asof="May 2026"),
        },
        notes="GPUs talk over PCIe only. bf16/fp8 are FP32-accumulate rates (half the FP16-accumulate figures)."),
    Hardware(
        key="m3-ultra", name="Apple Mac Studio M3 Ultra (32-core CPU, 80-core GPU) 512 GB", kind="apple",
        memory_bytes=512 * 10**9, memory_bandwidth=819e9, flops={"bf16": 80 * 128 * 2 * 1.398e9},
        interconnect="Thunderbolt 5 (RDMA over Thunderbolt, macOS 26.2)", interconnect_bandwidth=10e9,
        devices_per_node=1, price_per_hour=11699 / _HOURS_3Y,
        sources={
            "memory_bytes": _src(*_MAC, check="https://techpowerup.com/news-tags/Mac%20Studio (512 GB, 819 GB/s)"),
            "memory_bandwidth": _src(*_MAC, check="https://techpowerup.com/news-tags/Mac%20Studio"),
            "flops.bf16": _src("hmc-tech, 60-Core M3 Ultra specs", "https://hmc-tech.com/gpu/apple-60-core-m3-ultra-vs-"
                               "nvidia-geforce-rtx-3060", derived="Apple publishes no FLOP/s; 7,680 ALUs / 60 cores = "
                               "128 ALUs per core at 1,398 MHz, FP16 = FP32 rate; 80 cores x 128 x 2 FLOP/FMA x "
                               "1.398 GHz = 28.6 TFLOP/s"),
            "interconnect_bandwidth": _src("Thunderbolt (interface), Wikipedia",
                                           "https://en.wikipedia.org/wiki/Thunderbolt_(interface)",
                                           derived="Thunderbolt 5 = 80 Gb/s each way = 10 GB/s per direction, one "
                                                   "port", unverified=True),
            "devices_per_node": _src(*_MAC, derived="one machine = one unified-memory device; Macs cluster over "
                                     "Thunderbolt, see https://www.jeffgeerling.com/blog/2025/15-tb-vram-on-mac-"
                                     "studio-rdma-over-thunderbolt-5"),
            "price_per_hour": _src("Jeff Geerling, 1.5 TB of VRAM on Mac Studio - RDMA over Thunderbolt 5",
                                   "https://www.jeffgeerling.com/blog/2025/15-tb-vram-on-mac-studio-rdma-over-"
                                   "thunderbolt-5", derived="$11,699 for 512 GB / 32-core / 8 TB, amortised: "
                                   "price / (3 years * 8760 h); nobody rents these", asof="December 2025"),
        },
        notes="No fp8/fp4 matrix units: quantized weights compute through 16-bit. macOS caps GPU-wired memory below "
              "512 GB unless raised (sysctl). Apple withdrew the 512 GB option from its store in March 2026 "
              "(https://runaihome.com/blog/mac-studio-100b-models-local-ai-2026/)."),
    Hardware(
        key="cpu-ddr5", name="AWS EC2 r7i.48xlarge (2x Xeon 8488C Sapphire Rapids, 96 cores, 1,536 GiB DDR5)",
        kind="cpu", memory_bytes=1536 * 2**30, memory_bandwidth=2 * 8 * 4800e6 * 8,
        flops={"bf16": 96 * 1024 * 3.2e9}, interconnect="Ethernet (ENA, 50 Gbps)", interconnect_bandwidth=6.25e9,
        devices_per_node=1, price_per_hour=12.7008,
        sources={
            "memory_bytes": _src(*_R7I, derived="1,536 GiB = 1536 * 2**30 bytes (AWS states GiB)", unverified=True),
            "memory_bandwidth": _src("Sapphire Rapids, Wikipedia", "https://en.wikipedia.org/wiki/Sapphire_Rapids",
                                     derived="2 sockets x 8 DDR5-4800 channels x 4800 MT/s x 8 bytes = 614.4 GB/s",
                                     unverified=True),
            "flops.bf16": _src("Advanced Matrix Extensions, Wikipedia",
                               "https://en.wikipedia.org/wiki/Advanced_Matrix_Extensions",
                               derived="AMX 1,024 BF16 FLOP/cycle/core x 96 cores (192 vCPU / 2) x 3.2 GHz all-core "
                                       "turbo (" + _R7I[1] + ", not verified) = 314.6 TFLOP/s; checked against an "
                                       "offline mirror of the article"),
            "interconnect_bandwidth": _src(*_R7I, derived="50 Gbps / 8 = 6.25 GB/s per direction; 50 Gb checked "
                                           "against a public EC2 price table in the offline corpus"),
            "devices_per_node": _src(*_R7I, derived="one instance = one device"),
            "price_per_hour": _src("Amazon EC2 On-Demand pricing", "https://aws.amazon.com/ec2/pricing/on-demand/",
                                   derived="r7i.48xlarge Linux, us-east-1, $12.7008/h; checked against a public EC2 "
                                           "price table in the offline corpus", asof="2026; month not recorded"),
        },
        notes="AMX runs below the 3.2 GHz turbo under load, so the bf16 peak is an upper bound. No fp8/fp4: "
              "everything computes through bf16. Two NUMA sockets, 307 GB/s each."),
]

CATALOGUE: dict[str, Hardware] = {h.key: h for h in _ENTRIES}  # keyed by .key, in catalogue order


def get(key: str) -> Hardware:
    """Case-insensitive lookup; an unknown key raises ValueError naming the closest match and the choices."""
    k = key.strip().lower()
    if k in CATALOGUE:
        return CATALOGUE[k]
    close = difflib.get_close_matches(k, CATALOGUE, n=1, cutoff=0.0)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown hardware {key!r}{hint} Choices: {', '.join(CATALOGUE)}")


def _num(x: float, digits: int = 1) -> str:
    s = f"{x:,.{digits}f}"
    return s.rstrip("0").rstrip(".") if "." in s else s


def markdown_table() -> str:
    """The catalogue as a markdown table followed by a numbered list of all sources per device."""
    head = ("| key | name | memory GB | bandwidth TB/s | bf16 TFLOP/s | fp8 TFLOP/s | fp4 TFLOP/s "
            "| interconnect GB/s per direction | devices/node | $/h |")
    lines = [head, "|" + "---|" * 10]
    for h in CATALOGUE.values():
        tf = [_num(h.flops[f] / 1e12) if f in h.flops else "-" for f in FORMATS]
        lines.append(f"| {h.key} | {h.name} | {_num(h.memory_bytes / 1e9)} | {_num(h.memory_bandwidth / 1e12, 3)} | "
                     f"{' | '.join(tf)} | {h.interconnect}: {_num(h.interconnect_bandwidth / 1e9, 2)} | "
                     f"{h.devices_per_node} | {h.price_per_hour:.2f} |")
    lines += ["", "Dense FLOP/s (no sparsity), bandwidth per direction, on-demand USD per device-hour.", "",
              "### Sources"]
    for h in CATALOGUE.values():
        lines += ["", f"**{h.key}** ({h.name})" + (f": {h.notes}" if h.notes else ""), ""]
        lines += [f"{i}. `{field}`: {src}" for i, (field, src) in enumerate(h.sources.items(), 1)]
    return "\n".join(lines) + "\n"
