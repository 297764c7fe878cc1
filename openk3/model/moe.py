"""Stable LatentMoE (spec §4.6) and, without a latent width, Kimi-Linear's plain MoE.

Legend: B batch, T tokens, N = B*T, D hidden, C expert width (latent or D), I expert hidden,
E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from openk3.common import opaque_op
from openk3.config import K3Config
from openk3.model.layers import GluMLP, RMSNorm, cached_on, make_glu
from openk3.ops import moe as moe_ops
from openk3.ops import moe_cpu, moe_mxfp4_cpu


def _experts_grouped_impl(x_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, w1: torch.Tensor,
                          w3: torch.Tensor, w2: torch.Tensor, hidden_act: str, beta: float,
                          linear_beta: float) -> torch.Tensor:
    return moe_ops.experts_grouped(x_NC, weights_NK, idx_NK, w1, w3, w2, make_glu(hidden_act, beta, linear_beta))


# `experts_grouped` as one opaque operator (`openk3::experts_grouped`, any device): a compiled decode step
# calls it like a kernel instead of splitting its graph at the data-dependent sort and counts inside.
_experts_grouped_op = opaque_op(
    "experts_grouped", "(Tensor x_NC, Tensor weights_NK, Tensor idx_NK, Tensor w1, Tensor w3, Tensor w2, "
    "str hidden_act, float beta, float linear_beta) -> Tensor", _experts_grouped_impl, "CompositeExplicitAutograd")


# Inside a compiled decode step every branch must have static shapes. Few picks: gather the picked
# experts' weights. More: the fused CPU kernel (`ops/moe_cpu.py`) as one opaque call per layer when
# it is available; else, for many picks of small experts, run all experts densely (a step of N tokens costs
# 6 N E C I FLOPs, cheaper than per-expert calls while N C I stays under this bound, measured on
# one CPU core at nano/small shapes). Otherwise the grouped path as one opaque operator.
DENSE_MAX_NCI = 1 << 17
# With the fused kernel available, gathering still wins for tiny picks (nano at batch 1: 4 x 32 x 128),
# not for larger ones (small-kl: 8 x 48 x 256), where the generated gather loops read the weights at
# about half the kernel's speed.
GATHER_MAX_MIC = 1 << 15
# Eager, without autograd: the fused kernel (single-threaded) while tokens x I x C x threads stays under
# this bound; above it the grouped matmuls win (measured with 1 and 2 threads: nano experts up to 128
# tokens either way; small-kl experts up to 128 tokens on one thread, 64 on two; I 96 x C 512 up to 32
# on one thread, none on two).
FUSED_MAX_WORK = 1 << 21
# ... and only for small experts (I x C weights per matrix): per-expert call overhead is what the kernel
# removes; larger experts stream faster through torch's matmuls (and use more than one core), measured
# crossover between 2^16 (I 96 x C 512: kernel 10-60 % faster) and 2^17 (I 128 x C 1024: 5-20 % slower).
FUSED_MAX_EXPERT = 1 << 16
# MXFP4 experts (kept packed or streamed): the kernel reads the packed bytes for each (token, expert) pair, while
# `experts_packed` dequantises each touched expert once and runs torch matmuls, so the kernel wins while an
# expert gets few pairs, whatever its size (both costs scale with I x C). Measured (one core, 2026-12-05, I x C
# from 64 x 64 to K3's 3072 x 3584): the kernel took 0.01-0.05x the time up to 16 pairs per touched expert,
# 0.1-0.25x at 32-64, 0.2-0.5x at 128-256; at K3's width and one token, 47 ms against 7.7 s for 16 experts.
# Pairs per touched expert x threads below this bound: the kernel.
MXFP4_KERNEL_MAX_PAIRS = 256


def compiled_impl(tokens: int, top_k: int, num_experts: int, hidden: int, width: int, fused: bool = False,
                  grad: bool = False) -> str:
    # With a symbolic batch each comparison becomes a guard (a recompile where it flips): with the kernel,
    # the size test comes first, so every batch past it shares the fused graph whatever tokens*k vs E says.
    if grad:
        # A compiled training step: only differentiable forms. The opaque operators (fused_op, grouped_op) have
        # no backward, and autograd would treat them as constants: every expert and router weight would get no
        # gradient, silently (tests/test_compiled_train.py). "grouped" breaks the graph at its host read of the
        # per-expert counts; the pieces around it stay compiled.
        if tokens * top_k <= num_experts:
            return "gather"
        return "dense" if tokens * hidden * width <= DENSE_MAX_NCI else "grouped"
    if fused:
        if tokens * top_k * hidden * width > GATHER_MAX_MIC or tokens * top_k > num_experts:
            return "fused_op"
        return "gather"  # inside the graph, no operator call (the fused kernel's costs ~20-40 us)
    if tokens * top_k <= num_experts:
        return "gather"
    return "dense" if tokens * hidden * width <= DENSE_MAX_NCI else "grouped_op"


def _fused_available() -> bool:
    return moe_cpu.available()


def _mxfp4_available() -> bool:
    return moe_mxfp4_cpu.available()


def _assume_constant(fn):
    """`torch.compiler.assume_constant_result` without its `import torch._dynamo` (~1.5 s of every process's
    start: each CLI command, each server's engine process). The official call only sets this attribute;
    tests/test_moe_mxfp4_cpu.py checks that it still does, and that a model compiled by hand (no openk3
    compile helper in between) still traces the kernels' availability as a constant."""
    fn._dynamo_marked_constant = True
    return fn


_assume_constant(_fused_available)
_assume_constant(_mxfp4_available)


class Router(nn.Module):
    """`gate.weight` [E, D] (used in fp32) and the selection-only `e_score_correction_bias` [E] (fp32).

    The bias is a buffer: it is not trained by gradients but maintained by load balancing.
    """

    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.empty(num_experts, dtype=torch.float32))


class Experts(nn.Module):
    """All routed experts of a layer stacked: w1 (gate) and w3 (up) [E, I, C], w2 (down) [E, C, I].

    The file stores them per expert (`experts.{e}.w1.weight`, ...); stacking lets one grouped
    matmul serve every expert.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def decode_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per expert the gate, up and down weights transposed for `x @ w` ([C, I], [C, I], [I, C]): views of the
        parameters, so no write to them can leave these stale. Cached until the weights get new storage."""
        def build():
            return tuple(list(w.detach().transpose(1, 2).unbind(0)) for w in (self.w1, self.w3, self.w2))

        return cached_on(self, "expert_views", [self.w1, self.w3, self.w2], build)

    def forward(self, z_NC: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, glu, act: tuple,
                impl: str = "auto") -> torch.Tensor:
        """Latent rows z [N, C] through each row's top-k experts (`idx_NK`, gates `w_NK`) -> r [N, C], weighted sum.

        A module call, not a function of `SparseMoE`: PEFT's LoRA on the stacked weights (`target_parameters`) is
        applied only while the wrapped module runs, so reading `w1` from outside it would silently skip the
        adapter. `glu`/`act`: the activation and its recipe (name, beta, linear beta); `impl`: see
        `SparseMoE.forward`.
        """
        # (each weight read once: under a PEFT adapter a read is the parametrised W + delta)
        w1, w3, w2 = self.w1, self.w3, self.w2
        N, top_k = z_NC.shape[0], idx_NK.shape[1]
        if impl == "auto":
            E, I, C = w1.shape
            fused = I * C <= FUSED_MAX_EXPERT and moe_cpu.supports(z_NC, w1, act[0]) and _fused_available()
            if torch.compiler.is_compiling():
                grad = torch.is_grad_enabled() and any(t.requires_grad for t in (z_NC, w_NK, w1, w3, w2))
                impl = compiled_impl(N, top_k, E, I, C, fused=fused, grad=grad)
            elif fused and N * I * C * torch.get_num_threads() <= FUSED_MAX_WORK:
                impl = "fused"
            else:
                impl = "sparse" if N <= 4 else "grouped"
        if impl == "fused" and not torch.compiler.is_compiling():  # (ctypes cannot be traced: the op)
            r_NC = moe_cpu.experts_fused(z_NC, w_NK, idx_NK, w1, w3, w2, *act)
        elif impl in ("fused", "fused_op"):
            r_NC = moe_cpu.experts_fused_op(z_NC, w_NK, idx_NK, w1, w3, w2, *act)
        elif impl == "gather":
            r_NC = moe_ops.experts_gather(z_NC, w_NK, idx_NK, w1, w3, w2, glu)
        elif impl == "dense":
            r_NC = moe_ops.experts_dense(z_NC, w_NK, idx_NK, w1, w3, w2, glu)
        elif impl == "grouped_op":
            r_NC = _experts_grouped_op(z_NC, w_NK, idx_NK, w1, w3, w2, *act)
        elif impl == "sparse":
            # (views cached across steps only of the parameters themselves: a PEFT adapter's W + delta is a new
            # tensor each call, and caching views of it would keep a second copy of the experts alive)
            plain = isinstance(w1, nn.Parameter)
            views = self.decode_views() if plain and not torch.is_grad_enabled() else None
            r_NC = moe_ops.experts_sparse(z_NC, w_NK, idx_NK, w1, w3, w2, glu, views=views)
        else:
            experts = {"grouped": moe_ops.experts_grouped, "loop": moe_ops.experts_loop}[impl]
            r_NC = experts(z_NC, w_NK, idx_NK, w1, w3, w2, glu)
        return r_NC


class SparseMoE(nn.Module):
    def __init__(self, cfg: K3Config, glu) -> None:
        super().__init__()
        D, C = cfg.hidden_size, cfg.expert_in_dim
        self.top_k = cfg.num_experts_per_token
        self.renormalize = cfg.moe_renormalize
        self.scaling = cfg.routed_scaling_factor
        self.glu = glu
        self.act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)  # glu's recipe
        self.record_routing = False  # when True, forward keeps (scores_NE, idx_NK) in `last_routing` (training)
        # Set from outside by expert parallelism (`openk3/parallel/ep.py`): a callable
        # (z_NC, weights_NK, idx_NK, experts, glu) -> r_NC that sends the latent rows to the ranks holding
        # their experts and back. None: every expert is here.
        self.dispatcher = None
        self.gate = Router(D, cfg.num_experts)
        if cfg.use_latent_moe:
            self.routed_expert_down_proj = nn.Linear(D, C, bias=False)
            self.routed_expert_up_proj = nn.Linear(C, D, bias=False)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(C, cfg.rms_norm_eps)
        self.experts = Experts(cfg.num_experts, C, cfg.moe_intermediate_size)
        if cfg.num_shared_experts:
            self.shared_experts = GluMLP(D, cfg.moe_intermediate_size * cfg.num_shared_experts, glu)

    def forward(self, x_BTD: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
        """x: normed MoE input [B, T, D] -> [B, T, D].

        `impl`: "grouped" (one grouped matmul per weight: training, prefill), "fused" (the CPU kernel of
        `ops/moe_cpu.py`: decode, no autograd), "sparse" (only the chosen experts, torch operators: decode
        of a few tokens), "gather" / "dense" (static shapes, for compiled decode), "loop" (reference), or
        "auto" (without autograd on CPU: fused while tokens x I x C x threads <= FUSED_MAX_WORK, for experts
        of at most FUSED_MAX_EXPERT weights per matrix, when the kernel is available;
        else sparse for <= 4 tokens, grouped above; under torch.compile `compiled_impl`).
        """
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        # The router reads the full-width input, not the latent (spec §4.6 step 4).
        w_NK, idx_NK, scores_NE = moe_ops.route(x_ND, self.gate.weight, self.gate.e_score_correction_bias,
                                                top_k=self.top_k, renormalize=self.renormalize, scaling=self.scaling)
        if self.record_routing:
            self.last_routing = (scores_NE.detach(), idx_NK.detach())
        streamed = hasattr(self.experts, "stream_run")  # experts read from disk (openk3/stream/experts.py)
        if streamed:  # start the reads, then the work that does not need them
            self.experts.prefetch(idx_NK)
            shared_ND = self.shared_experts(x_ND) if hasattr(self, "shared_experts") else None
        z_NC = self.routed_expert_down_proj(x_ND) if hasattr(self, "routed_expert_down_proj") else x_ND
        if self.dispatcher is not None:  # expert parallel: the all-to-all moves latent-wide rows (C, not D)
            r_NC = self.dispatcher(z_NC, w_NK, idx_NK, self.experts, self.glu)
        elif streamed or hasattr(self.experts, "w1_packed"):  # MXFP4 kept packed (model/packed_experts.py)
            r_NC = self._packed_experts(z_NC, w_NK, idx_NK, impl)
        else:  # (a module call: PEFT's LoRA on the stacked weights is active only inside it)
            r_NC = self.experts(z_NC, w_NK, idx_NK, self.glu, self.act, impl)
        if hasattr(self, "routed_expert_norm"):
            r_NC = self.routed_expert_norm(r_NC)  # on the weighted aggregate, before the up-projection
        out_ND = self.routed_expert_up_proj(r_NC) if hasattr(self, "routed_expert_up_proj") else r_NC
        if hasattr(self, "shared_experts"):
            out_ND = out_ND + (shared_ND if streamed else self.shared_experts(x_ND))  # full-width input, unweighted
        return out_ND.view(B, T, D)

    def _packed_experts(self, z_NC: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, impl: str) -> torch.Tensor:
        """Routed experts held in MXFP4 (`model.packed_experts.PackedExperts`, or streamed from disk with the same
        arithmetic, `openk3.stream.StreamedExperts`): the MXFP4 CPU kernel (decode, short prompts, every compiled
        step) or, otherwise, `experts_packed` (dequantise each touched expert)."""
        pe = self.experts
        kernel = impl in ("auto", "fused") and moe_mxfp4_cpu.supports(z_NC, self.act[0]) and _mxfp4_available()
        if torch.compiler.is_compiling():
            if hasattr(pe, "stream_run"):
                raise ValueError("streamed experts (experts='stream') cannot run in a compiled step: decode "
                                 "uncompiled (compile=False)")
            if not kernel:  # experts_packed's per-expert loop has data-dependent shapes: no graph
                raise ValueError("a compiled decode step on MXFP4-packed experts needs the MXFP4 CPU kernel "
                                 "(a C compiler, CPU, float32/float64, no autograd); decode uncompiled "
                                 "(compile=False) or load the experts unpacked (keep_packed=False)")
            return moe_mxfp4_cpu.experts_mxfp4_op(z_NC, w_NK, idx_NK, *(getattr(pe, n) for n in moe_mxfp4_cpu.BUFFERS),
                                                  *self.act)
        # pairs per expert: over all experts, at least 1 (a cheap stand-in for per touched expert, which needs a sort)
        pairs = max(1.0, idx_NK.numel() / pe.num_experts) * torch.get_num_threads()
        use_kernel = kernel and (impl == "fused" or pairs <= MXFP4_KERNEL_MAX_PAIRS)
        if hasattr(pe, "stream_run"):  # the same choice, on bytes read from disk
            return pe.stream_run(z_NC, w_NK, idx_NK, self.glu, self.act, use_kernel)
        if use_kernel:
            return moe_mxfp4_cpu.experts_mxfp4(z_NC, w_NK, idx_NK, *(getattr(pe, n) for n in moe_mxfp4_cpu.BUFFERS),
                                               *self.act)
        return pe.run(z_NC, w_NK, idx_NK, self.glu, z_NC.dtype)
