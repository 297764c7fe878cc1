"""Kimi Delta Attention layer (spec §4.4): projections, short convs, gates, the delta-rule op, the
per-head gated output norm.

Legend: B batch, T tokens, D hidden, P = H*K projection width, H KDA heads, K = V head dim,
W = kernel - 1 conv history.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from openk3.common import fp32_island, upcast
from openk3.config import K3Config
from openk3.model.cache import KDAState
from openk3.model.layers import packed_weight
from openk3.ops import fla_kernels
from openk3.ops import kda as kda_ops


class ShortConv(nn.Module):
    """Causal depthwise conv, no bias, SiLU after (FLA ShortConvolution). Weight [P, 1, kernel], fp32."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))

    def forward(self, x_BTP: torch.Tensor, history_BWP: torch.Tensor | None,
                seg_BT: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (silu(conv(x)) [B, T, P] in x's dtype, the new history [B, W, P]).

        The taps, sum and SiLU run in fp32 (the weights are fp32 in the release) and the result is
        rounded once to x's dtype, as FLA's ShortConvolution (the reference's kernel) stores it: under
        bf16 the delta rule reads bf16-rounded q, k, v (spec §4.8; checked against transformers in
        tests/test_peer_bf16.py).

        `history_BWP` holds the W inputs before x (zeros at a sequence start). `seg_BT` (document
        index within a packed row) stops a tap from reading across a document boundary; only segment
        0 continues from `history_BWP`.
        """
        B, T, P = x_BTP.shape
        W = self.weight.shape[-1] - 1
        if history_BWP is None:
            history_BWP = x_BTP.new_zeros(B, W, P)
        full_BSP = upcast(torch.cat([history_BWP.to(x_BTP.dtype), x_BTP], dim=1))
        w_PJ = upcast(self.weight[:, 0, :])
        out_BTP = full_BSP[:, W:] * w_PJ[:, W]
        for s in range(1, W + 1):  # tap W - s reads the input s steps back
            tap_BTP = full_BSP[:, W - s:W - s + T] * w_PJ[:, W - s]
            if seg_BT is not None:
                prev_BT = torch.zeros_like(seg_BT)  # segment of the input s steps back; history is segment 0
                prev_BT[:, s:] = seg_BT[:, :-s] if s < T else prev_BT[:, s:]
                tap_BTP = tap_BTP * (prev_BT == seg_BT)[..., None]
            out_BTP = out_BTP + tap_BTP
        return F.silu(out_BTP).to(x_BTP.dtype), full_BSP[:, -W:].to(x_BTP.dtype) if W else full_BSP[:, :0]


def conv_step_(x_BP: torch.Tensor, history_BWP: torch.Tensor, w_JP: torch.Tensor) -> torch.Tensor:
    """One decode token of `ShortConv` (weights `w_JP` = weight[:, 0, :].t()): silu(conv) [B, P] computed in fp32
    and rounded to x's dtype as `ShortConv` does; shifts `history_BWP` in place (no autograd). A compiled step
    gets the taps as one contiguous [J, P] so that it vectorises along P (read through a transposed [P, J] view
    they were strided loads that inductor left scalar); eager decode reads a view of the packed weights."""
    full_BJP = upcast(torch.cat([history_BWP, x_BP[:, None].to(history_BWP.dtype)], dim=1))
    out_BP = (full_BJP * upcast(w_JP)).sum(1)
    if history_BWP.shape[1]:
        history_BWP.copy_(full_BJP[:, 1:])
    return F.silu(out_BP).to(x_BP.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's l2norm; eps on the *sum*, spec §10.11)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class KimiDeltaAttention(nn.Module):
    # Kernels (`openk3.ops.fla_kernels`): "auto" | "fla" | "chunked", None reads OPENK3_KDA_BACKEND. Set per
    # layer by `K3ForCausalLM.set_kda_backend`. With fla: training and prefill as in `_forward_fla`, and the decode
    # step's delta rule through fla's `fused_recurrent_kda` (its projections and conv stay PyTorch's).
    backend: str | None = None

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        la = cfg.linear_attn_config
        D, H, K = cfg.hidden_size, la.num_heads, la.head_dim
        P = H * K
        self.num_heads, self.head_dim = H, K
        self.lower_bound = la.gate_lower_bound
        self.eps = cfg.rms_norm_eps
        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = ShortConv(P, la.short_conv_kernel_size)
        self.k_conv1d = ShortConv(P, la.short_conv_kernel_size)
        self.v_conv1d = ShortConv(P, la.short_conv_kernel_size)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        # Per-head values zero-padded to a multiple of 128, as stored in the release (spec §10.3).
        self.A_log = nn.Parameter(torch.empty(cfg.a_log_size))
        self.dt_bias = nn.Parameter(torch.empty(P))
        if la.use_full_rank_gate:
            self.g_proj = nn.Linear(D, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(K))
        self.o_proj = nn.Linear(P, D, bias=False)

    def empty_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> KDAState:
        """Zero decode state: conv histories in the activation dtype, recurrent S in fp32."""
        P, W = self.num_heads * self.head_dim, self.q_conv1d.weight.shape[-1] - 1
        rec_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        conv = torch.zeros(batch, W, 3 * P, device=device, dtype=dtype)
        return KDAState(conv, torch.zeros(batch, self.num_heads, self.head_dim, self.head_dim, device=device,
                                           dtype=rec_dtype))

    def decay(self, x_BTD: torch.Tensor, f_a_BTK: torch.Tensor | None = None) -> torch.Tensor:
        """Per-channel log decay g [B, T, H, K] in fp32 (spec §4.4 step 4); `f_a_BTK`: f_a_proj(x) if known."""
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        f_a_BTK = self.f_a_proj(x_BTD) if f_a_BTK is None else f_a_BTK
        z_BTHK = upcast(self.f_b_proj(f_a_BTK)).view(B, T, H, K) + upcast(self.dt_bias).view(H, K)
        a_H1 = torch.exp(upcast(self.A_log[:H])).view(H, 1)  # indexed by head, never by channel
        if self.lower_bound is not None:
            # K3: bounded sigmoid form; "lower bound" swaps the activation, it is not a clamp.
            return self.lower_bound * torch.sigmoid(a_H1 * z_BTHK)
        return -a_H1 * F.softplus(z_BTHK)

    def forward(self, x_BTD: torch.Tensor, *, seg_BT: torch.Tensor | None = None,
                state: KDAState | None = None) -> tuple[torch.Tensor, KDAState | None]:
        """x: normed layer input [B, T, D]. Returns (output [B, T, D], new state or None).

        `seg_BT`: document index per token of a packed row (state resets at each new document).
        `state`: decode state to continue from; a new state is returned when it is given.
        """
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        if state is not None and T == 1 and not torch.is_grad_enabled():
            return self._decode_(x_BTD, state), state
        doc_start_BT = None
        if seg_BT is not None:
            doc_start_BT = torch.zeros_like(seg_BT, dtype=torch.bool)
            doc_start_BT[:, 1:] = seg_BT[:, 1:] != seg_BT[:, :-1]
        if fla_kernels.use_fla(self.backend, x_BTD) and not (state is not None and T == 1):
            return self._forward_fla(x_BTD, doc_start_BT, state)
        hist = (state.conv_q, state.conv_k, state.conv_v) if state is not None else (None, None, None)
        q_BTP, hq = self.q_conv1d(self.q_proj(x_BTD), hist[0], seg_BT)
        k_BTP, hk = self.k_conv1d(self.k_proj(x_BTD), hist[1], seg_BT)
        v_BTP, hv = self.v_conv1d(self.v_proj(x_BTD), hist[2], seg_BT)
        # From here to the output gate everything is fp32 (spec §4.8), on the rounded conv outputs.
        q_BTHK = l2_normalize(upcast(q_BTP).view(B, T, H, K))
        k_BTHK = l2_normalize(upcast(k_BTP).view(B, T, H, K))
        v_BTHK = upcast(v_BTP).view(B, T, H, K)
        g_BTHK = self.decay(x_BTD)
        # beta in fp32 as the release's modeling code has it (b_proj(x).float().sigmoid()); transformers and
        # FLA's generic KDA layer take the sigmoid in bf16, i.e. round beta (tests/test_peer_bf16.py).
        beta_BTH = torch.sigmoid(upcast(self.b_proj(x_BTD)))
        s0 = state.recurrent if state is not None else None
        with fp32_island(x_BTD):  # the delta rule and its state are fp32 even under bf16 autocast
            o_BTHK, s1 = self._delta_rule(q_BTHK, k_BTHK, v_BTHK, g_BTHK, beta_BTH, s0, doc_start_BT, T)
        # The kernel's output is stored in v's dtype (FLA's chunk_kda writes o like v: bf16 in a bf16 model or
        # under autocast), then the per-head RMSNorm and the sigmoid output gate run in fp32 (FusedRMSNormGated).
        o_BTHK = upcast(o_BTHK.to(v_BTP.dtype))
        o_BTHK = o_BTHK * torch.rsqrt(o_BTHK.pow(2).mean(-1, keepdim=True) + self.eps) * upcast(self.o_norm.weight)
        o_BTHK = o_BTHK * torch.sigmoid(upcast(self._output_gate(x_BTD)).view(B, T, H, K))
        out_BTD = self.o_proj(o_BTHK.reshape(B, T, H * K).to(x_BTD.dtype))
        new_state = KDAState(torch.cat([hq, hk, hv], dim=-1), s1) if state is not None else None
        return out_BTD, new_state

    def _output_gate(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """The output gate's pre-activation [..., P]: one full-rank `g_proj`, or the low-rank pair."""
        return self.g_proj(x_BTD) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x_BTD))

    def _forward_fla(self, x_BTD: torch.Tensor, doc_start_BT: torch.Tensor | None,
                     state: KDAState | None) -> tuple[torch.Tensor, KDAState | None]:
        """`forward` with fla's kernels, as the release's modeling code runs KDA: fla's causal conv with SiLU,
        `chunk_kda` with the L2 norm of q, k and the decay gate inside the kernel, and `FusedRMSNormGated`. The
        same maths as the PyTorch path (tests/test_fla_backend.py compares outputs and every gradient)."""
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        P = H * K
        hist = state.conv.split(P, -1) if state is not None else (None, None, None)
        q_BTP, hq = fla_kernels.short_conv(self.q_proj(x_BTD), self.q_conv1d.weight, hist[0], doc_start_BT)
        k_BTP, hk = fla_kernels.short_conv(self.k_proj(x_BTD), self.k_conv1d.weight, hist[1], doc_start_BT)
        v_BTP, hv = fla_kernels.short_conv(self.v_proj(x_BTD), self.v_conv1d.weight, hist[2], doc_start_BT)
        beta_BTH = torch.sigmoid(upcast(self.b_proj(x_BTD)))
        out_gate_BTHK = upcast(self._output_gate(x_BTD)).view(B, T, H, K)  # (in the activation dtype, as chunked)
        if self.lower_bound is None or -5.0 <= self.lower_bound < 0:
            # the decay inside the kernel: fla's safe gate takes bounds in [-5, 0) only
            g_BTHK = upcast(self.f_b_proj(self.f_a_proj(x_BTD))).view(B, T, H, K)
            gate = {"A_log": upcast(self.A_log[:H]), "dt_bias": upcast(self.dt_bias), "lower_bound": self.lower_bound}
        else:
            g_BTHK, gate = self.decay(x_BTD), None
        s0 = state.recurrent if state is not None else None
        with fp32_island(x_BTD):
            # q, k, v go in as the conv rounded them (bf16 in a bf16 model), as the release hands them to fla
            o_BTHK, s1 = fla_kernels.chunk_kda(q_BTP.view(B, T, H, K), k_BTP.view(B, T, H, K),
                                               v_BTP.view(B, T, H, K), g_BTHK, beta_BTH, scale=K ** -0.5,
                                               initial_state=s0, doc_start=doc_start_BT, gate=gate, l2norm=True)
            o_BTHK = fla_kernels.gated_rms_norm(upcast(o_BTHK.to(v_BTP.dtype)), out_gate_BTHK,
                                                upcast(self.o_norm.weight), self.eps)
        out_BTD = self.o_proj(o_BTHK.reshape(B, T, P).to(x_BTD.dtype))
        new_state = None
        if state is not None:
            new_state = KDAState(torch.cat([hq, hk, hv], dim=-1), s1.to(state.recurrent.dtype))
        return out_BTD, new_state

    def _decode_(self, x_B1D: torch.Tensor, state: KDAState) -> torch.Tensor:
        """One token per row, updating `state` in place (the engine's decode path; no autograd).

        Same maths as `forward` with T == 1 (tests compare them); written as few, batched ops because
        decode at small batch is bound by per-op overhead, not FLOPs.
        """
        B = x_B1D.shape[0]
        H, K = self.num_heads, self.head_dim
        P = H * K
        x_BD = x_B1D[:, 0]
        full_rank = hasattr(self, "g_proj")
        projs = [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj,
                 self.g_proj if full_rank else self.g_a_proj]
        # (an integer trunk's linears, openk3.quant.trunk, have no float weight to pack: one call each)
        w = packed_weight(self, "in_proj", [m.weight for m in projs]) if all(
            type(m) is nn.Linear for m in projs) else None
        if w is not None:
            y_BN = F.linear(x_BD, w)
            ys, qkv_B3P = y_BN.split([m.weight.shape[0] for m in projs], -1), y_BN[:, :3 * P]
        else:
            ys = [m(x_BD) for m in projs]
            qkv_B3P = torch.cat(ys[:3], -1)
        convs = [c.weight for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]  # [P, 1, J] each
        w_conv = packed_weight(self, "conv", convs)
        if w_conv is None:  # (compiled: one contiguous [J, 3P], see conv_step_)
            w_conv = torch.cat([w[:, 0, :].t() for w in convs], 1)
        else:
            w_conv = w_conv[:, 0, :].t()  # [J, 3P], a view of the packed [3P, 1, J]
        act_dtype = qkv_B3P.dtype  # conv and delta-rule outputs are rounded to it, as in `forward`
        qkv_B3P = upcast(conv_step_(qkv_B3P, state.conv, w_conv))
        qk_B2HK = l2_normalize(qkv_B3P[:, :2 * P].reshape(B, 2 * H, K))
        q_BHK, k_BHK = qk_B2HK[:, :H], qk_B2HK[:, H:]
        v_BHV = qkv_B3P[:, 2 * P:].reshape(B, H, K)
        g_BHK = self.decay(x_B1D, ys[3][:, None])[:, 0]
        beta_BH = torch.sigmoid(upcast(ys[4]))
        gate = ys[5] if full_rank else self.g_b_proj(ys[5])
        with fp32_island(x_B1D):
            if fla_kernels.use_fla(self.backend, x_B1D) and not torch.compiler.is_compiling():
                o_BHV = fla_kernels.recurrent_step_(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, scale=K ** -0.5,
                                                    state_BHKV=state.recurrent)
            else:
                o_BHV = kda_ops.kda_step_(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, scale=K ** -0.5,
                                          state=state.recurrent)
        o_BHV = upcast(o_BHV.to(act_dtype))
        o_BHV = o_BHV * torch.rsqrt(o_BHV.pow(2).mean(-1, keepdim=True) + self.eps) * upcast(self.o_norm.weight)
        o_BHV = o_BHV * torch.sigmoid(upcast(gate).view(B, H, K))
        return self.o_proj(o_BHV.reshape(B, 1, H * K).to(x_B1D.dtype))

    def _delta_rule(self, q_BTHK, k_BTHK, v_BTHK, g_BTHK, beta_BTH, s0, doc_start_BT, T):
        """Decode step (one token, with a state) or the chunked form (prefill / training)."""
        scale = self.head_dim ** -0.5
        if s0 is not None and T == 1:
            o_BHK, s1 = kda_ops.kda_step(q_BTHK[:, 0], k_BTHK[:, 0], v_BTHK[:, 0], g_BTHK[:, 0], beta_BTH[:, 0],
                                         scale=scale, state=s0)
            o_BTHK = o_BHK[:, None]
        else:
            # (this is the PyTorch path: `forward` took fla's when the backend asked for it)
            o_BTHK, s1 = kda_ops.kda(q_BTHK, k_BTHK, v_BTHK, g_BTHK, beta_BTH, scale=scale, initial_state=s0,
                                     doc_start=doc_start_BT, backend="chunked")
        return o_BTHK, s1
