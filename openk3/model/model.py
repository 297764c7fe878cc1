"""The whole Kimi K3 text model: embedding, 93 (or fewer) hybrid layers wired by Block Attention
Residuals, final mix, norm, untied head (spec §3). Parameter names are the checkpoint's names
(without the `language_model.` prefix of the multimodal wrapper), except routed experts which are
stacked per layer (see `moe.Experts`).

Legend: B batch, T tokens, D hidden, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from openk3.common import upcast
from openk3.config import K3Config
from openk3.model.cache import DenseCache
from openk3.model.kda import KimiDeltaAttention
from openk3.model.layers import GluMLP, RMSNorm, linear_weight, make_glu
from openk3.model.mla import GatedMLA
from openk3.model.moe import SparseMoE
from openk3.ops.attnres import attn_res_mix
from openk3.ops.fla_kernels import check_backend

# Tensors the release stores (and the reference computes with) in fp32 whatever the model dtype
# (spec §2, §10.13). `K3ForCausalLM.cast` keeps them fp32.
FP32_NAMES = ("conv1d.weight", "A_log", "dt_bias", "self_attn.o_norm.weight", "e_score_correction_bias")


def _query(norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """An AttnRes site's pseudo-query: gamma * w folds the key norm's gain in (spec §4.3 step 3)."""
    return upcast(norm.weight) * upcast(linear_weight(proj)[0])  # (an adapter around proj included)


class DecoderLayer(nn.Module):
    # How `forward` calls the two sub-layers (`attn`, `ffn`): None calls them directly; set from outside (only by
    # `openk3.parallel.ac`: activation checkpointing) to a callable `wrap(fn, *args)` that must return `fn(*args)`.
    # An attention call given a decode state never goes through it: MLA extends that state in place, so a re-run
    # (a recompute in the backward) would extend it twice.
    sublayer_wrapper = None

    def __init__(self, cfg: K3Config, layer: int) -> None:
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer = layer
        self.is_mla = cfg.is_mla_layer(layer)
        self.is_snapshot = cfg.is_snapshot_layer(layer)
        glu = make_glu(cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.self_attn = GatedMLA(cfg) if self.is_mla else KimiDeltaAttention(cfg)
        if cfg.is_moe_layer(layer):
            self.block_sparse_moe = SparseMoE(cfg, glu)
        else:
            self.mlp = GluMLP(D, cfg.intermediate_size, glu)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        if cfg.use_attn_res:
            self.self_attention_res_norm = RMSNorm(D, eps)
            self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
            self.mlp_res_norm = RMSNorm(D, eps)
            self.mlp_res_proj = nn.Linear(D, 1, bias=False)
        self.eps = eps

    def ffn(self, x_BTD: torch.Tensor, moe_impl: str) -> torch.Tensor:
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(x_BTD, impl=moe_impl)
        return self.mlp(x_BTD)

    def attn(self, x_BTD, seg_BT, state, mla_impl):
        if self.is_mla:
            return self.self_attn(x_BTD, seg_BT=seg_BT, state=state, impl=mla_impl)
        return self.self_attn(x_BTD, seg_BT=seg_BT, state=state)

    def sublayer(self, fn, *args, stateless: bool = True):
        """`fn(*args)`, through `sublayer_wrapper` when one is set and the call is `stateless`."""
        wrap = self.sublayer_wrapper
        return fn(*args) if wrap is None or not stateless else wrap(fn, *args)

    def mix(self, site: str, cands: list[torch.Tensor]) -> torch.Tensor:
        query = _query(getattr(self, f"{site}_res_norm"), getattr(self, f"{site}_res_proj"))
        return attn_res_mix(cands, query, self.eps)

    def forward(self, x_BTD: torch.Tensor, seg_BT: torch.Tensor | None = None, state=None, mla_impl: str = "naive",
                moe_impl: str = "auto", blocks: list[torch.Tensor] | None = None):
        """One layer, whole (a module call, so wrappers such as FSDP2 see it) -> (x', blocks', state').

        Without AttnRes (`blocks` None) x is the residual stream. With Block AttnRes (spec §3, §4.3) x is
        the running sum of sub-layer outputs in the current block (`prefix`) and `blocks` the snapshots of
        the earlier ones; a snapshot layer starts a new block. There is no ordinary residual stream then.
        """
        stateless = state is None
        if blocks is None:
            a_BTD, state = self.sublayer(self.attn, self.input_layernorm(x_BTD), seg_BT, state, mla_impl,
                                         stateless=stateless)
            h_BTD = x_BTD + a_BTD
            return h_BTD + self.sublayer(self.ffn, self.post_attention_layernorm(h_BTD), moe_impl), None, state
        prefix: torch.Tensor | None = x_BTD
        h_BTD = self.mix("self_attention", blocks + [prefix]) if blocks else prefix
        if self.is_snapshot:
            blocks = blocks + [prefix]
            prefix = None
        a_BTD, state = self.sublayer(self.attn, self.input_layernorm(h_BTD), seg_BT, state, mla_impl,
                                     stateless=stateless)
        prefix = a_BTD if prefix is None else prefix + a_BTD
        m_BTD = self.mix("mlp", blocks + [prefix])
        return prefix + self.sublayer(self.ffn, self.post_attention_layernorm(m_BTD), moe_impl), blocks, state


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.config = cfg
        # `_weight`: no init here (init_weights or a checkpoint fills it). nn.Embedding's own N(0, 1) init on the meta
        # device of `build` goes through torch._refs, whose first call imports torch._dynamo: ~2 s of CPU in every
        # process that builds or loads a model (each `openk3 serve` engine process, each CLI command).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.use_attn_res:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, input_ids_BT: torch.Tensor | None, *, seg_BT: torch.Tensor | None = None,
                cache: DenseCache | None = None, mla_impl: str = "naive", moe_impl: str = "auto",
                inputs_embeds_BTD: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] -> final hidden states [B, T, D] (after `model.norm`): `embed`, `run_layers` over
        every layer, `output` (a pipeline stage runs the same pieces over its own layers). `inputs_embeds_BTD`
        instead of ids: the first layer's input given (PEFT prompt tuning, transformers' `inputs_embeds`)."""
        assert (input_ids_BT is None) != (inputs_embeds_BTD is None), "ids or embeddings, one of them"
        x_BTD = self.embed(input_ids_BT) if inputs_embeds_BTD is None else inputs_embeds_BTD
        B = x_BTD.shape[0]
        if cache is not None:
            for i, layer in enumerate(self.layers):
                if cache.layers[i] is None:
                    cache.layers[i] = layer.self_attn.empty_state(B, x_BTD.device, x_BTD.dtype)
        x_BTD, blocks = self.run_layers(0, len(self.layers), x_BTD, [], seg_BT=seg_BT,
                                        states=cache.layers if cache is not None else None,
                                        mla_impl=mla_impl, moe_impl=moe_impl)
        if cache is not None:
            cache.advance(x_BTD.shape[1])
        return self.output(x_BTD, blocks)

    def embed(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> the first layer's input [B, T, D] (start `run_layers` with it and `blocks=[]`)."""
        return self.embed_tokens(input_ids_BT)

    def run_layers(self, start: int, end: int, x_BTD: torch.Tensor, blocks: list[torch.Tensor], *,
                   seg_BT: torch.Tensor | None = None, states: list | None = None, mla_impl: str = "naive",
                   moe_impl: str = "auto") -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Layers [start, end) -> (x', blocks'), to hand to the next range or to `output`.

        With Block AttnRes (spec §3, §4.3) there is no ordinary residual stream: `x_BTD` is the running sum of
        sub-layer outputs in the current block (the prefix) and `blocks` the snapshots of the completed ones.
        Without AttnRes `x_BTD` is the residual stream and `blocks` stays []. `states`: one decode state per
        layer of the whole model (a cache's `layers`), indexed by layer number and updated in place.
        """
        assert 0 <= start <= end <= len(self.layers), (start, end, len(self.layers))
        attn_res = self.config.use_attn_res
        for i in range(start, end):
            state = states[i] if states is not None else None
            x_BTD, new_blocks, state = self.layers[i](x_BTD, seg_BT, state, mla_impl, moe_impl,
                                                      blocks=blocks if attn_res else None)
            blocks = new_blocks if attn_res else blocks
            if states is not None:
                states[i] = state
        return x_BTD, blocks

    def output(self, x_BTD: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The last layer's (x, blocks) -> final hidden states [B, T, D]: the output AttnRes mix over the
        snapshots and the last prefix (with Block AttnRes), then the final norm."""
        if self.config.use_attn_res:
            x_BTD = attn_res_mix(blocks + [x_BTD], _query(self.output_attn_res_norm, self.output_attn_res_proj),
                                 self.config.rms_norm_eps)
        return self.norm(x_BTD)


class K3ForCausalLM(nn.Module):
    """`model` (K3Model) + untied `lm_head`. Build with `K3ForCausalLM.build(cfg)`."""

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = K3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @classmethod
    def build(cls, cfg: K3Config, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              seed: int | None = 0, kda_backend: str | None = None) -> "K3ForCausalLM":
        """Declare on the meta device, allocate on `device`, run `init_weights` (skipped on meta).

        fp32-island tensors (`FP32_NAMES`) stay fp32 whatever `dtype` is (float64 keeps all float64).
        `kda_backend`: see `set_kda_backend`.
        """
        with torch.device("meta"):
            model = cls(cfg).set_kda_backend(kda_backend)
        if str(device) == "meta":
            return model.cast(dtype)
        model._allocate(device)
        gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        model.init_weights(gen)
        return model.cast(dtype)

    def set_kda_backend(self, backend: str | None) -> "K3ForCausalLM":
        """The kernels of every KDA layer (`openk3.ops.fla_kernels`: training, prefill and the decode step's delta
        rule): "auto" (fla on CUDA when it imports), "fla", "chunked", or None to follow OPENK3_KDA_BACKEND at each
        call. Returns self."""
        if backend is not None:
            check_backend(backend, "kda_backend")
        for module in self.modules():
            if isinstance(module, KimiDeltaAttention):
                module.backend = backend
        return self

    def _allocate(self, device: str | torch.device) -> None:
        """Uninitialised storage on `device` for every meta tensor: `nn.Module.to_empty`'s result, without its first
        call's ~0.5 s (meta -> device goes through torch's Python reference ops, set up on first use), which every
        process that builds a model paid. A tensor shared between modules stays shared."""
        made: dict[int, torch.Tensor] = {}

        def fresh(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in made:
                new = torch.empty(t.shape, dtype=t.dtype, device=device)
                made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
            return made[id(t)]

        for mod in self.modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in table.items():
                    if t is not None:
                        assert type(t) in (torch.Tensor, nn.Parameter), f"{name}: {type(t).__name__} on meta"
                        table[name] = fresh(t)

    def cast(self, dtype: torch.dtype) -> "K3ForCausalLM":
        """Cast floating tensors to `dtype`, keeping the fp32 islands in fp32 (or float64)."""
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            if not t.is_floating_point():  # MXFP4 codes and scales (uint8) keep their bytes
                continue
            keep = dtype != torch.float64 and any(name.endswith(s) for s in FP32_NAMES)
            t.data = t.data.to(torch.float32 if keep else dtype)
        return self

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every tensor (for training from scratch); loading a checkpoint overwrites it.

        | tensor | init |
        |---|---|
        | Linear weights, embedding, experts w1/w2/w3 | N(0, 0.02) (`initializer_range`) |
        | router `gate.weight` | Kaiming-uniform(a=sqrt 5) = U(+-1/sqrt D), as the reference module |
        | `e_score_correction_bias` | 0 |
        | all RMSNorm weights, KDA `o_norm` | 1 |
        | AttnRes `*_res_proj` (pseudo-queries) | 0: uniform mixing at init (AttnRes paper) |
        | KDA conv weights | U(+-1/sqrt kernel) (PyTorch Conv1d default) |
        | KDA `dt_bias` | inverse softplus of logU[1e-3, 1e-1] (FLA) |
        | KDA `A_log` | softplus gate: log U[1, 16] per head; bounded gate: 0 (FLA); pads 0 |

        Draws happen in module order from `generator`, so a seed fixes the model exactly.
        """
        std = 0.02

        def normal(t):
            t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32).mul_(std))

        def uniform(t, lo, hi):
            t.copy_(torch.rand(t.shape, generator=generator, dtype=torch.float32).mul_(hi - lo).add_(lo))

        for name, mod in self.named_modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                if name.endswith("_res_proj"):
                    mod.weight.zero_()
                else:
                    normal(mod.weight)
            elif isinstance(mod, RMSNorm):
                mod.weight.fill_(1.0)
            elif type(mod).__name__ == "Router":
                bound = 1 / math.sqrt(mod.weight.shape[1])
                uniform(mod.weight, -bound, bound)
                mod.e_score_correction_bias.zero_()
            elif type(mod).__name__ == "Experts":
                for t in (mod.w1, mod.w3, mod.w2):
                    normal(t)
            elif isinstance(mod, KimiDeltaAttention):
                for conv in (mod.q_conv1d, mod.k_conv1d, mod.v_conv1d):
                    bound = 1 / math.sqrt(conv.weight.shape[-1])
                    uniform(conv.weight, -bound, bound)
                dt = torch.exp(torch.rand(mod.dt_bias.shape, generator=generator)
                               * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
                mod.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
                mod.A_log.zero_()
                if mod.lower_bound is None:
                    heads = torch.rand(mod.num_heads, generator=generator) * 15 + 1
                    mod.A_log[: mod.num_heads] = torch.log(heads)
                mod.o_norm.weight.fill_(1.0)

    def forward(self, input_ids_BT: torch.Tensor | None, *, seg_BT: torch.Tensor | None = None,
                cache: DenseCache | None = None, mla_impl: str | None = None,
                moe_impl: str = "auto", last_only: bool = False,
                inputs_embeds_BTD: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] (or `inputs_embeds_BTD` [B, T, D], the first layer's input) -> logits [B, T, V].

        Args:
            seg_BT: optional document index per token of packed rows (non-decreasing per row): KDA
                state and MLA attention never cross from one document to the next.
            cache: a `DenseCache` to continue from and extend (prefill or decode).
            mla_impl: "naive" or "absorbed"; default absorbed when decoding with a cache.
            moe_impl: "auto" (grouped, or sparse for <= 4 tokens), "grouped", "sparse" or "loop" (reference).
            last_only: logits of the last position only ([B, 1, V]): a prefill needs nothing else.
        """
        if seg_BT is not None and cache is not None:
            raise ValueError("packed documents (seg_BT) cannot be combined with a decode cache")
        if mla_impl is None:
            mla_impl = "absorbed" if cache is not None else "naive"
        h_BTD = self.model(input_ids_BT, seg_BT=seg_BT, cache=cache, mla_impl=mla_impl, moe_impl=moe_impl,
                           inputs_embeds_BTD=inputs_embeds_BTD)
        return self.lm_head(h_BTD[:, -1:] if last_only else h_BTD)

    def new_cache(self) -> DenseCache:
        return DenseCache(num_layers=self.config.num_hidden_layers)
