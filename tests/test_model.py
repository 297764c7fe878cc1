"""Whole-model invariants on the `nano` preset (KDA + MLA + AttnRes snapshots + dense + Latent MoE).

Exactness checks run in float64. Several tests use `_perturbed`, a model whose AttnRes pseudo-queries,
norm gains, router bias and A_log are random: at init the pseudo-queries are zero (uniform mixing),
which would hide any mistake in the order or set of AttnRes candidates.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, perturb

from openk3.config import as_kimi_linear, nano
from openk3.model.kda import KimiDeltaAttention
from openk3.model.layers import RMSNorm
from openk3.model.model import FP32_NAMES, K3ForCausalLM

EXACT = 1e-10  # float64 relative RMS error allowed for "the same computation, reorganised"


@pytest.fixture(scope="module")
def model64():
    model = perturb(K3ForCausalLM.build(nano(), dtype=torch.float64, seed=0))
    cfg = model.config
    # the preset covers every structural feature these tests rely on
    assert cfg.mla_layers == [3, 7, 8] and cfg.attn_res_block_size == 3
    assert hasattr(model.model.layers[0], "mlp") and hasattr(model.model.layers[1], "block_sparse_moe")
    return model


def _ids(B, T, seed=0, vocab=512):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- cache: chunked prefill + decode == one full forward ----------------------------------------

@pytest.mark.parametrize("mla_impl", ["naive", "absorbed"])
def test_prefill_chunks_and_decode_equal_full_forward(model64, mla_impl):
    # 13 + 9 + 70 prefill tokens (the last chunk continues a state across KDA's 64-token chunks), 5 decoded
    n = 13 + 9 + 70 + 5
    ids = _ids(2, n, seed=1)
    with torch.no_grad():
        full = model64(ids)
        cache = model64.new_cache()
        parts = [model64(ids[:, lo:hi], cache=cache, mla_impl=mla_impl) for lo, hi in ((0, 13), (13, 22), (22, 92))]
        for t in range(92, n):
            parts.append(model64(ids[:, t:t + 1], cache=cache, mla_impl=mla_impl))
    assert cache.seq_len == n
    got = torch.cat(parts, dim=1)
    for t in range(n):  # every position, so an error confined to decode cannot hide in the average
        assert_close(f"{mla_impl} position {t}", full[:, t], got[:, t], EXACT)


def test_packed_documents_equal_separate_runs(model64):
    """KDA state, short-conv taps and MLA attention must never cross a document boundary."""
    docs = [(7, 12, 5, 56), (61, 19)]  # row 1's boundary falls inside KDA's second 64-token chunk
    T = 80
    ids = _ids(2, T, seed=2)
    seg = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in docs])
    with torch.no_grad():
        packed = model64(ids, seg_BT=seg)
        for b, row in enumerate(docs):
            start = 0
            for n in row:
                alone = model64(ids[b:b + 1, start:start + n])
                assert_close(f"row {b} doc [{start}, {start + n})", alone[0], packed[b, start:start + n], EXACT)
                start += n
    with pytest.raises(ValueError, match="seg_BT"):
        model64(ids, seg_BT=seg, cache=model64.new_cache())


def test_impls_agree_on_full_forward(model64):
    ids = _ids(2, 19, seed=3)
    with torch.no_grad():
        ref = model64(ids, mla_impl="naive", moe_impl="loop")
        assert_close("moe grouped vs loop", ref, model64(ids, mla_impl="naive", moe_impl="grouped"), 1e-12)
        assert_close("mla absorbed vs naive", ref, model64(ids, mla_impl="absorbed", moe_impl="loop"), 1e-12)


# ---- gradients ---------------------------------------------------------------------------------

def test_gradients_reach_every_parameter(model64):
    ids = _ids(2, 11, seed=4)
    logits = model64(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    names, params = zip(*model64.named_parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    # the only unused tensors: layer 0's attention-site Mix, skipped because no snapshot exists yet
    # (spec §4.3); the checkpoint stores them anyway
    expected = {"model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}
    missing = {n for n, g in zip(names, grads) if g is None}
    assert missing == expected, f"no gradient for {sorted(missing - expected)}"
    names, grads = zip(*((n, g) for n, g in zip(names, grads) if g is not None))
    nonfinite = [n for n, g in zip(names, grads) if not torch.isfinite(g).all()]
    assert not nonfinite, nonfinite
    zero = [n for n, g in zip(names, grads) if not g.any()]
    assert not zero, f"identically zero gradient for {zero}"
    heads = model64.config.linear_attn_config.num_heads
    for n, g in zip(names, grads):
        if n.endswith("A_log"):
            assert not g[heads:].any(), "A_log pads are not used, so they get no gradient"
    assert all(not b.requires_grad for b in model64.buffers()), "the router bias is balanced, not trained"


# ---- build, init and dtypes --------------------------------------------------------------------

def test_init_is_deterministic_and_complete():
    cfg = nano()
    a = K3ForCausalLM.build(cfg, seed=0).state_dict()
    b = K3ForCausalLM.build(cfg, seed=0).state_dict()
    c = K3ForCausalLM.build(cfg, seed=1).state_dict()
    assert a.keys() == b.keys() == c.keys()
    # conftest poisons torch.empty with NaN: any tensor init_weights forgot would show up here
    unset = [k for k, v in a.items() if not torch.isfinite(v).all()]
    assert not unset, f"not initialised: {unset}"
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed, same model"
    differ = [k for k in a if not torch.equal(a[k], c[k])]
    assert "model.embed_tokens.weight" in differ and "lm_head.weight" in differ
    assert any(".experts.w1" in k for k in differ)
    heads = cfg.linear_attn_config.num_heads
    for k, v in a.items():
        if k.endswith("_res_proj.weight"):
            assert not v.any(), f"{k}: AttnRes pseudo-queries start at zero"
        if k.endswith("A_log"):
            assert v.shape == (128,) and not v[heads:].any(), f"{k}: pads must be exactly 0"
        if k.endswith("e_score_correction_bias"):
            assert not v.any()
        if k.endswith("norm.weight"):
            assert torch.equal(v, torch.ones_like(v)), k
    # softplus form: A_log = log U[1, 16] per head, pads still 0
    kl = K3ForCausalLM.build(as_kimi_linear(cfg), seed=0).state_dict()
    a_log = kl["model.layers.0.self_attn.A_log"]
    assert (a_log[:heads] >= 0).all() and (a_log[:heads] <= math.log(16)).all() and a_log[:heads].any()
    assert not a_log[heads:].any()


def test_meta_build_has_no_storage():
    m = K3ForCausalLM.build(nano(), device="meta")
    assert all(p.device.type == "meta" for p in m.parameters())


def test_bf16_build_keeps_fp32_islands_and_runs():
    cfg = nano()
    model = K3ForCausalLM.build(cfg, dtype=torch.bfloat16, seed=0)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    islands = {n for n in tensors if any(n.endswith(s) for s in FP32_NAMES)}
    kda0 = "model.layers.0.self_attn."
    for n in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "A_log", "dt_bias", "o_norm.weight"):
        assert kda0 + n in islands
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in islands
    for n, t in tensors.items():
        want = torch.float32 if n in islands else torch.bfloat16
        assert t.dtype == want, f"{n}: {t.dtype}, expected {want}"
    ids = _ids(2, 13, seed=5)
    with torch.no_grad():
        got = model(ids)
        ref = K3ForCausalLM.build(cfg, dtype=torch.float64, seed=0)(ids)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert_close("bf16 vs float64 logits", ref, got, 5e-2)


# ---- AttnRes bookkeeping, re-derived from the spec ---------------------------------------------

def _spec_mix(cands, norm_w, proj_w, eps):
    """Spec §4.3 Mix, steps 1-5, one candidate at a time."""
    vs = [c.double() for c in cands]
    q = norm_w.double() * proj_w.double()
    logits = []
    for v in vs:
        key = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        logits.append((key * q).sum(-1))
    p = torch.softmax(torch.stack(logits), dim=0)
    return sum(p[i][..., None] * vs[i] for i in range(len(vs)))


def test_attn_res_bookkeeping_matches_spec(model64):
    """Spec §3 steps 1-5 written out with plain loops; also compares the mixed inputs h and m_in at every
    layer (spec §10.18: layer outputs alone see AttnRes only at snapshot layers)."""
    cfg, m = model64.config, model64.model
    eps, b = cfg.rms_norm_eps, cfg.attn_res_block_size
    ids = _ids(2, 9, seed=6)
    seen: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(m.layers):
        for site, norm in (("h", layer.input_layernorm), ("m_in", layer.post_attention_layernorm)):
            hooks.append(norm.register_forward_pre_hook(
                lambda mod, args, key=(i, site): seen.__setitem__(key, args[0].detach())))
    try:
        with torch.no_grad():
            got = model64(ids)
    finally:
        for h in hooks:
            h.remove()

    with torch.no_grad():
        prefix = m.embed_tokens(ids)
        blocks = []
        for l, layer in enumerate(m.layers):
            if blocks:
                assert len(blocks) == math.ceil(l / b)
                h = _spec_mix(blocks + [prefix], layer.self_attention_res_norm.weight,
                              layer.self_attention_res_proj.weight[0], eps)
            else:
                h = prefix
            reset = l % b == 0
            if reset:
                blocks.append(prefix)
                prefix = None
            a = layer.self_attn(layer.input_layernorm(h))[0]
            prefix = a if reset else prefix + a
            assert len(blocks) == l // b + 1
            m_in = _spec_mix(blocks + [prefix], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight[0], eps)
            x = layer.post_attention_layernorm(m_in)
            f = layer.block_sparse_moe(x) if cfg.is_moe_layer(l) else layer.mlp(x)
            prefix = prefix + f
            tag = "snapshot " if reset else ""
            assert_close(f"{tag}layer {l} h", h, seen[(l, "h")], EXACT)
            assert_close(f"{tag}layer {l} m_in", m_in, seen[(l, "m_in")], EXACT)
        assert len(blocks) + 1 == 4, "nano's final Mix has 4 candidates"
        final = _spec_mix(blocks + [prefix], m.output_attn_res_norm.weight, m.output_attn_res_proj.weight[0], eps)
        ref = model64.lm_head(m.norm(final))
    assert_close("logits", ref, got, EXACT)


def test_zero_pseudo_queries_mix_uniformly():
    from openk3.ops.attnres import attn_res_mix

    g = torch.Generator().manual_seed(0)
    cands = [torch.randn(3, 8, generator=g, dtype=torch.float64) * (i + 1) for i in range(4)]
    assert_close("uniform", sum(cands) / 4, attn_res_mix(cands, torch.zeros(8, dtype=torch.float64), 1e-5), 1e-14)


# ---- Kimi-Linear form and decode state ---------------------------------------------------------

def test_kimi_linear_form_runs_and_state_is_constant():
    cfg = as_kimi_linear(nano())
    model = K3ForCausalLM.build(cfg, dtype=torch.float64, seed=0)
    assert not [n for n, _ in model.named_parameters() if "_res_" in n], "no AttnRes parameters"
    assert not hasattr(model.model.layers[1].block_sparse_moe, "routed_expert_down_proj")
    ids = _ids(1, 21, seed=7)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        sizes, parts = [], []
        for lo, hi in ((0, 6), (6, 16)) + tuple((t, t + 1) for t in range(16, 21)):
            parts.append(model(ids[:, lo:hi], cache=cache))
            sizes.append(cache.nbytes())
    assert torch.isfinite(full).all()
    assert_close("kimi-linear decode", full, torch.cat(parts, 1), EXACT)
    assert len({s["kda_state"] for s in sizes}) == 1, "KDA state does not grow with the context"
    per_token = len(cfg.mla_layers) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 8
    assert [s["mla_cache"] for s in sizes] == [per_token * n for n in (6, 16, 17, 18, 19, 20, 21)]


# ---- the KDA decay gate ------------------------------------------------------------------------

def test_kda_decay_gate_per_head(model64):
    kda = model64.model.layers[0].self_attn
    assert isinstance(kda, KimiDeltaAttention) and kda.lower_bound == -5.0
    H, K = kda.num_heads, kda.head_dim
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 7, model64.config.hidden_size, generator=g, dtype=torch.float64)
    with torch.no_grad():
        kda.A_log[H:] = 3.0  # garbage in the pads must not matter: A_log is indexed by head
        try:
            z = x @ kda.f_a_proj.weight.T @ kda.f_b_proj.weight.T
            bounded = torch.empty(2, 7, H, K, dtype=torch.float64)
            soft = torch.empty(2, 7, H, K, dtype=torch.float64)
            for h in range(H):
                a = math.exp(kda.A_log[h].item())
                for d in range(K):
                    c = h * K + d
                    zc = z[..., c] + kda.dt_bias[c]
                    bounded[..., h, d] = -5.0 * torch.sigmoid(a * zc)
                    soft[..., h, d] = -a * F.softplus(zc)
            got = kda.decay(x)
            assert_close("bounded sigmoid gate", bounded, got, 1e-14)
            assert ((got > -5) & (got < 0)).all()
            # the same weights in a layer built without gate_lower_bound use the softplus form
            kl = KimiDeltaAttention(nano().replace(**{"linear_attn_config.gate_lower_bound": None}))
            kl.double().load_state_dict(kda.state_dict())
            assert kl.lower_bound is None
            assert_close("softplus gate", soft, kl.decay(x), 1e-14)
        finally:
            kda.A_log[H:] = 0.0


# ---- each layer against the spec's formulas (independent re-derivations) -----------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _situ(g, u, b1=4.0, b2=25.0):
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


def _x(model, B, T, seed):
    return torch.randn(B, T, model.config.hidden_size, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def test_kda_layer_matches_spec(model64):
    """Spec §4.4 steps 1-7 with the token-by-token recurrence."""
    attn = model64.model.layers[1].self_attn
    H, K = attn.num_heads, attn.head_dim
    B, T = 2, 11
    x = _x(model64, B, T, seed=9)

    def conv(w_P1J, y_BTP):  # y_t[c] = silu(sum_j W[c, 0, j] * x_{t-J+1+j}[c]), zero history
        J = w_P1J.shape[-1]
        pad = torch.cat([y_BTP.new_zeros(B, J - 1, y_BTP.shape[-1]), y_BTP], dim=1)
        return F.silu(sum(w_P1J[:, 0, j] * pad[:, j:j + T] for j in range(J)))

    with torch.no_grad():
        q = conv(attn.q_conv1d.weight, x @ attn.q_proj.weight.T).view(B, T, H, K)
        k = conv(attn.k_conv1d.weight, x @ attn.k_proj.weight.T).view(B, T, H, K)
        v = conv(attn.v_conv1d.weight, x @ attn.v_proj.weight.T).view(B, T, H, K)
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(K)
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        z = (x @ attn.f_a_proj.weight.T @ attn.f_b_proj.weight.T + attn.dt_bias).view(B, T, H, K)
        g = -5.0 * torch.sigmoid(attn.A_log[:H].exp()[:, None] * z)
        beta = torch.sigmoid(x @ attn.b_proj.weight.T)
        S = torch.zeros(B, H, K, K, dtype=torch.float64)
        o = torch.zeros(B, T, H, K, dtype=torch.float64)
        for t in range(T):
            S = S * g[:, t].exp()[..., None]
            u = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
            S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - u))[:, :, None, :]
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        o = _rms(o, attn.o_norm.weight, 1e-5) * torch.sigmoid(x @ attn.g_proj.weight.T).view(B, T, H, K)
        ref = o.reshape(B, T, H * K) @ attn.o_proj.weight.T
        got, state = attn(x)
    assert state is None
    assert_close("KDA layer", ref, got, EXACT)


def test_mla_layer_matches_spec(model64):
    """Spec §4.5: NoPE, shared un-rotated k_pe, scale (Dn+Dr)^-1/2, sigmoid output gate, no output norm."""
    cfg = model64.config
    attn = model64.model.layers[3].self_attn
    H, Dn, Dr, Dv, Cl = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, \
        cfg.kv_lora_rank
    B, T = 2, 10
    x = _x(model64, B, T, seed=10)
    eps = cfg.mla_latent_norm_eps
    assert attn.q_a_layernorm.eps == attn.kv_a_layernorm.eps == eps
    with torch.no_grad():
        q = (_rms(x @ attn.q_a_proj.weight.T, attn.q_a_layernorm.weight, eps) @ attn.q_b_proj.weight.T)
        q = q.view(B, T, H, Dn + Dr)
        c = x @ attn.kv_a_proj_with_mqa.weight.T
        latent, k_pe = c[..., :Cl], c[..., Cl:]
        kv = (_rms(latent, attn.kv_a_layernorm.weight, eps) @ attn.kv_b_proj.weight.T).view(B, T, H, Dn + Dv)
        keys = torch.cat([kv[..., :Dn], k_pe[:, :, None, :].expand(B, T, H, Dr)], dim=-1)
        vals = kv[..., Dn:]
        s = torch.einsum("bthd,bshd->bhts", q, keys) / math.sqrt(Dn + Dr)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("bhts,bshv->bthv", torch.softmax(s, -1), vals).reshape(B, T, H * Dv)
        ref = (o * torch.sigmoid(x @ attn.g_proj.weight.T)) @ attn.o_proj.weight.T
        got, _ = attn(x)
    assert_close("MLA layer", ref, got, EXACT)


def test_moe_and_dense_layers_match_spec(model64):
    """Spec §4.6: fp32 sigmoid router, bias for selection only, renormalised weights, experts in the latent,
    RMSNorm on the aggregate, up-projection, unweighted shared experts on the full-width input; §4.2 dense."""
    cfg = model64.config
    moe = model64.model.layers[2].block_sparse_moe
    N = 9
    x = _x(model64, 1, N, seed=11)
    with torch.no_grad():
        ref = torch.zeros(N, cfg.hidden_size, dtype=torch.float64)
        for n in range(N):
            xn = x[0, n]
            s = torch.sigmoid(moe.gate.weight @ xn)
            chosen = torch.topk(s + moe.gate.e_score_correction_bias, cfg.num_experts_per_token).indices
            w = s[chosen] / s[chosen].sum()
            z = moe.routed_expert_down_proj.weight @ xn
            r = sum(w[j] * (moe.experts.w2[e] @ _situ(moe.experts.w1[e] @ z, moe.experts.w3[e] @ z))
                    for j, e in enumerate(chosen.tolist()))
            r = _rms(r, moe.routed_expert_norm.weight, cfg.rms_norm_eps)
            sh = moe.shared_experts
            shared = sh.down_proj.weight @ _situ(sh.gate_proj.weight @ xn, sh.up_proj.weight @ xn)
            ref[n] = moe.routed_expert_up_proj.weight @ r + shared
        assert_close("latent MoE", ref[None], moe(x), EXACT)
        mlp = model64.model.layers[0].mlp
        dense = _situ(x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T) @ mlp.down_proj.weight.T
        assert_close("dense SiTU MLP", dense, mlp(x), EXACT)


def test_rmsnorm_casts_back_before_the_weight():
    """Spec §4.1: normalise in fp32, cast to bf16, then multiply by the bf16 weight."""
    g = torch.Generator().manual_seed(12)
    norm = RMSNorm(64, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(64, generator=g))
    x = (3 * torch.randn(5, 64, generator=g)).to(torch.bfloat16)
    x32 = x.float()
    expect = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = norm(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expect)


def test_bf16_autocast_keeps_fp32_islands_and_trains():
    """Under bf16 autocast the spec's fp32 islands (router, AttnRes mix, KDA delta rule) stay fp32:
    their results equal the no-autocast ones for fp32 inputs, and a training step runs."""
    from openk3.ops.attnres import attn_res_mix
    from openk3.ops.moe import route

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 32, generator=g), torch.randn(8, 32, generator=g), torch.zeros(8)
    cands, q = [torch.randn(5, 32, generator=g) for _ in range(3)], torch.randn(32, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r_auto, m_auto = route(x, w, b, top_k=2, renormalize=True, scaling=1.0), attn_res_mix(cands, q, 1e-5)
    r_ref, m_ref = route(x, w, b, top_k=2, renormalize=True, scaling=1.0), attn_res_mix(cands, q, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(r_auto, r_ref)) and torch.equal(m_auto, m_ref)

    model = K3ForCausalLM.build(nano(), dtype=torch.float32, seed=0)
    ids = _ids(2, 40, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(gr).all() for gr in grads)


# ---- decode's packed weights never go stale ------------------------------------------------------------------

def _decode_logits(model, ids, steps=3):
    """Logits of the last `steps` tokens decoded one at a time after a prefill (the packed-weight paths)."""
    with torch.no_grad():
        cache = model.new_cache()
        model(ids[:, :-steps], cache=cache)
        return torch.cat([model(ids[:, t:t + 1], cache=cache) for t in range(ids.shape[1] - steps, ids.shape[1])], 1)


@pytest.mark.parametrize("edit", ["data_iadd", "data_mul_", "no_grad_add_", "data_assign"])
def test_in_place_weight_edits_reach_the_next_decode_step(edit):
    """Decode reads the KDA input projections and conv taps from one packed buffer and the experts through views.
    After a decode step has built them, an in-place edit of a weight (a PEFT merge does `p.data += delta`, which
    bumps no version counter; `p.data.mul_` neither) must change the very next step exactly as in a model built
    with the edited weights."""
    torch.manual_seed(0)
    model = K3ForCausalLM.build(nano(), dtype=torch.float64, seed=3).eval()
    ids = _ids(2, 12, seed=4)
    _decode_logits(model, ids)  # builds the packed buffers and the expert views
    kda = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    moe = next(m for m in model.modules() if type(m).__name__ == "SparseMoE")
    targets = [kda.q_proj.weight, kda.b_proj.weight, kda.k_conv1d.weight, moe.experts.w1, moe.experts.w2]
    gen = torch.Generator().manual_seed(5)
    for p in targets:
        delta = 0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if edit == "data_iadd":
            p.data += delta
        elif edit == "data_mul_":
            p.data.mul_(1 + delta)
        elif edit == "no_grad_add_":
            with torch.no_grad():
                p.add_(delta)
        else:
            p.data = p.data + delta  # new storage
    fresh = K3ForCausalLM.build(nano(), dtype=torch.float64, seed=3).eval()
    fresh.load_state_dict(model.state_dict())
    got, want = _decode_logits(model, ids), _decode_logits(fresh, ids)
    assert not torch.equal(got, _decode_logits(K3ForCausalLM.build(nano(), dtype=torch.float64, seed=3).eval(), ids))
    assert torch.equal(got, want)


def test_packing_under_inference_mode_leaves_the_model_trainable():
    """The engine decodes under torch.inference_mode and RL trains the same model next: the packed buffer the
    parameters move into must be a normal tensor (autograd cannot save inference tensors)."""
    model = K3ForCausalLM.build(nano(), seed=3)
    ids = _ids(1, 8, seed=6)
    with torch.inference_mode():
        cache = model.new_cache()
        model(ids[:, :-1], cache=cache)
        model(ids[:, -1:], cache=cache)  # packs the KDA projections and conv taps
    kda = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    assert not kda.q_proj.weight.is_inference()
    model(ids).float().pow(2).mean().backward()
    assert kda.q_proj.weight.grad is not None


def test_packing_leaves_a_chosen_weight_layout_alone():
    """A compiled decode graph stores Linear weights column-major and skips guards on them; an eager decode of the
    same model must neither move them back into a row-major packed buffer nor compute anything else."""
    from openk3.infer.graph import column_major_linears_

    model = K3ForCausalLM.build(nano(), dtype=torch.float64, seed=3).eval()
    ids = _ids(2, 10, seed=7)
    want = _decode_logits(model, ids)  # packs
    assert column_major_linears_(model) > 0
    kda = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    strides = kda.q_proj.weight.stride()
    assert torch.allclose(_decode_logits(model, ids), want, rtol=1e-10, atol=1e-12)  # (other matmul order)
    assert kda.q_proj.weight.stride() == strides and not kda.q_proj.weight.is_contiguous()
