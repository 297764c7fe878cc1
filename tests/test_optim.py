"""Muon + AdamW grouping and math, LR schedules, exact resume, QK-Clip, and a short training smoke."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from openk3.config import nano
from openk3.model.mla import GatedMLA
from openk3.model.model import K3ForCausalLM
from openk3.train import (
    LRSchedule,
    Muon,
    OptimConfig,
    QKClipRecorder,
    RoutingRecorder,
    apply_quantile_balancing,
    build_optimizer,
    clip_grad_norm_,
    lr_multiplier,
    mla_max_logits,
    param_groups,
    qk_clip_,
)
from openk3.train.optim import from_blocks, muon_update, newton_schulz, to_blocks


@pytest.fixture(scope="module")
def cfg():
    return nano()


def _model(cfg, seed=0):
    return K3ForCausalLM.build(cfg, dtype=torch.float32, seed=seed)


def _fake_grads(model, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.01


# -- grouping -----------------------------------------------------------------------------------------

def test_every_parameter_in_exactly_one_group(cfg):
    model = _model(cfg)
    groups = param_groups(model, OptimConfig())
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    names = [n for g in groups for n in g["names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    opt = build_optimizer(model, OptimConfig())
    assert len(opt.params()) == len(ids)


def test_classification_table(cfg):
    model = _model(cfg)
    table = {n: g for g in param_groups(model, OptimConfig()) for n in g["names"]}
    layers = range(cfg.num_hidden_layers)
    mla = next(i for i in layers if cfg.is_mla_layer(i))
    kda = next(i for i in layers if not cfg.is_mla_layer(i))
    moe = next(i for i in layers if cfg.is_moe_layer(i))
    H_kda, H_mla = cfg.linear_attn_config.num_heads, cfg.num_attention_heads

    def check(name, optimizer, kind, heads=1, axis=0, decay=True):
        g = table[name]
        assert (g["optimizer"], g["kind"], g["heads"], g["axis"]) == (optimizer, kind, heads, axis), name
        assert (g["weight_decay"] > 0) == decay, name

    check("model.embed_tokens.weight", "adamw", "embedding")
    check("lm_head.weight", "adamw", "head")
    check("model.norm.weight", "adamw", "vector", decay=False)
    check(f"model.layers.{kda}.self_attn.A_log", "adamw", "vector", decay=False)
    check(f"model.layers.{kda}.self_attn.dt_bias", "adamw", "vector", decay=False)
    check(f"model.layers.{kda}.self_attn.o_norm.weight", "adamw", "vector", decay=False)
    check(f"model.layers.{kda}.self_attn.q_conv1d.weight", "adamw", "conv", decay=False)
    check(f"model.layers.{kda}.self_attention_res_proj.weight", "adamw", "attnres_query", decay=False)
    check(f"model.layers.{moe}.block_sparse_moe.gate.weight", "adamw", "router")
    check(f"model.layers.{kda}.self_attn.b_proj.weight", "adamw", "gate")
    for leaf in ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj"):
        check(f"model.layers.{kda}.self_attn.{leaf}.weight", "muon", "per_head_rows", H_kda, 0)
    check(f"model.layers.{kda}.self_attn.o_proj.weight", "muon", "per_head_cols", H_kda, 1)
    check(f"model.layers.{kda}.self_attn.f_a_proj.weight", "muon", "matrix")
    for leaf in ("q_b_proj", "kv_b_proj", "g_proj"):
        check(f"model.layers.{mla}.self_attn.{leaf}.weight", "muon", "per_head_rows", H_mla, 0)
    check(f"model.layers.{mla}.self_attn.o_proj.weight", "muon", "per_head_cols", H_mla, 1)
    check(f"model.layers.{mla}.self_attn.q_a_proj.weight", "muon", "matrix")
    check(f"model.layers.{mla}.self_attn.kv_a_proj_with_mqa.weight", "muon", "matrix")
    check("model.layers.0.mlp.down_proj.weight", "muon", "matrix")
    check(f"model.layers.{moe}.block_sparse_moe.routed_expert_down_proj.weight", "muon", "matrix")
    check(f"model.layers.{moe}.block_sparse_moe.shared_experts.gate_proj.weight", "muon", "matrix")
    check(f"model.layers.{moe}.block_sparse_moe.experts.w2", "muon", "experts")
    # ablation switches
    plain = {n: g for g in param_groups(model, OptimConfig(per_head=False, muon_router=True)) for n in g["names"]}
    assert plain[f"model.layers.{mla}.self_attn.q_b_proj.weight"]["kind"] == "matrix"
    assert plain[f"model.layers.{moe}.block_sparse_moe.gate.weight"]["optimizer"] == "muon"


def test_muon_off_puts_every_parameter_on_adamw(cfg):
    """optim.muon=False (the Muon -> AdamW ablation): the same kinds and weight decays, all on AdamW at
    adamw_lr (else lr), no Muon optimizer; the Muon-only options are left unused, muon_router is refused."""
    model = _model(cfg)
    muon_groups = param_groups(model, OptimConfig())
    groups = param_groups(model, OptimConfig(muon=False, adamw_lr=3e-3))
    assert {g["optimizer"] for g in groups} == {"adamw"} and all(g["heads"] == 1 for g in groups)
    assert [g["kind"] for g in groups] == list(dict.fromkeys(g["kind"] for g in muon_groups))  # first appearance
    assert {g["lr"] for g in groups} == {3e-3}
    before = {n: (g["kind"], g["weight_decay"]) for g in muon_groups for n in g["names"]}
    after = {n: (g["kind"], g["weight_decay"]) for g in groups for n in g["names"]}
    assert after == before  # matrices and experts keep their decay, vectors/convs/queries stay without
    assert [n for g in groups for n in g["names"]] == [n for g in param_groups(model, OptimConfig(muon=False))
                                                       for n in g["names"]]  # deterministic
    assert {g["lr"] for g in param_groups(model, OptimConfig(muon=False, lr=1e-2))} == {1e-2}
    opt = build_optimizer(model, OptimConfig(muon=False, per_head=False, adamw_lr=3e-3))
    assert opt.muon is None and opt.optimizers == [opt.adamw]
    assert {id(p) for p in opt.params()} == {id(p) for p in model.parameters()}
    assert OptimConfig(muon=False, adamw_lr=3e-3).peak_lr == 3e-3 and OptimConfig(adamw_lr=3e-3).peak_lr == 2e-4
    with pytest.raises(ValueError, match="muon_router.*muon=False"):
        OptimConfig(muon=False, muon_router=True)


# -- Muon math ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(32, 128), (96, 48), (3, 40, 24)], ids=str)
def test_newton_schulz_is_roughly_orthogonal(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    sv = torch.linalg.svdvals(newton_schulz(G, 5))
    assert sv.min() > 0.65 and sv.max() < 1.2, (sv.min(), sv.max())


def test_blocks_round_trip():
    W = torch.randn(2, 96, 64)
    for axis in (0, 1):
        assert torch.equal(from_blocks(to_blocks(W, 4, axis), 4, axis), W)
    assert torch.equal(to_blocks(W[0], 4, 1)[2], W[0][:, 32:48])  # head 2 of a column split


def _muon_steps(params, groups, grads):
    opt = Muon(groups, lr=0.05, weight_decay=0.1, momentum=0.95)
    for g_list in grads:
        for p, g in zip(params, g_list):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("axis", [0, 1])
def test_per_head_muon_equals_muon_per_block(axis):
    H, gen = 4, torch.Generator().manual_seed(0)
    W0 = torch.randn(64, 96, generator=gen)
    grads = [torch.randn(64, 96, generator=gen) for _ in range(3)]
    whole = nn.Parameter(W0.clone())
    _muon_steps([whole], [{"params": [whole], "heads": H, "axis": axis}], [[g] for g in grads])
    blocks = [nn.Parameter(b.clone()) for b in to_blocks(W0, H, axis)]
    _muon_steps(blocks, [{"params": blocks}], [list(to_blocks(g, H, axis)) for g in grads])
    assert torch.equal(whole.detach(), from_blocks(torch.stack([b.detach() for b in blocks]), H, axis))
    # ... and it is not plain Muon on the whole matrix
    plain = nn.Parameter(W0.clone())
    _muon_steps([plain], [{"params": [plain]}], [[g] for g in grads])
    assert not torch.allclose(plain, whole)


def test_stacked_experts_orthogonalise_per_expert():
    gen = torch.Generator().manual_seed(1)
    W0, grads = torch.randn(3, 16, 24, generator=gen), [torch.randn(3, 16, 24, generator=gen) for _ in range(2)]
    stack = nn.Parameter(W0.clone())
    _muon_steps([stack], [{"params": [stack]}], [[g] for g in grads])
    for e in range(3):
        one = nn.Parameter(W0[e].clone())
        _muon_steps([one], [{"params": [one]}], [[g[e]] for g in grads])
        torch.testing.assert_close(stack[e].detach(), one.detach(), rtol=0, atol=1e-6)


def test_muon_update_function_matches_optimizer_and_rms():
    gen = torch.Generator().manual_seed(2)
    W0, g = torch.randn(64, 96, generator=gen), torch.randn(64, 96, generator=gen)
    p = nn.Parameter(W0.clone())
    p.grad = g.clone()
    Muon([{"params": [p], "heads": 4, "axis": 1}], lr=0.1, weight_decay=0.0).step()
    u = muon_update(g, torch.zeros(64, 96), momentum=0.95, nesterov=True, ns_steps=5, heads=4, axis=1)
    torch.testing.assert_close(p.detach(), W0 - 0.1 * u, rtol=0, atol=1e-6)
    # Moonlight's scale: RMS of an orthogonal [r, c] block times 0.2 sqrt(max) is about 0.2.
    assert 0.15 < u.pow(2).mean().sqrt().item() < 0.25


def test_adamw_half_matches_torch_adamw(cfg):
    ocfg = OptimConfig(lr=1e-2, adamw_lr=3e-3, weight_decay=0.1)
    model, ref = _model(cfg), _model(cfg)
    opt = build_optimizer(model, ocfg)
    ref_params = dict(ref.named_parameters())
    groups = [{"params": [ref_params[n] for n in g["names"]], "weight_decay": g["weight_decay"]}
              for g in opt.adamw.param_groups]
    ref_opt = torch.optim.AdamW(groups, lr=3e-3, betas=ocfg.betas, eps=ocfg.eps)
    for step in range(5):
        _fake_grads(model, step)
        _fake_grads(ref, step)
        opt.step()
        ref_opt.step()
    adamw_names = {n for g in opt.adamw.param_groups for n in g["names"]}
    assert any(g["weight_decay"] == 0 for g in opt.adamw.param_groups)
    for n, p in model.named_parameters():
        if n in adamw_names:
            torch.testing.assert_close(p, ref_params[n], rtol=0, atol=1e-7, msg=n)
        else:
            assert not torch.equal(p, ref_params[n]), f"{n}: Muon half did not move"


def test_clip_grad_norm():
    ps = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4))]
    ps[0].grad, ps[1].grad = torch.full((3,), 2.0), torch.full((4,), 2.0)
    total = clip_grad_norm_(ps, 1.0)
    assert math.isclose(total.item(), 4 * math.sqrt(7 / 4), rel_tol=1e-6)
    assert math.isclose(clip_grad_norm_(ps, None).item(), 1.0, rel_tol=1e-5)


# -- schedules and resume --------------------------------------------------------------------------------

def test_schedule_values():
    cos = dict(kind="cosine", warmup=10, total=110, min_ratio=0.1)
    assert lr_multiplier(0, **cos) == 0.0
    assert lr_multiplier(5, **cos) == 0.5
    assert lr_multiplier(10, **cos) == 1.0
    assert math.isclose(lr_multiplier(60, **cos), 0.55)
    assert math.isclose(lr_multiplier(110, **cos), 0.1) and math.isclose(lr_multiplier(500, **cos), 0.1)
    wsd = dict(kind="wsd", warmup=10, total=100, min_ratio=0.1, decay_frac=0.2)
    assert lr_multiplier(5, **wsd) == 0.5
    assert lr_multiplier(10, **wsd) == 1.0 and lr_multiplier(80, **wsd) == 1.0
    assert math.isclose(lr_multiplier(90, **wsd), 0.55)
    assert math.isclose(lr_multiplier(100, **wsd), 0.1)
    assert math.isclose(lr_multiplier(90, **wsd, decay_shape="sqrt"), 0.1 + 0.9 * (1 - math.sqrt(0.5)))
    assert lr_multiplier(3, kind="constant", warmup=0, total=10) == 1.0


def test_lr_schedule_drives_group_lrs(cfg):
    opt = build_optimizer(_model(cfg), OptimConfig(lr=1e-2, adamw_lr=2e-3))
    sched = LRSchedule(opt, kind="cosine", warmup=4, total=20)
    assert all(g["lr"] == 0.0 for g in opt.param_groups)
    sched.step()
    sched.step()
    for g in opt.param_groups:
        assert math.isclose(g["lr"], g["base_lr"] * 0.5)
    assert {g["base_lr"] for g in opt.muon.param_groups} == {1e-2}
    assert {g["base_lr"] for g in opt.adamw.param_groups} == {2e-3}


def test_state_dict_resume_is_exact(cfg):
    ocfg = OptimConfig(lr=1e-2)

    def run(model, opt, sched, steps):
        for s in steps:
            _fake_grads(model, s)
            opt.clip_grad_norm_()
            opt.step()
            sched.step()

    model = _model(cfg)
    opt = build_optimizer(model, ocfg)
    sched = LRSchedule(opt, kind="wsd", warmup=2, total=8, decay_frac=0.5)
    run(model, opt, sched, range(3))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))
    run(model, opt, sched, range(3, 6))

    model2 = _model(cfg, seed=7)
    model2.load_state_dict(saved[0])
    opt2 = build_optimizer(model2, ocfg)
    sched2 = LRSchedule(opt2, kind="wsd", warmup=2, total=8, decay_frac=0.5)
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    run(model2, opt2, sched2, range(3, 6))
    for (n, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), n


# -- QK-Clip -------------------------------------------------------------------------------------------

def test_qk_clip_caps_clipped_heads_only(cfg):
    model = _model(cfg)
    name, layer = next((n, m) for n, m in model.named_modules() if isinstance(m, GatedMLA))
    with torch.no_grad():  # make the logits large so clipping has something to do
        layer.q_b_proj.weight.mul_(torch.tensor([30.0, 1.0, 20.0, 1.0]).repeat_interleave(layer.dn + layer.dr)[:, None])
    inputs = {}
    hook = layer.register_forward_pre_hook(lambda m, args: inputs.setdefault("x", args[0].detach()))
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with QKClipRecorder(model) as rec, torch.no_grad():
        model(ids)
    hook.remove()
    smax = rec.max_logits[name]
    assert smax.shape == (cfg.num_attention_heads,)
    torch.testing.assert_close(smax, mla_max_logits(layer, inputs["x"]))
    tau = smax.sort().values[1:3].mean().item()  # two heads above, two below
    kv_before = layer.kv_b_proj.weight.detach().clone()
    clipped = qk_clip_(model, {name: smax}, tau)
    assert clipped == {name: 2}
    after = mla_max_logits(layer, inputs["x"])
    over = smax > tau
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-5, atol=1e-5)
    assert torch.equal(after[~over], smax[~over])
    H, dn, dv = layer.num_heads, layer.dn, layer.dv
    v_rows = kv_before.view(H, dn + dv, -1)[:, dn:]
    assert torch.equal(layer.kv_b_proj.weight.view(H, dn + dv, -1)[:, dn:], v_rows), "values must not change"


# -- training smoke ------------------------------------------------------------------------------------

@pytest.mark.slow(seconds=4)  # 30 optimizer steps of nano cut to 4 layers (every layer kind: KDA, MLA, dense, MoE)
@pytest.mark.parametrize("muon", [True, False], ids=["muon", "adamw"])
def test_training_smoke_loss_drops(cfg, muon):
    from openk3.train.config import TrainConfig, apply_overrides

    cfg = apply_overrides(TrainConfig(model=cfg), ["model.num_hidden_layers=4"]).model
    model = _model(cfg)
    opt = build_optimizer(model, OptimConfig(lr=3e-3, muon=muon))
    assert (opt.muon is None) == (not muon)
    sched = LRSchedule(opt, kind="cosine", warmup=3, total=30)
    ids = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    losses, worst = [], []
    with RoutingRecorder(model) as rec, QKClipRecorder(model) as qk:
        for _ in range(30):
            logits = model(ids)
            loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
            loss.backward()
            opt.clip_grad_norm_()
            opt.step()
            opt.zero_grad()
            sched.step()
            stats = apply_quantile_balancing(model, rec)
            qk_clip_(model, qk.max_logits, 100.0)
            qk.clear()
            losses.append(loss.item())
            worst.append(max(s["max_over_mean"] for s in stats.values()))
    assert losses[-1] < 0.6 * losses[0], losses
    assert all(math.isfinite(v) for v in losses)
    assert len(stats) == sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
