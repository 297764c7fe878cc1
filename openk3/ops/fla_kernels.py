"""fla's Triton kernels behind openk3's conventions, and the choice of backend for the KDA layer.

Backends (`backend=` on `openk3.ops.kda.kda` and on the KDA layer; default from `OPENK3_KDA_BACKEND`, else auto):

- `"chunked"`: openk3's PyTorch ops (`kda_chunked`, `ShortConv`, the per-head norm): every device, float64 too;
  the reference every fla path is tested against.
- `"fla"`: fla's kernels (`chunk_kda`, `causal_conv1d`, `rms_norm_gated`). On CUDA they compile; on CPU tensors
  they run through Triton's interpreter when `TRITON_INTERPRET=1` is set (tests: `openk3.ops.triton_interpreter`).
  A ValueError says why when they cannot run (no fla, no interpreter, float64).
- `"auto"`: fla on CUDA when fla imports, else chunked (the interpreter is a checking tool, never chosen for you).

fla takes packed documents as one flat sequence with `cu_seqlens`: `Packing` turns openk3's per-row `doc_start`
into those boundaries and maps each row's carried state (KDA state, conv history) to its first document and back
from its last.

Legend: B rows, T tokens, H heads, K = V head dim, P channels, W conv history (kernel - 1), N documents in all.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types

import torch

from openk3.ops.triton_interpreter import interpreting
from openk3.ops.triton_interpreter import patch as patch_interpreter

BACKENDS = ("auto", "fla", "chunked")
ENV = "OPENK3_KDA_BACKEND"


def check_backend(backend: str | None, where: str = "backend") -> str:
    """The backend name, or (None) the one `OPENK3_KDA_BACKEND` names, else "auto"; ValueError otherwise."""
    if backend is None:
        backend, where = os.environ.get(ENV, "").strip() or "auto", ENV
    if backend not in BACKENDS:
        raise ValueError(f"{where}: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


_IMPORT_ERROR: list[str] = []  # why fla could not be imported (for backend="fla"'s error)


@functools.cache
def _import_fla(cpu: bool) -> types.SimpleNamespace | None:
    if cpu:
        patch_interpreter()  # before fla's kernels are decorated (a ValueError names what is missing)
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d
        from fla.modules.norm import l2norm
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as e:  # ImportError, or whatever a broken fla / triton install raises: "auto" falls back
        _IMPORT_ERROR.append(f"{type(e).__name__}: {e}")
        return None
    if cpu:
        import triton.runtime.interpreter as interpreter

        kernel = l2norm.l2norm_fwd_kernel
        while not isinstance(kernel, interpreter.InterpretedFunction) and hasattr(kernel, "fn"):
            kernel = kernel.fn
        if not isinstance(kernel, interpreter.InterpretedFunction):
            raise ValueError("backend='fla' on the CPU: fla was imported before TRITON_INTERPRET=1 was set, so its "
                             "kernels were compiled for a GPU; set the variable before anything imports fla")
    return types.SimpleNamespace(chunk_kda=chunk_kda, fused_recurrent_kda=fused_recurrent_kda,
                                 causal_conv1d=causal_conv1d, rms_norm_gated=rms_norm_gated)


def fla_ops(x: torch.Tensor) -> types.SimpleNamespace | None:
    """fla's kernels for tensors like `x` (None when fla is not importable). Imported lazily, once."""
    return _import_fla(not x.is_cuda)


def use_fla(backend: str | None, x: torch.Tensor) -> bool:
    """Whether a KDA computation on tensors like `x` runs fla's kernels under `backend` (see the module doc)."""
    backend = check_backend(backend)
    if backend == "chunked":
        return False
    if backend == "auto":
        return x.is_cuda and x.dtype != torch.float64 and fla_ops(x) is not None
    if x.dtype == torch.float64:
        raise ValueError("backend='fla': fla's kernels take float32/bfloat16, not float64 (use 'chunked')")
    if not x.is_cuda and not interpreting():
        raise ValueError("backend='fla' on CPU tensors runs fla's Triton kernels through Triton's interpreter: "
                         "set TRITON_INTERPRET=1 before fla is imported (a checking tool, ~1-20 s a call), "
                         "or use backend='chunked'")
    if fla_ops(x) is None:
        why = _IMPORT_ERROR[-1] if _IMPORT_ERROR else "unknown"
        raise ValueError(f"backend='fla': fla is not importable ({why}); pip install 'openk3[gpu]' (fla-core) "
                         "beside a torch with triton")
    return True


@dataclasses.dataclass(frozen=True)
class Packing:
    """Rows [B, T] with document starts, as fla's flat varlen sequences (B = 1, `cu_seqlens`)."""

    cu_seqlens_cpu: torch.Tensor  # [N + 1] int64
    first: torch.Tensor  # [B] index of each row's first document
    last: torch.Tensor  # [B] index of each row's last document
    carried: torch.Tensor  # [B] bool: the row's first document continues the row's carried state

    @classmethod
    def of(cls, doc_start_BT: torch.Tensor | None, B: int, T: int) -> Packing:
        if doc_start_BT is None:
            doc_start_BT = torch.zeros(B, T, dtype=torch.bool)
        opens_BT = doc_start_BT.detach().cpu().clone()
        carried = ~opens_BT[:, 0]  # a row that opens with a document start drops what it carried
        opens_BT[:, 0] = True
        starts = opens_BT.reshape(-1).nonzero().squeeze(-1)
        per_row = opens_BT.sum(-1)
        last = per_row.cumsum(0) - 1
        return cls(torch.cat([starts, torch.tensor([B * T])]), last - per_row + 1, last, carried)

    @property
    def n(self) -> int:
        return self.cu_seqlens_cpu.numel() - 1

    def spread(self, state_B: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """A per-row carried state [B, ...] as per-document initial states [N, ...] (zeros where none)."""
        if state_B is None:
            return None
        keep = self.carried.to(state_B.device).view(-1, *[1] * (state_B.dim() - 1))
        out = state_B.new_zeros(self.n, *state_B.shape[1:], dtype=dtype)
        return out.index_copy(0, self.first.to(state_B.device), torch.where(keep, state_B.to(dtype), 0.0))

    def gather_last(self, state_N: torch.Tensor) -> torch.Tensor:
        """Per-document final states [N, ...] -> each row's last document's [B, ...]."""
        return state_N[self.last.to(state_N.device)]


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def chunk_kda(q, k, v, g, beta, *, scale: float, initial_state=None, doc_start=None, gate: dict | None = None,
              l2norm: bool = False):
    """fla's `chunk_kda` with openk3's calling convention (`openk3.ops.kda.kda`): q, k [B, T, H, K], v [B, T, H, V],
    beta [B, T, H], `initial_state` [B, H, K, V], `doc_start` [B, T]. Returns (o [B, T, H, V] in v's dtype, final
    state [B, H, K, V] float32).

    `g` is the log decay [B, T, H, K], or with `gate` = {"A_log": [H], "dt_bias": [H*K], "lower_bound": float |
    None} the gate's pre-activation z, the decay then computed inside the kernel (K3's bounded form
    lower_bound * sigmoid(exp(A_log) (z + dt_bias)), or Kimi Linear's -exp(A_log) softplus(z + dt_bias)).
    `l2norm`: q and k are L2-normalised inside the kernel (eps 1e-6 on the sum of squares, as `l2_normalize`).
    """
    B, T = q.shape[:2]
    ops = fla_ops(q)
    pack = Packing.of(doc_start, B, T)
    h0 = pack.spread(initial_state, torch.float32)  # fla asserts a float32 initial state
    extra = {}
    if gate is not None:
        lower = gate.get("lower_bound")
        extra = dict(use_gate_in_kernel=True, A_log=gate["A_log"], dt_bias=gate["dt_bias"],
                     safe_gate=lower is not None, lower_bound=lower)
    o, final = ops.chunk_kda(*(_flat(x) for x in (q, k, v, g, beta)), scale=scale, initial_state=h0,
                             output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                             cu_seqlens=pack.cu_seqlens_cpu.to(q.device), cu_seqlens_cpu=pack.cu_seqlens_cpu, **extra)
    return o.reshape(B, T, *o.shape[2:]), pack.gather_last(final)


def recurrent_step_(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, *, scale: float, state_BHKV: torch.Tensor) -> torch.Tensor:
    """One decode token through fla's `fused_recurrent_kda`, as `openk3.ops.kda.kda_step_`: q, k already
    L2-normalised, g the log decay; updates `state_BHKV` (float32 [B, H, K, V]) in place, returns o [B, H, V] in
    v's dtype."""
    ops = fla_ops(q_BHK)
    o, final = ops.fused_recurrent_kda(*(x[:, None] for x in (q_BHK, k_BHK, v_BHV, g_BHK, beta_BH)), scale=scale,
                                       initial_state=state_BHKV.float(), output_final_state=True)
    state_BHKV.copy_(final)
    return o[:, 0].to(v_BHV.dtype)


def short_conv(x_BTP: torch.Tensor, weight_P1J: torch.Tensor, history_BWP: torch.Tensor | None,
               doc_start_BT: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's `causal_conv1d` with SiLU as `openk3.model.kda.ShortConv`: (silu(conv(x)) [B, T, P] in x's dtype, the
    new history [B, W, P]). fla keeps a window of J = W + 1 inputs per document with slot 0 unused (its layout
    [N, P, J]); openk3 keeps the last W inputs [B, W, P]."""
    B, T, P = x_BTP.shape
    ops = fla_ops(x_BTP)
    pack = Packing.of(doc_start_BT, B, T)
    window = None
    if history_BWP is not None:
        window = pack.spread(torch.cat([history_BWP.new_zeros(B, 1, P), history_BWP], 1).transpose(1, 2), x_BTP.dtype)
        window = window.contiguous()
    # (the taps stay float32, as fla's ShortConvolution passes them: the kernel computes in float32)
    y, final = ops.causal_conv1d(_flat(x_BTP), weight_P1J[:, 0, :], initial_state=window,
                                 output_final_state=True, activation="silu",
                                 cu_seqlens=pack.cu_seqlens_cpu.to(x_BTP.device), cu_seqlens_cpu=pack.cu_seqlens_cpu)
    return y.reshape(B, T, P), pack.gather_last(final)[:, :, 1:].transpose(1, 2).to(x_BTP.dtype)


def gated_rms_norm(o_BTHK: torch.Tensor, gate_BTHK: torch.Tensor, weight_K: torch.Tensor, eps: float) -> torch.Tensor:
    """fla's `rms_norm_gated` (FusedRMSNormGated, sigmoid): RMSNorm over K times sigmoid(gate), in o's dtype."""
    B, T, H, K = o_BTHK.shape
    ops = fla_ops(o_BTHK)
    out = ops.rms_norm_gated(o_BTHK.reshape(-1, K), gate_BTHK.reshape(-1, K), weight_K, None,
                             activation="sigmoid", eps=eps)
    return out.reshape(B, T, H, K)
