"""The post-training losses (openk3/posttrain/trainers/losses.py): gradients against finite differences, the
group-advantage identities, zero-variance skipping, clip-higher, importance weights, MOPD's zero
signal when student == teacher, its clip, and per-cell teacher routing (background §3.10)."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.posttrain.trainers.losses import (
    group_advantages,
    grpo_loss,
    importance_weights,
    kimi_pmd_loss,
    mopd_advantage,
    mopd_loss,
    route_teachers,
)

B, T, V, G = 6, 5, 4, 3  # 2 prompts x 3 samples, 5 positions, a 4-token vocabulary


def _toy(seed=0, shift=0.3):
    """A toy policy: free logits theta [B, T, V] (float64), sampled tokens, a mask with padding, and
    old log-probs from theta - shift * noise (so ratios differ from 1 and some get clipped)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False  # shorter trajectories
    mask[4, 1:] = False
    mask[:, 0] = False  # the prompt position
    old_theta = theta - shift * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    return theta.requires_grad_(), y, mask, _logp(old_theta, y).detach()


def _logp(theta, y):
    return torch.log_softmax(theta, -1).gather(-1, y[..., None])[..., 0]


def test_kimi_pmd_value_is_the_k2_formula_and_gradient_matches_finite_differences():
    theta, y, mask, old = _toy()
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    tau = 0.5
    loss, stats = kimi_pmd_loss(_logp(theta, y), old, mask, r, G, tau=tau)
    # the formula written out, loop by loop
    lp = _logp(theta, y).detach()
    want = 0.0
    for p in range(B // G):
        rows = range(p * G, (p + 1) * G)
        rbar = sum(float(r[i]) for i in rows) / G
        for i in rows:
            seq = sum(float(lp[i, t] - old[i, t]) for t in range(T) if mask[i, t])
            want += (float(r[i]) - rbar - tau * seq) ** 2 / B
    assert math.isclose(loss.item(), want, rel_tol=1e-12)
    assert stats["groups"] == 2 and stats["zero_variance_groups"] == 0
    assert torch.autograd.gradcheck(lambda th: kimi_pmd_loss(_logp(th, y), old, mask, r, G, tau=tau)[0], (theta,))


def test_kimi_pmd_gradient_at_the_old_policy_is_the_centred_reinforce_one():
    theta, y, mask, _ = _toy()
    old = _logp(theta, y).detach()  # on-policy: the sequence log-ratio is 0
    r = torch.tensor([2.0, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    tau = 0.7
    loss, stats = kimi_pmd_loss(_logp(theta, y), old, mask, r, G, tau=tau)
    (grad,) = torch.autograd.grad(loss, theta)
    centred = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    surrogate = (centred[:, None] * torch.where(mask, _logp(theta, y), 0)).sum()
    (want,) = torch.autograd.grad(-2 * tau / B * surrogate, theta)
    torch.testing.assert_close(grad, want)
    assert stats["zero_variance_groups"] == 1  # logged, not skipped (its residual anchors to pi_old)


@pytest.mark.parametrize("baseline", ["mean", "rloo"])
@pytest.mark.parametrize("std", ["none", "group", "batch"])
def test_group_advantages_sum_to_zero_per_group(baseline, std):
    r = torch.tensor([0.0, 1.0, 1.0, 3.0, -1.0, 0.5, 2.0, 2.0, 2.0])
    adv, keep = group_advantages(r, 3, baseline=baseline, std=std)
    torch.testing.assert_close(adv.reshape(3, 3).sum(-1), torch.zeros(3), atol=1e-6, rtol=0)
    assert keep.tolist() == [True] * 6 + [False] * 3
    assert adv[6:].tolist() == [0.0, 0.0, 0.0]


def test_group_advantages_definitions():
    r = torch.tensor([0.0, 1.0, 1.0, 4.0, 0.0, 2.0], dtype=torch.float64)
    mean, _ = group_advantages(r, 3)
    torch.testing.assert_close(mean, torch.tensor([-2 / 3, 1 / 3, 1 / 3, 2.0, -2.0, 0.0], dtype=torch.float64))
    rloo, _ = group_advantages(r, 3, baseline="rloo")  # r_i - mean of the others
    torch.testing.assert_close(rloo, torch.tensor([-1.0, 0.5, 0.5, 3.0, -3.0, 0.0], dtype=torch.float64))
    batch, _ = group_advantages(r, 3, std="batch")
    torch.testing.assert_close(batch, mean / (mean.std() + 1e-6))


@pytest.mark.parametrize("opts", [
    {},
    {"baseline": "rloo", "std": "batch"},
    {"std": "group", "clip_low": 0.1, "clip_high": 0.1},
    {"sampler": True, "is_mode": "tis"},
    {"sampler": True, "is_mode": "icepop"},
], ids=["dr-grpo", "rloo-batch-std", "grpo-tight-clip", "tis", "icepop"])
def test_grpo_gradient_matches_finite_differences(opts):
    opts = dict(opts)
    theta, y, mask, old = _toy(seed=1)
    r = torch.tensor([1.0, 0.0, 0.0, 0.3, 1.0, 0.0], dtype=torch.float64)
    if opts.pop("sampler", False):
        opts["sampler_logp_BT"] = old + 0.4 * torch.randn(B, T, dtype=torch.float64, generator=torch.Generator()
                                                          .manual_seed(5))
    loss, stats = grpo_loss(_logp(theta, y), old, mask, r, G, **opts)
    assert 0 < stats["clip_frac"] < 1  # both branches of the clip are exercised
    assert torch.autograd.gradcheck(lambda th: grpo_loss(_logp(th, y), old, mask, r, G, **opts)[0], (theta,))


def test_grpo_value_is_token_sum_over_a_constant_with_clip_higher():
    # one group of 2 with advantages +-0.5; token log-ratios chosen on both sides of the clip range
    old = torch.zeros(2, 3, dtype=torch.float64)
    lr = torch.tensor([[math.log(1.25), math.log(1.5), 0.0], [math.log(0.7), math.log(0.9), 0.0]],
                      dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    loss, stats = grpo_loss(lr, old, mask, torch.tensor([1.0, 0.0]), 2)
    # A = +0.5: ratio 1.25 is inside [0.8, 1.28] (clip-higher), 1.5 clips to 1.28;
    # A = -0.5: ratio 0.7 clips to 0.8 (min picks the clipped -0.4), 0.9 is inside
    want = -(0.5 * 1.25 + 0.5 * 1.28 - 0.5 * 0.8 - 0.5 * 0.9) / (2 * 3)
    assert math.isclose(loss.item(), want, rel_tol=1e-12)
    assert stats["clip_frac"] == 0.5
    (grad,) = torch.autograd.grad(loss, lr)
    assert grad[0, 0] != 0 and grad[0, 1] == 0 and grad[1, 0] == 0 and grad[1, 1] != 0
    assert grad[:, 2].tolist() == [0.0, 0.0]  # masked


def test_grpo_skips_zero_variance_groups_and_counts_them():
    theta, y, mask, old = _toy(seed=2)
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0], dtype=torch.float64)  # group 0 all correct
    loss, stats = grpo_loss(_logp(theta, y), old, mask, r, G)
    assert stats["zero_variance_groups"] == 1 and stats["groups"] == 2
    (grad,) = torch.autograd.grad(loss, theta)
    assert grad[:G].abs().max() == 0 and grad[G:].abs().max() > 0
    # the ratio statistics cover the kept group's tokens only
    ratio = torch.exp(_logp(theta, y).detach() - old)
    assert stats["ratio_mean"] == pytest.approx(float(ratio[G:][mask[G:]].mean()))
    # with std="group" a zero-variance group would divide 0 by eps: still skipped, still finite
    loss2, _ = grpo_loss(_logp(theta, y), old, mask, r, G, std="group")
    assert torch.isfinite(loss2)
    all_same, stats = grpo_loss(_logp(theta, y), old, mask, torch.zeros(B, dtype=torch.float64), G)
    assert all_same.item() == 0 and stats["zero_variance_groups"] == 2


def test_importance_weights_are_one_when_sampler_equals_trainer_and_truncate_or_gate_otherwise():
    lp = torch.log(torch.rand(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    for mode in ("tis", "icepop", "none"):
        assert importance_weights(lp, lp.clone(), mode=mode).eq(1).all()
    assert importance_weights(lp, None).eq(1).all()
    sampler = lp - torch.tensor([math.log(3.0), math.log(1.5), 0.0, -math.log(4.0)], dtype=torch.float64)
    torch.testing.assert_close(importance_weights(lp, sampler, mode="tis")[0],
                               torch.tensor([2.0, 1.5, 1.0, 0.25], dtype=torch.float64))
    torch.testing.assert_close(importance_weights(lp, sampler, mode="icepop")[0],
                               torch.tensor([0.0, 1.5, 1.0, 0.0], dtype=torch.float64))
    theta, y, mask, old = _toy(seed=3)
    r = torch.tensor([1.0, 0.0, 0.0, 0.3, 1.0, 0.0], dtype=torch.float64)
    plain, _ = grpo_loss(_logp(theta, y), old, mask, r, G)
    same, stats = grpo_loss(_logp(theta, y), old, mask, r, G, sampler_logp_BT=old.clone())
    assert plain.item() == same.item() and stats["mismatch_kl"] == 0 and stats["is_weight_mean"] == 1


def test_loss_arguments_are_checked():
    theta, y, mask, old = _toy()
    r = torch.zeros(B, dtype=torch.float64)
    with pytest.raises(ValueError, match="groups of group_size=4"):
        grpo_loss(_logp(theta, y), old, mask, r, 4)
    with pytest.raises(ValueError, match="group_size must be"):
        kimi_pmd_loss(_logp(theta, y), old, mask, r, 1)
    with pytest.raises(ValueError, match="tau must be > 0"):
        kimi_pmd_loss(_logp(theta, y), old, mask, r, G, tau=0.0)
    with pytest.raises(ValueError, match="old_logp_BT must have"):
        grpo_loss(_logp(theta, y), old[:, :2], mask, r, G)
    with pytest.raises(ValueError, match="baseline must be one of"):
        grpo_loss(_logp(theta, y), old, mask, r, G, baseline="median")
    with pytest.raises(ValueError, match="clip R must be > 0"):
        mopd_advantage(old, old, mask, clip=0.0)
    with pytest.raises(ValueError, match="needs rewards_B"):
        mopd_loss(_logp(theta, y), old, old, mask, alpha=0.5)


def test_mopd_student_equal_to_teacher_gives_zero_advantage_and_zero_gradient():
    """A real nano K3 as both student and teacher: every A_t is 0 and no parameter gets a gradient."""
    from openk3.config import nano
    from openk3.model.model import K3ForCausalLM

    student = K3ForCausalLM.build(nano(), dtype=torch.float32, seed=3)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[:, 4:] = True  # the "generated" tokens (after a 5-token prompt)
    mask[1, 9:] = False  # a shorter sample
    logp = torch.log_softmax(student(ids[:, :-1]).float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    # the teacher's prefill, the same forward (a no_grad forward may differ in the last bit: other kernels)
    teacher = torch.log_softmax(student(ids[:, :-1]).float(), -1).gather(-1, ids[:, 1:, None])[..., 0].detach()
    behaviour = logp.detach()
    assert mopd_advantage(teacher, behaviour, mask).abs().max() == 0
    loss, stats = mopd_loss(logp, behaviour, teacher, mask)
    loss.backward(retain_graph=True)
    grads = [p.grad for p in student.parameters() if p.grad is not None]
    assert grads and all(g.abs().max() == 0 for g in grads)
    assert abs(stats["reverse_kl"]) < 1e-6 and stats["clipped_frac"] == 0
    # a different teacher gives a real signal through the same path (the check above can fail)
    student.zero_grad()
    loss, _ = mopd_loss(logp, behaviour, teacher + 0.1 * torch.randn_like(teacher), mask)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in student.parameters())


def test_mopd_advantage_is_clipped_stop_gradient_and_zero_on_masked_tokens():
    student = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=torch.float64)
    teacher = torch.tensor([[-9.0, -0.5, float("-inf"), 1.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1]], dtype=torch.bool)
    adv = mopd_advantage(teacher, student, mask, clip=5.0)
    assert adv.tolist() == [[-5.0, 1.5, 0.0, 4.0]]  # -8 clipped to -5; -inf on a masked token ignored
    assert not adv.requires_grad
    assert mopd_advantage(teacher, student, mask, clip=2.0).tolist() == [[-2.0, 1.5, 0.0, 2.0]]
    assert mopd_advantage(teacher, student, mask, clip=None).tolist() == [[-8.0, 1.5, 0.0, 4.0]]


def test_mopd_loss_is_reinforce_on_dense_rewards_and_matches_finite_differences():
    theta, y, mask, behaviour = _toy(seed=4, shift=0.0)  # first pass: behaviour == current policy
    teacher = behaviour + torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 4
    loss, stats = mopd_loss(_logp(theta, y), behaviour, teacher, mask, clip=5.0)
    adv = mopd_advantage(teacher, behaviour, mask, clip=5.0)
    (grad,) = torch.autograd.grad(loss, theta)
    (want,) = torch.autograd.grad(-(adv * torch.where(mask, _logp(theta, y), 0)).sum() / mask.sum(), theta)
    torch.testing.assert_close(grad, want)
    gap = torch.where(mask, behaviour - teacher, 0)
    assert math.isclose(stats["reverse_kl"], float(gap.sum() / mask.sum()), rel_tol=1e-9)
    assert stats["clipped_frac"] == float(((gap.abs() > 5.0) & mask).sum() / mask.sum()) > 0
    want_B = gap.sum(-1) / mask.sum(-1)
    want_B[4] = 0  # sample 4 generated no token: 0, not 0/0
    torch.testing.assert_close(stats["reverse_kl_B"], want_B)
    # a reused batch (behaviour != current) with PPO clip and outcome mixing
    _, _, _, stale = _toy(seed=4, shift=0.5)
    r = torch.tensor([1.0, 0.0, 0.0, 0.3, 1.0, 0.0], dtype=torch.float64)
    opts = dict(clip=5.0, ratio_clip=(0.2, 0.28), rewards_B=r, group_size=G, alpha=0.5)
    assert mopd_loss(_logp(theta, y), stale, teacher, mask, **opts)[1]["ratio_clip_frac"] > 0
    assert torch.autograd.gradcheck(lambda th: mopd_loss(_logp(th, y), stale, teacher, mask, **opts)[0], (theta,))


def test_mopd_alpha_adds_the_centred_outcome_advantage():
    theta, y, mask, behaviour = _toy(seed=6, shift=0.0)
    teacher = behaviour.clone()  # no distillation signal: only the outcome term remains
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    loss, _ = mopd_loss(_logp(theta, y), behaviour, teacher, mask, rewards_B=r, group_size=G, alpha=0.5)
    centred = torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0], dtype=torch.float64)
    want = -(0.5 * centred[:, None] * torch.where(mask, torch.ones(B, T, dtype=torch.float64), 0)).sum() / mask.sum()
    assert math.isclose(loss.item(), float(want), rel_tol=1e-12)


CELLS = [(d, e) for d in ("general", "agent", "coding") for e in ("low", "high", "max")]


def _sentinel(cell):
    """A teacher whose every log-prob encodes its own cell, so a wrong route shows in the numbers."""
    code = -(1 + CELLS.index(cell)) / 10
    return lambda n_tokens: torch.full((n_tokens,), code, dtype=torch.float64)


def _score(cells, teachers, n_tokens=3):
    """What a MOPD step does: route, one prefill per teacher over its samples, scatter back."""
    out = torch.full((len(cells), n_tokens), float("nan"), dtype=torch.float64)
    for _, (teacher, idx) in route_teachers(cells, teachers).items():
        for i in idx:
            out[i] = teacher(n_tokens)
    return out


def test_route_teachers_sends_every_sample_to_its_own_cell_teacher():
    g = torch.Generator().manual_seed(0)
    cells = [CELLS[int(i)] for i in torch.randint(0, 9, (40,), generator=g)] + CELLS
    teachers = {f"{d}/{e}": _sentinel((d, e)) for d, e in CELLS}  # string keys, as report.json spells them
    got = _score(cells, teachers)
    want = torch.tensor([[-(1 + CELLS.index(c)) / 10] * 3 for c in cells], dtype=torch.float64)
    assert torch.equal(got, want)
    routes = route_teachers(cells, teachers)
    assert sorted(i for _, idx in routes.values() for i in idx) == list(range(len(cells)))
    assert all(cells[i] == cell for cell, (_, idx) in routes.items() for i in idx)
    # a wrong route (two teachers swapped) is detected by the sentinels
    swapped = dict(teachers)
    swapped["general/low"], swapped["coding/max"] = teachers["coding/max"], teachers["general/low"]
    assert not torch.equal(_score(cells, swapped), want)


def test_route_teachers_rejects_unknown_cells_and_bad_keys():
    teachers = {c: _sentinel(c) for c in CELLS if c != ("agent", "high")}
    with pytest.raises(ValueError, match="sample 1: no teacher for cell agent/high"):
        route_teachers([("agent", "low"), "agent/high"], teachers)
    with pytest.raises(ValueError, match="effort 'medium'"):
        route_teachers([], {("general", "medium"): None})
    with pytest.raises(ValueError, match="given twice"):
        route_teachers([], {("general", "low"): 1, "general/low": 2})
    with pytest.raises(ValueError, match="sample 0: a cell is"):
        route_teachers(["general-low"], teachers)
