"""The scaling lab (issue 31): families, ladder points (WSD branches, resume, sharing), fits, experiments."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from openk3.scaling.families import FAMILIES, config_flops, family, k3_config
from openk3.scaling.fit import fit_pair
from openk3.scaling.ladder import LadderSettings, PointStore, stable_steps

TINY = LadderSettings(layers=5, batch_size=4, seq_len=64, eval_batches=2, max_bytes=400_000, val_fraction=0.05,
                      warmup_steps=2)


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.INFO)
    yield
    logging.disable(logging.NOTSET)


# ---- families -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("width", [32, 96])
def test_cost_matched_families_are_within_5_percent_of_k3(name, width):
    fam = family(name)
    cfg = fam.config(width, 9)
    ratio = config_flops(cfg, 256) / config_flops(k3_config(width, 9), 256)
    if fam.match is not None or name in ("k3", "k3-no-attnres", "k3-swiglu", "k3-adamw"):
        assert abs(ratio - 1) < 0.05, (name, width, ratio)
    else:  # the attention kind itself (MLA costs more at short widths); fits use the actual compute
        assert name in ("k3-all-mla", "k3-1to1") and 1.0 < ratio < 1.2


def test_families_are_what_they_say():
    k3, k2 = family("k3").config(64, 9), family("k2-style").config(64, 9)
    assert k3.use_attn_res and k3.use_latent_moe and k3.hidden_act == "situ" and len(k3.mla_layers) == 3
    assert not k2.use_attn_res and not k2.use_latent_moe and k2.hidden_act == "silu"
    assert k2.mla_layers == list(range(9)) and not k2.mla_use_nope and not k2.mla_use_output_gate
    assert k2.num_experts == k3.num_experts // 2 and k2.num_experts_per_token == k3.num_experts_per_token // 2
    assert family("k2-style").train_overrides == {"balance": "sign"}
    dense = family("dense").config(64, 9)
    assert not any(dense.is_moe_layer(i) for i in range(9))
    assert family("k3-all-mla").config(64, 9).linear_attn_config.kda_layers == []
    assert family("k3-1to1").config(64, 9).mla_layers == [1, 3, 5, 7, 8]
    assert family("k3-adamw").train_overrides == {"optim.muon": False}
    lm = family("k3-no-latent-moe").config(64, 9)
    assert not lm.use_latent_moe and lm.attn_res_block_size == k3.attn_res_block_size
    with pytest.raises(ValueError, match="family"):
        family("k4")
    with pytest.raises(ValueError, match="multiple of 32"):
        k3_config(48, 9)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_trains_saves_loads_and_generates(name, tmp_path):
    """A few steps through the ladder's own training config, then the saved checkpoint opens with
    `openk3.LLM` and its cached greedy decode equals greedy decoding by full forwards."""
    import openk3
    from openk3.train.trainer import train

    store = PointStore(tmp_path / "store", TINY, say=lambda m: None)
    cfg = store.train_config(name, 32, 4, 3e-3, 0)
    store._tokenizer(cfg)
    import dataclasses

    summary = train(dataclasses.replace(cfg, save_every=0), tmp_path / "run", progress=False)
    assert math.isfinite(summary["val_bpb"])
    llm = openk3.LLM(str(tmp_path / "run"), dtype="float32")
    out = llm.generate([[5, 6, 7]], max_tokens=6, temperature=0)[0]
    model = openk3.load(str(tmp_path / "run"), dtype=torch.float32)
    ids = [5, 6, 7]
    for _ in range(len(out.token_ids)):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert list(out.token_ids) == ids[3:3 + len(out.token_ids)]
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    for key, value in family(name).train_overrides.items():
        section, _, leaf = key.rpartition(".")
        assert (saved[section] if section else saved)[leaf] == value


# ---- ladder points -----------------------------------------------------------------------------------

def test_wsd_branch_is_the_long_run_bit_for_bit_and_points_are_reused(tmp_path, monkeypatch):
    a = PointStore(tmp_path / "a", TINY, say=lambda m: None)
    b = PointStore(tmp_path / "b", TINY, say=lambda m: None)
    long_branched = a.point("k3", 32, 12, 3e-3, 0, branch_from=8)
    assert long_branched["started"].startswith(f"branched at step {stable_steps(8, TINY.decay_frac)}")
    long_scratch = b.point("k3", 32, 12, 3e-3, 0)
    assert long_scratch["started"] == "from scratch"
    assert long_branched["loss"] == long_scratch["loss"]
    assert long_branched["compute"] == long_scratch["compute"] == long_scratch["flops_per_token"] * 12 * 4 * 64
    # finished points come back from the store without training (a resumed ladder, another experiment)
    import openk3.train.trainer as trainer

    monkeypatch.setattr(trainer, "train", lambda *a, **k: (_ for _ in ()).throw(AssertionError("retrained")))
    assert a.point("k3", 32, 12, 3e-3, 0) == long_branched
    assert PointStore(tmp_path / "a", TINY).point("k3", 32, 8, 3e-3, 0)["steps"] == 8
    # other shared settings are another store key: never mixed up
    other = PointStore(tmp_path / "a", LadderSettings(**{**TINY.__dict__, "seq_len": 32}))
    assert other.done("k3", 32, 12, 3e-3, 0) is None


# ---- fits --------------------------------------------------------------------------------------------

def _points(m: float, b: float = 0.1, noise: float = 0.0, seeds: int = 1, b_base: float | None = None, rng=None):
    rng = rng or np.random.default_rng(0)
    pts = []
    for arm, a in (("t", 10.0), ("base", 10.0 * m ** (b if b_base is None else b_base))):
        bb = b if arm == "t" or b_base is None else b_base
        for w, c in ((32, 1e11), (64, 4e11), (96, 1.6e12), (128, 6.4e12)):
            for sd in range(seeds if w == 32 else 1):
                loss = a * c ** -bb * math.exp(rng.normal(0, noise) if noise else 0.0)
                pts.append({"arm": arm, "width": w, "steps": 100, "compute": c, "loss": loss, "seed": sd})
    return pts


def test_fit_recovers_a_known_multiplier_exactly_without_noise():
    f = fit_pair(_points(2.5), treatment="t", baseline="base", replicates=200)
    assert f["multiplier"]["estimate"] == pytest.approx(2.5, rel=1e-6)
    assert f["free"]["b_treatment"] == pytest.approx(0.1, rel=1e-6)
    for r in f["free"]["m_of_L"]:  # equal exponents: the same m at every loss
        assert r["estimate"] == pytest.approx(2.5, rel=1e-6)


def test_fit_interval_covers_the_truth_under_noise_and_says_when_it_cannot_resolve():
    hits = 0
    for k in range(20):
        pts = _points(1.5, noise=0.01, seeds=3, rng=np.random.default_rng(k))
        f = fit_pair(pts, treatment="t", baseline="base", seed=k, replicates=300)
        lo, hi = f["multiplier"]["ci95"]
        hits += lo <= 1.5 <= hi
        assert f["noise"]["seeds"] is not None
    assert hits >= 16  # ~95 % nominal coverage; 16 of 20 allows for the bootstrap's small-sample optimism
    # with much more noise the minimal detectable multiplier grows beyond the effect
    f = fit_pair(_points(1.1, noise=0.05, rng=np.random.default_rng(1)), treatment="t", baseline="base",
                 replicates=300)
    assert f["noise"]["from"] == "fit residuals" and f["multiplier"]["mdm"] > 1.1


def test_fit_reports_the_drift_when_exponents_differ():
    # the baseline reaches the treatment's loss at 2x its compute at C = 1e12, with a shallower slope
    cs = (1e11, 4e11, 1.6e12, 6.4e12)
    pts = [{"arm": "t", "width": i, "steps": 1, "compute": c, "loss": 10 * c ** -0.1, "seed": 0}
           for i, c in enumerate(cs)]
    pts += [{"arm": "base", "width": i, "steps": 1, "compute": c,
             "loss": 10 * (1e12 / 2) ** -0.1 * (c / 1e12) ** -0.08, "seed": 0} for i, c in enumerate(cs)]
    f = fit_pair(pts, treatment="t", baseline="base", replicates=100)
    assert f["loss_overlap"]
    ms = [r["estimate"] for r in f["free"]["m_of_L"]]
    assert ms == sorted(ms) or ms == sorted(ms, reverse=True)
    assert max(ms) / min(ms) > 1.05 and f["exponents_differ"]


def test_fit_needs_two_compute_values_per_arm():
    pts = [p for p in _points(2.0) if p["arm"] == "t" or p["width"] == 32]
    with pytest.raises(ValueError, match="base"):
        fit_pair(pts, treatment="t", baseline="base")


# ---- the experiments -----------------------------------------------------------------------------

def test_scaling_experiments_are_listed_with_their_profiles():
    from openk3.experiments import EXPERIMENTS, experiment

    for name in ("k3-vs-k2", "attnres", "latent-moe", "kda-hybrid", "muon-vs-adamw"):
        assert name in EXPERIMENTS
        assert set(experiment(name).PROFILES) == {"smoke", "full", "gpu"}


@pytest.mark.slow
def test_k3_vs_k2_and_attnres_smoke(tmp_path):
    """The acceptance runs (smoke profile, seed 0), sharing one point store: result.json valid, points of both
    arms FLOP-matched within 10 % at each width, loss falling with compute in each arm, a finite multiplier
    with an interval, the plot; the k3 arm's points are trained once."""
    from openk3.experiments import run_experiment

    results = {}
    for name in ("k3-vs-k2", "attnres"):
        results[name] = run_experiment(name, "smoke", 0, tmp_path / name, say=lambda m: None)
    for name, d in results.items():
        assert (tmp_path / name / "result.png").stat().st_size > 10_000
        on_disk = json.loads((tmp_path / name / "result.json").read_text())
        assert on_disk["experiment"] == name and on_disk["verdict"] in ("supported", "not supported")
        for key in ("claim", "metric", "profile", "seeds", "treatment", "control", "effect", "seconds",
                    "published", "points", "fit", "matches_published"):
            assert key in on_disk, key
        arms = {p["arm"] for p in d["points"]}
        assert arms == {d["treatment"]["name"], d["control"]["name"]}
        for p in d["points"]:
            for key in ("arm", "params", "active_params", "flops_per_token", "tokens", "compute", "loss", "seed",
                        "lr"):
                assert key in p
        for w in {p["width"] for p in d["points"]}:
            f = {p["arm"]: p["flops_per_token"] for p in d["points"] if p["width"] == w}
            assert len(f) == 2 and max(f.values()) / min(f.values()) < 1.10
        for arm in arms:
            mine = sorted((p["compute"], p["loss"]) for p in d["points"] if p["arm"] == arm)
            assert mine[-1][1] < mine[0][1]
        assert d["fit"]["free"]["b_treatment"] > 0 and d["fit"]["free"]["b_baseline"] > 0
        e = d["effect"]
        assert all(math.isfinite(v) and v > 0 for v in (e["estimate"], *e["ci95"]))
        assert e["ci95"][0] <= e["estimate"] <= e["ci95"][1]
    k3_points = [p for p in (tmp_path / "points" / "points").iterdir() if p.is_dir() and p.name.startswith("k3-w")]
    assert len(k3_points) == 4  # 2 widths x 2 budgets, shared by both experiments
    from openk3.experiments.scaling import summary_plots

    paths = summary_plots(list(results.values()), tmp_path / "figures")
    assert [p.rsplit("/", 1)[1] for p in paths] == ["scaling_ladder.png"]  # (smoke has no LR sweep)


def test_family_presets_on_the_command_line(tmp_path, capsys):
    """`FAMILY@WIDTH[xLAYERS]` works wherever a preset does; `openk3 train` also takes the family's training
    options (k2-style: sign-rule balancing), and the user's overrides still win."""
    from openk3.__main__ import main

    assert main(["info", "--preset", "k2-style@64x5", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_mla_layers"] == 5 and info["num_kda_layers"] == 0
    out = tmp_path / "run"
    assert main(["train", "--preset", "k3-adamw@32x5", "--out", str(out), "--max-steps", "2", "--threads", "1",
                 "data.max_bytes=200000", "batch_size=2", "seq_len=64", "eval_batches=1", "samples=0"]) == 0
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["optim"]["muon"] is False and saved["model"]["hidden_size"] == 32
    out2 = tmp_path / "run2"
    assert main(["train", "--preset", "k2-style@32x5", "--out", str(out2), "--max-steps", "1", "--threads", "1",
                 "data.max_bytes=200000", "batch_size=2", "seq_len=64", "eval_batches=1", "samples=0",
                 "balance=qb"]) == 0
    assert json.loads((out2 / "train_config.json").read_text())["balance"] == "qb"
    assert main(["info", "--preset", "k2-style@sixty"]) == 2
    assert "FAMILY@WIDTH" in capsys.readouterr().err


def test_plan_audit_cites_measured_multipliers(tmp_path, capsys):
    """`openk3 plan --audit --evidence DIR`: the published figure beside the measured one with its interval;
    anything that is not a scaling-lab result.json is refused naming the file."""
    from openk3.__main__ import main

    d = {"experiment": "attnres", "profile": "full", "seeds": [0, 1, 2], "verdict": "not supported",
         "treatment": {"name": "k3"}, "control": {"name": "k3-no-attnres"}, "published": 1.25,
         "effect": {"estimate": 1.1, "ci95": [0.9, 1.4]}, "fit": {}, "resolution": "cannot resolve the claim"}
    (tmp_path / "attnres").mkdir()
    (tmp_path / "attnres" / "result.json").write_text(json.dumps(d))
    assert main(["plan", "--audit", "--evidence", str(tmp_path / "attnres"), "--json"]) == 0
    items = json.loads(capsys.readouterr().out)
    mine = [i for i in items if "Attention Residuals" in i["claim"]]
    assert len(mine) == 1 and mine[0]["claimed_value"] == 1.25 and mine[0]["corrected_value"] == 1.1
    assert "1.10x [0.90, 1.40]" in mine[0]["corrected"] and "cannot resolve" in mine[0]["reason"]
    (tmp_path / "other.json").write_text(json.dumps({"experiment": "rl-heldout", "effect": {}}))
    assert main(["plan", "--audit", "--evidence", str(tmp_path / "other.json")]) == 2
    assert "other.json" in capsys.readouterr().err
    assert main(["plan", "--evidence", str(tmp_path / "attnres")]) == 2


def test_summary_plots_draw_the_ladder_and_the_lr_sweeps(tmp_path):
    from openk3.experiments.scaling import summary_plots

    pts = _points(2.0)
    sweep = {"t": {"points": [{"width": 32, "lr": lr, "loss": 3 + abs(math.log(lr / 3e-3)), "steps": 1, "seed": 0}
                              for lr in (1.5e-3, 3e-3, 6e-3)]}}
    paths = summary_plots([{"points": pts, "lr_sweep": sweep}], tmp_path)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["scaling_ladder.png", "scaling_lr.png"]
    assert all((tmp_path / name).stat().st_size > 10_000 for name in ("scaling_ladder.png", "scaling_lr.png"))


def test_a_point_of_a_family_changed_since_is_trained_again(tmp_path, monkeypatch):
    """Point keys name the arm, not its config: when a family's definition changes in the code, its old points
    are moved aside instead of being reused (the first all-MLA arm was NoPE; reusing it would have been wrong)."""
    import dataclasses

    from openk3.scaling import families

    store = PointStore(tmp_path / "s", TINY, say=lambda m: None)
    first = store.point("k3-swiglu", 32, 4, 3e-3, 0)
    assert store.done("k3-swiglu", 32, 4, 3e-3, 0) == first
    changed = dataclasses.replace(families.FAMILIES["k3-swiglu"], recipe=lambda c: c.replace(hidden_act="silu",
                                                                                                 num_shared_experts=1))
    monkeypatch.setitem(families.FAMILIES, "k3-swiglu", changed)
    families.matched_config.cache_clear()
    assert store.done("k3-swiglu", 32, 4, 3e-3, 0) is None
    assert [p.name.endswith(".stale-0") for p in (tmp_path / "s" / "points").iterdir() if p.is_dir()] == [True]
    again = store.point("k3-swiglu", 32, 4, 3e-3, 0)
    assert again["params"] < first["params"]
    # the family's training options count as its definition too
    options = dataclasses.replace(changed, train_overrides={"balance": "sign"})
    monkeypatch.setitem(families.FAMILIES, "k3-swiglu", options)
    assert store.done("k3-swiglu", 32, 4, 3e-3, 0) is None
    families.matched_config.cache_clear()
