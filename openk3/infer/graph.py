"""A decode step as one function of tensors, so it can be compiled (CPU: inductor C++; CUDA: graphs).

Small-batch decode is bound by per-operator overhead: thousands of small kernels per token, each
paying Python and dispatcher costs that dwarf its arithmetic. `DecodeGraph` runs the model's own
forward (the same layers and maths as the eager engine path; tests compare the two) over a cache
made of plain tensors: the KDA states and the MLA buffers (up to their capacity) of rows [0, n) of a
`SlotCache`, with each row's write position and key mask computed from its `lengths` entry on the
device, never from host integers. Nothing in the traced step depends on data, so
`torch.compile(dynamic=True, fullgraph=True)` captures one graph for every batch size >= 2 and every
context length, plus one for a batch of one (about 40-90 s each on one CPU core with the C++ wrapper
that is the CPU default; inductor caches them on disk). Inside the compiled step the MoE takes a
static-shape form (`moe.compiled_impl`: gathered experts, the fused CPU kernel as one opaque
operator, all experts densely, or the grouped path as one opaque operator), and fused-weight caches
step aside (the compiler removes the overhead they exist for). On CPU the model's linear weights are
stored column-major first (`column_major_linears_`: the same values, a faster matmul layout for MKL at
decode's few rows). On CUDA, `mode="reduce-overhead"` adds CUDA graphs (untested here).

Used by `Engine(..., compile=True)` (`openk3 generate/chat --compile`).
"""

from __future__ import annotations

import warnings

import torch

from openk3.model.cache import KDAState, SlotCache
from openk3.model.moe import Router
from openk3.ops import moe_mxfp4_cpu


def _no_duck_shapes(fn):
    """Trace with duck sizing off: when the batch happens to equal the slot count, duck sizing would tie
    the two sizes together and recompile as soon as a request leaves."""
    from torch.fx.experimental import _config as fx_config

    def call(*args):
        with fx_config.patch(use_duck_shape=False):
            return fn(*args)

    return call


def _mark_dynamic(args) -> None:
    """The batch changes as requests come and go, the MLA capacity doubles: one graph for all."""
    for group in args:
        for t in group if isinstance(group, list) else [group]:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    for t in [*args[2], *args[3]]:
        torch._dynamo.maybe_mark_dynamic(t, 1)


# Linear weights read other than through `F.linear`: MLA's kv_b_proj is split per head (`view`) by the
# absorbed attention, which wants its rows contiguous.
ROW_MAJOR_LINEARS = ("kv_b_proj",)


@torch.no_grad()
def column_major_linears_(model: torch.nn.Module) -> int:
    """Store each `nn.Linear` weight of `model` (and each MoE router's, which is one) column-major, in
    place: the same values and shape, in the memory of `weight.t().contiguous()`. Returns how many
    weights moved.

    Why: `F.linear(x, W)` multiplies `x @ W.t()`. With W row-major MKL packs W's transpose into a
    buffer on every call before it multiplies; with W column-major `W.t()` is a plain row-major matrix
    it reads as is. At decode's few rows that copy is a large share of the call: at 16 rows and a
    128 -> 512 weight, ~20 us instead of ~31 (`benchmarks/bench_linear_layout.py`; one core). At one row
    both layouts cost about the same, and so do they in bfloat16 (oneDNN, not MKL: left as they are,
    like every dtype but float32 and float64). Training, saving (`checkpoint.save` writes contiguous
    copies) and loading (`copy_` keeps the layout) are unaffected. Skipped: `ROW_MAJOR_LINEARS`, weights
    with a single output row (the same memory either way) and weights shared with another module (a
    tied embedding is gathered by rows)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    moved = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.Linear, Router)) or name.rsplit(".", 1)[-1] in ROW_MAJOR_LINEARS:
            continue
        w = mod.weight
        if (w.dim() != 2 or w.dtype not in (torch.float32, torch.float64) or w.shape[0] < 2 or seen[id(w)] > 1
                or w.t().is_contiguous()):
            continue
        w.data = w.data.t().contiguous().t()
        moved += 1
    return moved


class _GraphMLA:
    """MLA state of rows [0, n) over a fixed key window: writes each row's new latent at its own
    length and masks the keys past it (the `SlotMLAView` protocol, without host-side lengths)."""

    def __init__(self, ckv_nSC: torch.Tensor, kpe_nSR: torch.Tensor, pos_n: torch.Tensor):
        self.ckv, self.kpe, self.pos = ckv_nSC, kpe_nSR, pos_n

    def positions(self, num_tokens: int) -> torch.Tensor:
        """[n, 1] position of each row's new token (RoPE MLA): its write position."""
        return self.pos[:, None]

    def extend(self, ckv_nTC: torch.Tensor, kpe_nTR: torch.Tensor):
        rows = torch.arange(ckv_nTC.shape[0], device=ckv_nTC.device)
        self.ckv[rows, self.pos] = ckv_nTC[:, 0]
        self.kpe[rows, self.pos] = kpe_nTR[:, 0]
        key_pos_S = torch.arange(self.ckv.shape[1], device=self.ckv.device)
        mask_n1S = (key_pos_S[None, :] <= self.pos[:, None])[:, None]
        return self.ckv, self.kpe, mask_n1S


class _GraphCache:
    """What the model sees as `cache` inside the traced step; lengths advance outside it."""

    def __init__(self, layers: list) -> None:
        self.layers = layers

    def advance(self, num_tokens: int) -> None:
        pass


class DecodeGraph:
    """`graph(ids_n1, slots, n)` -> logits [n, V] of one decode token for slots [0, n), updating the
    slots' states and lengths like `model(ids, cache=slots.view(n))` followed by the view's advance.

    `compile=False` runs the same function eagerly (the twin the tests compare with). The step is
    compiled as one graph (`fullgraph=True`), so a failure to compile (no C++ compiler, an operation
    the compiler cannot trace) happens before anything runs; it is reported once as a warning and
    decoding continues eagerly: generation never stops over a missing optimisation.
    """

    @classmethod
    def of(cls, model, **kwargs) -> DecodeGraph:
        """The model's compiled step, made once and kept on the model: engines over the same model share
        it (and its compilation)."""
        graph = model.__dict__.get("_decode_graph")
        if graph is None:
            graph = model.__dict__["_decode_graph"] = cls(model, **kwargs)
        return graph

    def __init__(self, model, *, compile: bool = True, mode: str | None = None,
                 cpp_wrapper: bool | None = None) -> None:
        self.model = model
        self.compiled = compile
        if compile and any(hasattr(m, "stream_run") or type(m).__name__ in ("Int8Linear", "Int4Linear")
                           for m in model.modules()):
            raise ValueError("a model with streamed experts (experts='stream') or an integer trunk decodes uncompiled: "
                             "use compile=False")
        if compile and any(hasattr(m, "w1_packed") for m in model.modules()):
            if not moe_mxfp4_cpu.available():  # the packed experts' torch path has data-dependent shapes
                raise ValueError("compiled decode of MXFP4-packed experts needs the MXFP4 CPU kernel (a C "
                                 "compiler, OPENK3_NO_KERNELS unset); use compile=False or load with "
                                 "keep_packed=False")
        if compile and next(model.parameters()).device.type == "cpu":
            column_major_linears_(model)
        # Guards on the model's modules and parameters cost ~0.5 ms per call at small shapes; an engine
        # keeps its model, so only the step's own tensor inputs are checked (shape, dtype, strides).
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        # On CPU the graph's wrapper (the code calling its kernels and matmuls, with the dynamic sizes'
        # arithmetic) is generated as C++ instead of Python: ~0.4 ms less per step at batch 1 and ~1 ms
        # at batch 16 (nano-kl, one core). Its compile time was ~30 s more per graph when it came in; measured
        # again on 2026-12-02 (nano cut to 5 layers, cold cache) it is not more: 55.9 s against 61.5 s.
        if cpp_wrapper is None:
            cpp_wrapper = next(model.parameters()).device.type == "cpu"
        self.cpp_wrapper = cpp_wrapper
        if cpp_wrapper:
            options["cpp_wrapper"] = True
        self._fn = (_no_duck_shapes(torch.compile(self._step, dynamic=True, fullgraph=True, mode=mode,
                                                  options=options)) if compile else self._step)
        self._tried = False

    def _step(self, ids_n1: torch.Tensor, convs: list[torch.Tensor], recs: list[torch.Tensor],
              ckvs: list[torch.Tensor], kpes: list[torch.Tensor], pos_n: torch.Tensor) -> torch.Tensor:
        layers, k, m = [], 0, 0
        for layer in self.model.model.layers:
            if layer.is_mla:
                layers.append(_GraphMLA(ckvs[m], kpes[m], pos_n))
                m += 1
            else:
                layers.append(KDAState(convs[k], recs[k]))
                k += 1
        return self.model(ids_n1, cache=_GraphCache(layers), mla_impl="absorbed")[:, -1]

    def __call__(self, ids_n1: torch.Tensor, slots: SlotCache, n: int) -> torch.Tensor:
        assert ids_n1.shape[0] == n
        slots.reserve(slots.max_len(n) + 1)
        # Rows [0, n) of the slot buffers, every key position up to the capacity (masked per row; the
        # capacity doubles, so at most twice the longest row). `detach()` makes each slice an alias
        # rather than a view: the compiler guards on a view's base, and would recompile whenever n
        # reached the slot count.
        args = ([s.conv[:n].detach() for s in slots.kda if s is not None],
                [s.recurrent[:n].detach() for s in slots.kda if s is not None],
                [t[:n].detach() for t in slots.ckv if t is not None],
                [t[:n].detach() for t in slots.kpe if t is not None], slots.lengths[:n].detach())
        if self.compiled:
            _mark_dynamic(args)
            torch._dynamo.maybe_mark_dynamic(ids_n1, 0)
        if self.compiled and not self._tried:
            self._tried = True
            try:  # fullgraph: everything is traced and compiled before any of it runs
                logits = self._fn(ids_n1, *args)
            except Exception as e:  # compile-time failure: nothing ran, decode this step eagerly
                warnings.warn(f"openk3: compiling the decode step failed ({type(e).__name__}: {e}); "
                              "decoding eagerly", RuntimeWarning, stacklevel=2)
                self._fn, self.compiled = self._step, False
                logits = self._fn(ids_n1, *args)
        else:
            logits = self._fn(ids_n1, *args)
        slots.advance(n)
        return logits
