"""The planner (`openk3.plan`, `openk3 plan`): counts equal the model's own accounting, the release's
published sizes are reproduced, the roofline/layout arithmetic matches hand computations, the audit
recomputes every claim, and the CLI speaks tables, JSON and PNG without importing torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from openk3.config import PRESETS, preset
from openk3.model.accounting import count_params, flops_per_token, state_bytes
from openk3.model.model import K3ForCausalLM
from openk3.plan import ServeSpec, TrainSpec, audit, counts, hardware, models, plan, serve, train

ALL = [*PRESETS, *(f"{p}-kl" for p in PRESETS), "k2"]


@pytest.mark.parametrize("name", ALL)
def test_counts_equal_model_accounting(name):
    cfg = models.plan_preset(name)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    ours, theirs = counts.params(cfg), count_params(model)
    for field in ("total", "embedding", "lm_head", "routed_experts", "routed_active", "active",
                  "active_with_embedding"):
        assert getattr(ours, field) == getattr(theirs, field), field
    for seq in (1, 4096, 8191):
        assert counts.flops_per_token(cfg, seq) == flops_per_token(model, seq)
        assert counts.flops_per_token(cfg, seq, training=True) == flops_per_token(model, seq, training=True)
    st, sb = counts.state_sizes(cfg), state_bytes(model)
    assert st["kda_state_values_per_sequence"] * 4 == sb["kda_state_bytes_per_sequence"]
    assert st["kda_conv_values_per_sequence"] * 2 == sb["kda_conv_bytes_per_sequence"]
    assert st["mla_cache_values_per_token"] * 2 == sb["mla_cache_bytes_per_token"]
    # the tensor list is the model's parameter list, group by group (fp32 islands included)
    assert sum(t.numel for t in counts.tensors(cfg) if t.fp32) == sum(
        p.numel() for n, p in model.named_parameters() if n.endswith(("_conv1d.weight", "A_log", "dt_bias"))
        or (n.endswith("o_norm.weight") and "self_attn" in n)) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))


def test_optimizer_split_matches_trainer_grouping():
    from openk3.train.optim import OptimConfig, classify

    for name in ("nano", "small-kl"):
        cfg = preset(name)
        with torch.device("meta"):
            model = K3ForCausalLM(cfg)
        by = {"muon": 0, "adamw": 0}
        for n, p in model.named_parameters():
            by[classify(model, n, p, OptimConfig())["optimizer"]] += p.numel()
        assert train.optimizer_split(cfg) == by


def test_release_figures_reproduced():
    r = plan("k3")
    assert r["total_params"] == 2_779_484_478_208 and r["active_params"] == 104_189_614_848
    m = r["memory"]
    assert m["routed_experts_bytes"] == 92 * 896 * 17_547_264  # spec §6: 17,547,264 bytes per expert
    assert m["weights_bytes"] == 1_559_965_606_912  # the index's text total_size (spec §1.7), to the byte
    assert math.isclose(m["routed_experts_bytes"], 1.45e12, rel_tol=0.01)
    assert math.isclose(m["non_routed_bytes"], 115e9, rel_tol=0.02)  # 113.5 GB text (+0.9 GB vision = 114.4)
    assert m["kda_state_bytes_per_sequence"] == 69 * 96 * 128 * 128 * 4
    assert round(m["kda_state_bytes_per_sequence"] / 2**20) == 414
    assert m["mla_cache_bytes_per_token"] == 24 * 576 * 2 == 27_648
    assert r["num_kda_layers"] == 69 and r["num_mla_layers"] == 24


def test_k2_against_published():
    p = counts.params(models.k2())
    assert p.total == 1_026_408_232_448  # from K2's config.json; the report rounds to 1.04T
    assert math.isclose(p.total, 1.04e12, rel_tol=0.015)
    assert math.isclose(p.active_with_embedding, 32.6e9, rel_tol=0.01)
    assert counts.state_sizes(models.k2())["mla_cache_values_per_token"] * 2 == 61 * 576 * 2  # 70.3 KB/token


def test_decode_roofline_by_hand_batch_one():
    cfg, hw = preset("k3"), hardware.get("b300")
    spec = ServeSpec(context=4096, concurrency=1)
    r = serve.plan(cfg, hw, spec)
    m, lay, perf = r["memory"], r["deployment"]["layout"], r["performance"]
    assert lay == {"devices": 8, "tp": 8, "pp": 1, "ep": 8, "nodes": 1, "attention": "tp"}
    assert perf["decode_distinct_experts_per_layer"] == pytest.approx(16)
    trunk_read = m["trunk_bytes"] + m["embedding_bytes"] / 2
    experts = 92 * 16 * 17_547_264
    state = 2 * (m["kda_state_bytes_per_sequence"] + m["kda_conv_bytes_per_sequence"])
    mla = 27_648 * 4096
    assert perf["decode_bytes_per_step"] == pytest.approx(trunk_read + experts + state + mla)
    per_dev = experts / 8 + trunk_read / 8 + state / 8 + mla  # latent replicated on each TP rank
    comm = 93 * 2 * (2 * 7168) * 2 * 7 / 8 / hw.interconnect_bandwidth  # two ring all-reduces per layer, TP8
    assert perf["decode_comm_ms"] == pytest.approx(1e3 * comm)
    assert perf["decode_step_ms"] == pytest.approx(1e3 * (per_dev / hw.memory_bandwidth + comm))
    assert perf["decode_bound"] == "memory"
    c = r["cost"]
    assert c["usd_per_million_output_tokens"] == pytest.approx(
        8 * hw.price_per_hour / (perf["decode_tokens_per_s"] * 3600) * 1e6)


def test_distinct_experts_and_batching():
    cfg = preset("k3")
    assert serve.expected_distinct_experts(cfg, 1) == pytest.approx(16)
    assert serve.expected_distinct_experts(cfg, 10_000) == pytest.approx(896)
    hw = hardware.get("b300")
    one = serve.plan(cfg, hw, ServeSpec(context=8192, concurrency=1))["performance"]["decode_tokens_per_s"]
    many = serve.plan(cfg, hw, ServeSpec(context=8192, concurrency=64))["performance"]["decode_tokens_per_s"]
    assert 4 * one < many < 64 * one  # batching amortises the trunk; more distinct experts and caches per step


def test_mla_cache_replicated_across_tp_ranks():
    """SemiAnalysis: one B300 node holds one replica with ~3.25M tokens of cache room (landscape §4a);
    that is only true if the 576-wide latent is stored on each of the 8 TP ranks."""
    cfg, hw = preset("k3"), hardware.get("b300")
    r = serve.plan(cfg, hw, ServeSpec(context=131072, concurrency=1, usable_memory=1.0))
    tokens = r["deployment"]["max_concurrency_at_context"] * 131072
    assert 2.0e6 < tokens < 4.5e6
    dp = serve.plan(cfg, hw, ServeSpec(context=131072, concurrency=8, devices=8, attention="dp"))
    tp = serve.plan(cfg, hw, ServeSpec(context=131072, concurrency=8, devices=8))
    # data-parallel attention: one latent copy per sequence, but the trunk on every rank
    assert dp["deployment"]["per_device_bytes"]["mla_cache"] * 8 == tp["deployment"]["per_device_bytes"]["mla_cache"]
    assert dp["deployment"]["per_device_bytes"]["weights"] > tp["deployment"]["per_device_bytes"]["weights"]


def test_layout_fewest_devices_and_no_fit():
    cfg = preset("k3")
    h100 = hardware.get("h100")
    r = serve.plan(cfg, h100, ServeSpec(context=4096))
    lay = r["deployment"]["layout"]
    assert lay["tp"] == 8 and lay["devices"] % 8 == 0 and r["deployment"]["fits"]
    smaller = serve.layout_for(cfg, h100, lay["devices"] - 8, "tp")
    assert serve.per_device_bytes(cfg, ServeSpec(context=4096), r["memory"], smaller)["total"] > 0.9 * h100.memory_bytes
    tiny = serve.plan(preset("nano"), hardware.get("rtx4090"), ServeSpec(context=4096))
    assert tiny["deployment"]["layout"]["devices"] == 1
    none = serve.plan(cfg, hardware.get("rtx4090"), ServeSpec(context=1 << 20, concurrency=100_000))
    assert none["deployment"]["fits"] is False and "performance" not in none


def test_formats_change_bytes():
    cfg = preset("k3")
    bf16 = serve.memory(cfg, ServeSpec(expert_format="bf16"))
    mx = serve.memory(cfg, ServeSpec())
    assert bf16["routed_experts_bytes"] == 2 * 2_722_740_830_208
    assert mx["routed_experts_bytes"] * 32 == 17 * 2_722_740_830_208
    fp8 = serve.memory(cfg, ServeSpec(mla_cache_format="fp8", kda_state_format="bf16"))
    assert fp8["mla_cache_bytes_per_token"] == 13_824 and fp8["kda_state_bytes_per_sequence"] * 2 == \
        mx["kda_state_bytes_per_sequence"]
    with pytest.raises(ValueError, match="expert format 'mxfp5'.*mxfp4"):
        serve.memory(cfg, ServeSpec(expert_format="mxfp5"))
    with pytest.raises(ValueError, match="concurrency"):
        serve.memory(cfg, ServeSpec(concurrency=0))


def test_training_arithmetic():
    cfg, hw = preset("k3"), hardware.get("h100")
    t = train.plan(cfg, hw, TrainSpec(tokens=1e12, seq_len=8192, mfu=0.5))
    assert t["total_flops"] == counts.flops_per_token(cfg, 8192, training=True) * 1e12
    assert t["gpu_hours"] == pytest.approx(t["total_flops"] / (0.5 * hw.flops["bf16"]) / 3600)
    assert t["cost_usd"] == pytest.approx(t["gpu_hours"] * hw.price_per_hour)
    g = t["gpus"]
    budget = 0.9 * hw.memory_bytes
    assert t["fits"] and train.per_gpu_bytes(cfg, TrainSpec(seq_len=8192), g)["total"] <= budget
    assert train.per_gpu_bytes(cfg, TrainSpec(seq_len=8192), g - 8)["total"] > budget
    # Muon keeps one moment, AdamW two
    assert train.state_bytes(cfg, "adamw")["optimizer"] > train.state_bytes(cfg, "muon")["optimizer"]
    assert 6 * counts.params(cfg).active < counts.flops_per_token(cfg, 8192, training=True) < 7 * counts.params(
        cfg).active


def test_audit_recomputes_every_claim():
    items = audit.audit()
    assert len(items) == 9
    for it in items:
        assert set(it) >= {"claim", "claimed", "corrected", "reason"} and it["reason"]
    by = {it["claim"]: it for it in items}
    assert by["1.04 trillion parameters activated per token"]["corrected_value"] == 104_189_614_848
    assert by["37% activation ratio"]["corrected_value"] == pytest.approx(0.0375, abs=1e-4)
    assert by["1.04T active at FP16 is ~2.1 TB of GPU memory for weights"]["corrected_value"] == 1_559_965_606_912
    assert by["KV cache for 128K context adds 80-100 GB"]["corrected_value"] == pytest.approx(4.07e9, rel=0.01)
    assert by["8 H100 with INT4 quantization can fit it"]["corrected_value"] > 8
    assert by["27 H100s just to load the model"]["corrected_value"] >= 20
    flops = by["~475 tokens/s ideal peak on 8 H100 (2.08 TFLOPs per token)"]["corrected_value"]
    assert flops == counts.decode_flops_per_token(preset("k3"), 4096)["total"] and flops < 2.08e12 / 9
    assert by["$0.67 per 1,000 tokens, 134x GPT-4o"]["corrected_value"] < 0.67 / 100
    assert by["16 experts vs 8 is a 2x (or 3.2x) increase in active parameters"]["corrected_value"] == pytest.approx(
        1.5)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "openk3", "plan", *args], capture_output=True, text=True)


def test_cli_json_tables_png_and_no_torch(tmp_path):
    r = _cli("--preset", "k3", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("total_params", "active_params"):
        assert key in d
    for key in ("routed_experts_bytes", "non_routed_bytes", "kda_state_bytes_per_sequence",
                "mla_cache_bytes_per_token"):
        assert key in d["memory"]
    assert d["formats"] == {"experts": "mxfp4", "trunk": "bf16", "embeddings": "bf16", "kda_state": "fp32",
                            "mla_cache": "bf16", "conv_state": "bf16"}
    assert d["memory"]["weights_bytes"] == 1_559_965_606_912
    k2 = json.loads(_cli("--preset", "k2", "--json").stdout)
    assert k2["formats"]["experts"] == "fp8" and k2["memory"]["kda_state_bytes_per_sequence"] == 0
    a = _cli("--audit", "--json")
    assert a.returncode == 0 and isinstance(json.loads(a.stdout), list)
    png = tmp_path / "mem.png"
    t = _cli("--hardware", "b300", "--concurrency", "16", "--context", "8192", "--plot", str(png))
    assert t.returncode == 0, t.stderr
    assert "Memory (whole model)" in t.stdout and "Speed (roofline)" in t.stdout and "Training" in t.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    listing = _cli("--list-hardware").stdout
    assert all(key in listing for key in hardware.CATALOGUE) and "http" in listing
    code = ("import sys, openk3.__main__ as m; m.main(['plan', '--json']); m.main(['plan', '--audit']); "
            "sys.stderr.write(str('torch' in sys.modules))")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert probe.returncode == 0 and probe.stderr.strip().endswith("False"), probe.stderr


def test_cli_config_file_overrides_and_errors(tmp_path):
    path = tmp_path / "config.json"
    preset("small").to_json(path)
    r = _cli("--config", str(path), "--set", "num_experts=32", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["params"]["routed_experts"] == counts.params(preset("small").replace(num_experts=32)).routed_experts
    bad = _cli("--hardware", "h1000")
    assert bad.returncode == 2 and "h100" in bad.stderr
    bad = _cli("--set", "num_expertz=3")
    assert bad.returncode == 2 and "num_expertz" in bad.stderr
    path.write_text('{"vocab_size": 5}')
    bad = _cli("--config", str(path))
    assert bad.returncode == 2 and str(path) in bad.stderr


def test_docs_catalogue_is_current():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "planner.md").read_text()
    assert hardware.markdown_table().strip() in doc, "docs/planner.md: regenerate the catalogue section"
