"""An independent, deliberately plain float64 forward pass of the Kimi K3 text model, from the spec alone.

Written from `k3-architecture.md` §3-§6 without importing anything from openk3: it reads tensors by
their *file* names (`language_model.model.layers.{i}....`, experts per expert, MXFP4 or bf16) and
computes logits with loops (KDA as the token-by-token delta-rule recurrence, MLA expanded with an
explicit causal mask, the MoE one token and one chosen expert at a time). Everything is float64,
so a float64 run of another implementation must agree to rounding (~1e-13).

The Kimi-Linear predecessor form is covered too (no `attn_res_block_size` = plain residual stream,
no `routed_expert_hidden_size` = full-width experts, no `gate_lower_bound` = softplus decay gate,
no full-rank gate = `g_a_proj`/`g_b_proj`, `hidden_act` "silu" = SwiGLU, no MLA output gate).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
F64 = torch.float64


def read_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, every tensor of every safetensors file in the folder, by file name)."""
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    tensors = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(path, fname), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return config, tensors


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Spec §6: byte i holds element 2i (low nibble) and 2i+1 (high); scale 2^(byte-127) per 32 inputs."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    values = torch.tensor(E2M1, dtype=F64)[codes]
    return values * torch.pow(2.0, scale.to(F64) - 127).repeat_interleave(32, dim=1)


class Weights:
    """Float64 views of the text tensors by file name, `language_model.` prefix handled."""

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        self.t, self.prefix = tensors, prefix

    def has(self, name: str) -> bool:
        return self.prefix + name in self.t

    def __call__(self, name: str) -> torch.Tensor:
        return self.t[self.prefix + name].to(F64)

    def expert(self, name: str) -> torch.Tensor:
        """A routed-expert matrix `...experts.{e}.w{1,2,3}`: bf16 `.weight` or MXFP4 packed + scale."""
        if self.has(name + ".weight"):
            return self(name + ".weight")
        t = self.prefix + name
        return dequant_mxfp4(self.t[t + ".weight_packed"], self.t[t + ".weight_scale"])


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # `W x` with W stored [out, in]
    return x @ w.T


def glu(g: torch.Tensor, u: torch.Tensor, c: dict) -> torch.Tensor:
    """SiTU-GLU (§4.2): sigmoid of the uncapped gate, both branches soft-capped; or SwiGLU."""
    if c["hidden_act"] == "silu":
        return g * torch.sigmoid(g) * u
    b1, b2 = c["activation_situ_beta"], c["activation_situ_linear_beta"]
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


def mlp(x, W, p, c):
    return lin(glu(lin(x, W(p + "gate_proj.weight")), lin(x, W(p + "up_proj.weight")), c), W(p + "down_proj.weight"))


def attn_res_mix(cands: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float):
    """§4.3 Mix: softmax over candidates of <RMS-normalised candidate, gamma*w>, applied to the raw ones."""
    vals = torch.stack(cands)  # [n, T, H]
    keys = rms_norm(vals, None, eps)
    logits = (keys * (norm_w * proj_w[0])).sum(-1)  # [n, T]
    p = torch.softmax(logits, dim=0)
    return (p[..., None] * vals).sum(0)


def kda(x: torch.Tensor, W: Weights, p: str, c: dict) -> torch.Tensor:
    """§4.4 Kimi Delta Attention for one sequence x [T, H] (the normed layer input)."""
    la = c["linear_attn_config"]
    nh, d, K = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    T = x.shape[0]

    def conv_silu(y, w):  # causal depthwise, zero history, tap K-1 = current token
        out = torch.zeros_like(y)
        for t in range(T):
            for j in range(K):
                src = t - (K - 1) + j
                if src >= 0:
                    out[t] += w[:, 0, j] * y[src]
        return out * torch.sigmoid(out)

    q, k, v = (conv_silu(lin(x, W(p + f"{n}_proj.weight")), W(p + f"{n}_conv1d.weight")).reshape(T, nh, d)
               for n in "qkv")
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    z = lin(lin(x, W(p + "f_a_proj.weight")), W(p + "f_b_proj.weight")).reshape(T, nh, d)
    z = z + W(p + "dt_bias").reshape(nh, d)
    a = torch.exp(W(p + "A_log").flatten()[:nh]).reshape(nh, 1)  # per head; K3 pads [128], Kimi-Linear [1,1,nh,1]
    if la.get("gate_lower_bound") is not None:
        g = la["gate_lower_bound"] * torch.sigmoid(a * z)
    else:
        g = -a * torch.nn.functional.softplus(z)
    alpha = torch.exp(g)  # [T, nh, d] per key channel
    beta = torch.sigmoid(lin(x, W(p + "b_proj.weight")))  # [T, nh]
    o = torch.zeros(T, nh, d, dtype=F64)
    for h in range(nh):
        S = torch.zeros(d, d, dtype=F64)  # [key, value]
        for t in range(T):
            S = alpha[t, h][:, None] * S
            u = S.T @ k[t, h]
            S = S + beta[t, h] * torch.outer(k[t, h], v[t, h] - u)
            o[t, h] = S.T @ q[t, h]
    if W.has(p + "g_proj.weight"):
        gate = lin(x, W(p + "g_proj.weight"))
    else:
        gate = lin(lin(x, W(p + "g_a_proj.weight")), W(p + "g_b_proj.weight"))
    o = rms_norm(o, W(p + "o_norm.weight"), c["rms_norm_eps"]) * torch.sigmoid(gate.reshape(T, nh, d))
    return lin(o.reshape(T, nh * d), W(p + "o_proj.weight"))


def mla(x: torch.Tensor, W: Weights, p: str, c: dict, latent_eps: float) -> torch.Tensor:
    """§4.5 gated NoPE MLA, expanded, for one sequence x [T, H]."""
    nh, dn, dr, dv, r = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                         c["kv_lora_rank"])
    T = x.shape[0]
    if W.has(p + "q_a_proj.weight"):
        q = lin(rms_norm(lin(x, W(p + "q_a_proj.weight")), W(p + "q_a_layernorm.weight"), latent_eps),
                W(p + "q_b_proj.weight"))
    else:
        q = lin(x, W(p + "q_proj.weight"))
    q = q.reshape(T, nh, dn + dr)
    ckv = lin(x, W(p + "kv_a_proj_with_mqa.weight"))
    latent, k_pe = ckv[:, :r], ckv[:, r:]  # k_pe: one shared head, not normalised, never rotated
    kv = lin(rms_norm(latent, W(p + "kv_a_layernorm.weight"), latent_eps), W(p + "kv_b_proj.weight"))
    kv = kv.reshape(T, nh, dn + dv)
    k = torch.cat([kv[..., :dn], k_pe[:, None, :].expand(T, nh, dr)], dim=-1)
    v = kv[..., dn:]
    o = torch.zeros(T, nh, dv, dtype=F64)
    for h in range(nh):
        scores = (q[:, h] @ k[:, h].T) * (dn + dr) ** -0.5
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o[:, h] = torch.softmax(scores, dim=-1) @ v[:, h]
    o = o.reshape(T, nh * dv)
    if W.has(p + "g_proj.weight"):
        o = o * torch.sigmoid(lin(x, W(p + "g_proj.weight")))
    return lin(o, W(p + "o_proj.weight"))


def moe(x: torch.Tensor, W: Weights, p: str, c: dict) -> torch.Tensor:
    """§4.6 (Latent) MoE for x [T, H]: sigmoid router, biased selection, unbiased renormalised weights."""
    k = c["num_experts_per_token"]
    scores = torch.sigmoid(lin(x, W(p + "gate.weight")))  # [T, E]
    chosen = torch.topk(scores + W(p + "gate.e_score_correction_bias"), k, dim=-1).indices
    weights = torch.gather(scores, 1, chosen)
    if c.get("moe_renormalize", True) and k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * c.get("routed_scaling_factor", 1.0)
    latent = c.get("routed_expert_hidden_size") is not None
    z = lin(x, W(p + "routed_expert_down_proj.weight")) if latent else x
    r = torch.zeros_like(z)
    for t in range(x.shape[0]):
        for j in range(k):
            e = p + f"experts.{int(chosen[t, j])}."
            y = lin(glu(lin(z[t], W.expert(e + "w1")), lin(z[t], W.expert(e + "w3")), c), W.expert(e + "w2"))
            r[t] += weights[t, j] * y
    if latent:
        if W.has(p + "routed_expert_norm.weight"):
            r = rms_norm(r, W(p + "routed_expert_norm.weight"), c["rms_norm_eps"])
        r = lin(r, W(p + "routed_expert_up_proj.weight"))
    if W.has(p + "shared_experts.gate_proj.weight"):
        r = r + mlp(x, W, p + "shared_experts.", c)
    return r


def text_config_and_prefix(config: dict) -> tuple[dict, str]:
    if "text_config" in config:
        return config["text_config"], "language_model."
    return config, ""


@torch.no_grad()
def forward(config: dict, tensors: dict[str, torch.Tensor], input_ids: torch.Tensor, *,
            mla_latent_eps: float = 1e-6, trace: list | None = None) -> torch.Tensor:
    """Logits [B, T, V] float64 for ids [B, T]. `config` is the file's config.json (wrapper or bare).

    `trace`, if a list, receives per sequence a dict of the per-layer mixed inputs `h`, `m_in` and
    layer outputs (§10.18: compare the AttnRes mixes, not only layer outputs).
    """
    c, prefix = text_config_and_prefix(config)
    W = Weights(tensors, prefix)
    la = c["linear_attn_config"]
    eps, L, bs = c["rms_norm_eps"], c["num_hidden_layers"], c.get("attn_res_block_size")
    out = []
    for ids in input_ids:
        rec = {"h": [], "m_in": [], "out": []}
        x = W("model.embed_tokens.weight")[ids]
        prefix_sum, blocks = x, []
        for i in range(L):
            p = f"model.layers.{i}."
            if bs is None:  # Kimi-Linear: ordinary residual stream
                h = prefix_sum
            else:
                h = attn_res_mix(blocks + [prefix_sum], W(p + "self_attention_res_norm.weight"),
                                 W(p + "self_attention_res_proj.weight"), eps) if blocks else prefix_sum
                if i % bs == 0:
                    blocks.append(prefix_sum)
                    prefix_sum = None
            xn = rms_norm(h, W(p + "input_layernorm.weight"), eps)
            if (i + 1) in la["full_attn_layers"]:
                a = mla(xn, W, p + "self_attn.", c, mla_latent_eps)
            else:
                a = kda(xn, W, p + "self_attn.", c)
            prefix_sum = a if prefix_sum is None else prefix_sum + a
            if bs is None:
                m_in = prefix_sum
            else:
                m_in = attn_res_mix(blocks + [prefix_sum], W(p + "mlp_res_norm.weight"), W(p + "mlp_res_proj.weight"),
                                    eps)
            xn = rms_norm(m_in, W(p + "post_attention_layernorm.weight"), eps)
            if W.has(p + "mlp.gate_proj.weight"):
                f = mlp(xn, W, p + "mlp.", c)
            else:
                f = moe(xn, W, p + "block_sparse_moe.", c)
            prefix_sum = prefix_sum + f
            rec["h"].append(h)
            rec["m_in"].append(m_in)
            rec["out"].append(prefix_sum)
        if bs is not None:
            h = attn_res_mix(blocks + [prefix_sum], W("model.output_attn_res_norm.weight"),
                             W("model.output_attn_res_proj.weight"), eps)
        else:
            h = prefix_sum
        out.append(lin(rms_norm(h, W("model.norm.weight"), eps), W("lm_head.weight")))
        if trace is not None:
            trace.append(rec)
    return torch.stack(out)
