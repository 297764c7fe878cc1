"""Quantile Balancing (spec §5), load metrics, the auxiliary-loss alternative, routing recording."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.config import nano
from openk3.model.model import K3ForCausalLM
from openk3.model.moe import SparseMoE
from openk3.ops.moe import route
from openk3.train import RoutingRecorder, apply_quantile_balancing, aux_balance_loss, load_stats
from openk3.train import quantile_balance_update as qb
from openk3.train.balance import expert_load


def _skewed_scores(N=256, E=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(N, E, generator=gen, dtype=torch.float64) + torch.linspace(-2, 2, E,
                                                                                                 dtype=torch.float64))


def _margins(s, b, k):
    biased = s + b
    alpha = torch.topk(biased, k + 1, dim=1).values[:, -1]
    return biased - alpha[:, None]


def test_full_step_leaves_exactly_q_positive_margins():
    """The defining property: with rate 1, every column keeps exactly q positive margins (q integer).

    Each token's (k+1)-th expert has margin exactly 0, a structural tie: where c_j lands on it the
    property holds in its tie-robust form #(M > c) <= q <= #(M >= c)."""
    N, E, K = 256, 32, 4
    q = N * K // E
    s, b = _skewed_scores(N, E), torch.linspace(-0.05, 0.05, E, dtype=torch.float64)
    new_b = qb(s, b, K)
    c = b - new_b
    M = _margins(s, b, K)
    above, at_or_above = (M > c).sum(0), (M >= c).sum(0)
    assert (above <= q).all() and (at_or_above >= q).all()
    untied = c.abs() > 1e-12
    assert untied.sum() >= E - 4
    assert (above[untied] == q).all(), above
    # Re-routing the same batch with the new bias is far better balanced (not exactly q: every
    # token's cutoff moves with the biases).
    before = load_stats(torch.topk(s + b, K, dim=1).indices, E)["max_over_mean"]
    after = load_stats(torch.topk(s + new_b, K, dim=1).indices, E)["max_over_mean"]
    assert before > 3 and after < 1.6, (before, after)


def test_fractional_q_interpolates():
    N, E, K = 100, 32, 4  # q = 12.5
    s, b = _skewed_scores(N, E, seed=1), torch.zeros(E, dtype=torch.float64)
    M = _margins(s, b, K)
    top = torch.topk(M, 14, dim=0).values
    torch.testing.assert_close(b - qb(s, b, K), 0.5 * (top[12] + top[13]))
    assert qb(s.float(), b.float(), K).dtype == torch.float32


def test_damped_updates_converge_to_balance():
    N, E, K = 512, 32, 4
    b = torch.zeros(E, dtype=torch.float64)
    history = []
    for step in range(40):
        s = _skewed_scores(N, E, seed=step)  # a fresh batch from the same skewed router each step
        history.append(load_stats(torch.topk(s + b, K, dim=1).indices, E)["max_over_mean"])
        b = qb(s, b, K, rate=0.5)
    assert history[0] > 3
    assert max(history[-10:]) < 1.5, history
    assert sum(history[-10:]) / 10 < sum(history[5:15]) / 10


def test_bias_affects_selection_only():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 16, generator=gen), torch.randn(32, 16, generator=gen)
    b0 = torch.zeros(32)
    _, _, s = route(x, w, b0, top_k=4, renormalize=True, scaling=1.0)
    b1 = qb(s, b0, 4)
    w0, i0, _ = route(x, w, b0, top_k=4, renormalize=True, scaling=1.0)
    w1, i1, s1 = route(x, w, b1, top_k=4, renormalize=True, scaling=1.0)
    assert torch.equal(s, s1)
    expect = s.gather(1, i1)
    torch.testing.assert_close(w1, expect / expect.sum(-1, keepdim=True))
    same = (i0.sort(1).values == i1.sort(1).values).all(1)
    assert 0 < same.sum() < len(same)
    torch.testing.assert_close(w0.gather(1, i0.argsort(1))[same], w1.gather(1, i1.argsort(1))[same])


def test_load_stats_hand_example():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 1]])  # loads [3, 3, 1, 1], mean 2
    st = load_stats(idx, 4)
    assert st == {"max_over_mean": 1.5, "min": 1.0, "max": 3.0, "cv": 0.5}
    assert expert_load(idx, 5).tolist() == [3, 3, 1, 1, 0]


def test_aux_balance_loss():
    N, E, K = 64, 8, 2
    uniform = torch.full((N, E), 0.3, requires_grad=True)
    idx = torch.arange(N * K).reshape(N, K) % E  # every expert exactly N*K/E times
    assert math.isclose(aux_balance_loss(uniform, idx, E, K).item(), 1.0, rel_tol=1e-6)
    skew = torch.sigmoid(torch.linspace(-3, 3, E)).expand(N, E).clone().requires_grad_(True)
    idx_skew = torch.topk(skew, K, dim=1).indices
    loss = aux_balance_loss(skew, idx_skew, E, K, seq_len=16)
    p = skew[0].detach() / skew[0].detach().sum()
    assert math.isclose(loss.item(), (E / K) * (p[-1] + p[-2]).item(), rel_tol=1e-6)  # f = E/K on the top 2
    assert loss.item() > 1.5
    loss.backward()
    assert skew.grad is not None and skew.grad.abs().sum() > 0
    with pytest.raises(ValueError):
        aux_balance_loss(skew, idx_skew, E, K, seq_len=15)


@pytest.fixture(scope="module")
def model_and_ids():
    cfg = nano()
    model = K3ForCausalLM.build(cfg, dtype=torch.float32, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return cfg, model, ids


def test_routing_recorder_collects_per_layer(model_and_ids):
    cfg, model, ids = model_and_ids
    moes = {n: m for n, m in model.named_modules() if isinstance(m, SparseMoE)}
    with torch.no_grad():
        ref = model(ids)
    with RoutingRecorder(model) as rec, torch.no_grad():
        got = model(ids)
        assert set(rec.records) == set(moes) and len(moes) == sum(cfg.is_moe_layer(i) for i in range(9))
        for n in moes:
            assert len(rec.records[n]) == 1
            scores, idx = rec.routing(n)
            assert scores.shape == (32, cfg.num_experts) and scores.dtype == torch.float32
            assert idx.shape == (32, cfg.num_experts_per_token) and idx.dtype == torch.int64
            assert not scores.requires_grad
        model(ids)  # a second micro-batch pools into the same update
        assert rec.routing(next(iter(moes)))[0].shape[0] == 64
        biases = {n: m.gate.e_score_correction_bias.clone() for n, m in moes.items()}
        stats = apply_quantile_balancing(model, rec, rate=1.0)
        assert set(stats) == set(moes) and all(s["max_over_mean"] >= 1 for s in stats.values())
        assert all(not rec.records[n] for n in moes)
        assert all(not torch.equal(biases[n], m.gate.e_score_correction_bias) for n, m in moes.items())
        with torch.no_grad():
            for m in moes.values():
                m.gate.e_score_correction_bias.zero_()
    assert torch.equal(ref, got), "recording must not change the output"
    assert all(not m.record_routing and not hasattr(m, "last_routing") for m in moes.values())


def test_recording_off_keeps_outputs_and_state(model_and_ids):
    _, model, ids = model_and_ids
    moe = next(m for m in model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(2, 5, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
    out_off = moe(x)
    assert not hasattr(moe, "last_routing")
    moe.record_routing = True
    out_on = moe(x)
    moe.record_routing = False
    del moe.last_routing
    assert torch.equal(out_off, out_on)
    torch.testing.assert_close(moe(x, impl="loop"), out_off)


def test_aux_loss_from_recorder_has_router_grads(model_and_ids):
    _, model, ids = model_and_ids
    with RoutingRecorder(model, keep_inputs=True) as rec:
        model(ids)
        loss = rec.aux_loss()
    loss.backward()
    gates = [m.gate.weight for m in model.modules() if isinstance(m, SparseMoE)]
    assert loss.item() >= 1 - 1e-6 and all(g.grad is not None and g.grad.abs().sum() > 0 for g in gates)
    model.zero_grad(set_to_none=True)
