"""DeepSeek-V3's sign rule for the expert biases (`balance="sign"`, the K2-style baseline) and the Muon -> AdamW
ablation (`optim.muon=false`): the rule by hand, balancing under a fixed skew, the trainer's step with both, and
the config fields (validation, overrides, train_config.json old and new)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from openk3.config import nano
from openk3.model.model import K3ForCausalLM
from openk3.model.moe import SparseMoE
from openk3.train import RoutingRecorder, apply_sign_balancing, load_stats, sign_balance_update
from openk3.train.config import TrainConfig, apply_overrides, resume_changes

U = 1e-3


def _model(cfg=None, seed=0):
    return K3ForCausalLM.build(cfg or nano(), dtype=torch.float32, seed=seed)


# ---- the rule ---------------------------------------------------------------------------------------------

def test_sign_rule_by_hand():
    """loads [3, 2, 2, 1], mean 2: the over-loaded expert goes down by u, the under-loaded up by u, the two
    at the mean stay; a fractional mean (6 / 4 = 1.5) leaves no expert at it."""
    bias = torch.zeros(4)
    new = sign_balance_update(torch.tensor([3, 2, 2, 1]), bias, U)
    assert torch.equal(new, torch.tensor([-U, 0.0, 0.0, U]))
    assert torch.equal(bias, torch.zeros(4)), "nothing in place"
    b0 = torch.tensor([0.5, -0.25, 0.0, 0.125], dtype=torch.float64)
    torch.testing.assert_close(sign_balance_update(torch.tensor([3, 1, 1, 1]), b0, 0.25),
                               b0 + torch.tensor([-0.25, 0.25, 0.25, 0.25], dtype=torch.float64), rtol=0, atol=0)
    assert torch.equal(sign_balance_update(torch.tensor([2, 2]), torch.ones(2), U), torch.ones(2))
    with pytest.raises(ValueError, match="load"):
        sign_balance_update(torch.tensor([1, 2, 3]), torch.zeros(4), U)


def test_apply_sign_balancing_moves_each_bias_by_u_from_recorded_loads():
    """Recorded top-k choices of two micro-batches pool into one load per layer: +u under the mean, -u over
    it, 0 at it; the stats are those of the loads before the update; `reduce` sees the counts."""
    model = _model()
    moes = {n: m for n, m in model.named_modules() if isinstance(m, SparseMoE)}
    name, moe = next(iter(moes.items()))
    E, K = moe.gate.weight.shape[0], moe.top_k
    # 8 tokens x K = 4 picks = 32 picks over 32 experts (mean 1): expert 0 picked by tokens 0-4, experts 1-27
    # once each, experts 28-31 never
    assert (E, K) == (32, 4)
    others = iter(range(1, 28))
    idx = torch.tensor([([0] if i < 5 else []) + [next(others) for _ in range(3 if i < 5 else 4)] for i in range(8)])
    scores = torch.rand(8, E)
    rec = RoutingRecorder(model)
    rec.records[name] = [(scores[:4], idx[:4]), (scores[4:], idx[4:])]
    before = {n: m.gate.e_score_correction_bias.clone() for n, m in moes.items()}
    seen = []
    stats = apply_sign_balancing(model, rec, U, reduce=lambda t: seen.append(t.clone()) or t)
    assert set(stats) == {name}, "layers with nothing recorded are skipped"
    assert stats[name] == load_stats(idx, E) and stats[name]["max_over_mean"] == 5.0
    assert len(seen) == 1 and seen[0].tolist() == [5] + [1] * 27 + [0] * 4
    want = torch.zeros(E)
    want[0], want[28:] = -U, U
    assert torch.equal(moe.gate.e_score_correction_bias - before[name], want)
    assert all(torch.equal(m.gate.e_score_correction_bias, before[n]) for n, m in moes.items() if n != name)
    assert not rec.records[name], "recorder cleared"
    # rate 0: measures, moves nothing
    rec.records[name] = [(scores, idx)]
    frozen = moe.gate.e_score_correction_bias.clone()
    assert apply_sign_balancing(model, rec, 0.0)[name] == stats[name]
    assert torch.equal(moe.gate.e_score_correction_bias, frozen)


def test_sign_rule_balances_a_skewed_router():
    """A router that favours 4 of 32 experts (their weights lean towards a direction every input shares), fresh
    batches of 1024 tokens from one distribution, routing recorded through the layer's own forward: the sign
    rule brings max/mean load from over 3 down to the level its fixed step oscillates at (~1.3-1.5 here; the
    sampling noise alone of 128 tokens per expert gives ~1.2)."""
    model = _model()
    moe = next(m for m in model.modules() if isinstance(m, SparseMoE))
    E, D = moe.gate.weight.shape
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(D, generator=gen)
    direction /= direction.norm()
    with torch.no_grad():  # logits of spread ~1 (scores ~0.25-0.75), experts 0-3 two units higher on average
        moe.gate.weight.copy_(torch.randn(E, D, generator=gen) / D**0.5)
        moe.gate.weight[:4] += 2.0 * direction
    worst = []
    with RoutingRecorder(model) as rec, torch.no_grad():
        for _ in range(80):
            moe(torch.randn(4, 256, D, generator=gen) + direction)
            stats = apply_sign_balancing(model, rec, 0.01)
            worst.append(next(iter(stats.values()))["max_over_mean"])
    first, last = worst[0], sum(worst[-20:]) / 20
    assert first > 3 and last < 1.6, (first, last)
    bias = moe.gate.e_score_correction_bias
    assert bias[:4].max() < bias[4:].min(), "the favoured experts are pushed below every other"


# ---- the trainer's step ---------------------------------------------------------------------------------------

class _Batches:
    """A fixed batch every step (the trainer's loader interface)."""

    def __init__(self, ids):
        self.ids = ids

    def next(self):
        return {"input_ids": self.ids, "labels": torch.cat([self.ids[:, 1:], torch.full_like(self.ids[:, :1], -100)],
                                                           1), "seg": None}

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


@pytest.mark.slow(seconds=2)  # 8 steps of nano cut to 4 layers, seq 32 x batch 2
def test_trainer_steps_with_sign_balancing_and_adamw_only():
    """`balance=sign` and `optim.muon=false` through `build_trainer`: no Muon, qk_clip on (the weight-space
    clip applies after AdamW as after Muon), each step moves every bias by exactly -u, 0 or +u, logs the load
    imbalance, and the loss falls."""
    from openk3.train.trainer import build_trainer

    cfg = apply_overrides(TrainConfig(), [
        "model.num_hidden_layers=4", "seq_len=32", "batch_size=2", "max_steps=8", "warmup=1", "optim.lr=3e-3",
        "balance=sign", "sign_rate=0.01", "qb_rate=0", "optim.muon=false", "qk_clip=true"])
    assert cfg.balance == "sign" and cfg.optim.muon is False
    model = _model(cfg.model)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    trainer = build_trainer(model, _Batches(ids), cfg)
    assert trainer.opt.muon is None
    moes = {n: m for n, m in model.named_modules() if isinstance(m, SparseMoE)}
    losses = []
    try:
        for _ in range(cfg.max_steps):
            before = {n: m.gate.e_score_correction_bias.clone() for n, m in moes.items()}
            lr = trainer.opt.param_groups[0]["lr"]
            rec = trainer.train_step(trainer.batches.next())
            losses.append(rec["loss"])
            assert rec["lr"] == pytest.approx(lr)  # AdamW's LR in force is the one logged
            assert rec["load_max_over_mean"] >= 1 and "qk_clipped_heads" in rec
            for n, m in moes.items():
                step = (m.gate.e_score_correction_bias - before[n]) / cfg.sign_rate
                assert torch.allclose(step, step.round(), atol=1e-4) and set(step.round().tolist()) <= {-1, 0, 1}
                assert step.round().abs().sum() > 0
    finally:
        trainer.close()
    assert losses[-1] < 0.8 * losses[0], losses


# ---- config ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("item, words", [
    ("balance=aux", ["balance", "'qb'", "'sign'", "'aux'"]),
    ("sign_rate=-0.001", ["sign_rate", "-0.001"]),
    ("sign_rate=nan", ["sign_rate"]),
    ("optim.muon=maybe", ["optim.muon", "'maybe'"]),
])
def test_config_errors_name_the_field(item, words):
    with pytest.raises(ValueError) as e:
        apply_overrides(TrainConfig(), [item])
    for w in words:
        assert w in str(e.value)


def test_muon_router_without_muon_names_both_fields():
    with pytest.raises(ValueError) as e:
        apply_overrides(TrainConfig(), ["optim.muon=false", "optim.muon_router=true"])
    assert "optim.muon_router" in str(e.value) and "optim.muon=False" in str(e.value)


def test_disk_estimate_counts_adamw_state_for_every_matrix():
    """The free-space check before a run: with optim.muon=false the Muon half's one fp32 buffer per parameter
    becomes AdamW's two."""
    from openk3.plan.train import optimizer_split
    from openk3.train.space import checkpoint_bytes

    model = nano()
    assert checkpoint_bytes(model, muon=False) - checkpoint_bytes(model) == 4 * optimizer_split(model)["muon"] > 0


def test_train_config_json_round_trip_and_old_files(tmp_path):
    cfg = apply_overrides(TrainConfig(), ["balance=sign", "sign_rate=0.002", "optim.muon=false",
                                          "model.vocab_size=1024"])
    cfg.to_json(tmp_path / "train_config.json")
    saved = json.loads((tmp_path / "train_config.json").read_text())
    assert saved["balance"] == "sign" and saved["sign_rate"] == 0.002 and saved["optim"]["muon"] is False
    again = TrainConfig.from_json(tmp_path / "train_config.json")
    assert again == cfg
    # a run folder written before the fields existed: loads with the defaults, and resuming it is no change
    old = TrainConfig().to_dict()
    for key in ("balance", "sign_rate"):
        del old[key]
    del old["optim"]["muon"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = TrainConfig.from_json(tmp_path / "old.json")
    assert (loaded.balance, loaded.sign_rate, loaded.optim.muon) == ("qb", 1e-3, True)
    assert loaded == TrainConfig()
    assert resume_changes(old, TrainConfig().to_dict()) == ([], [])
    assert "balance" not in old and "muon" not in old["optim"], "the saved dict is not modified"
    _, refused = resume_changes(old, dataclasses.replace(TrainConfig(), balance="sign").to_dict())
    assert refused == ["balance: 'qb' -> 'sign'"]
    _, refused = resume_changes(old, cfg.to_dict())
    assert {r.split(":")[0] for r in refused} >= {"balance", "sign_rate", "optim.muon"}
