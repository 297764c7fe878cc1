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
    trunk_read = m["trunk_bytes"] + m["embedding_bytes"] / 2 + 7168 * 2  # lm_head + one embedding row (bf16)
    experts = 92 * 16 * 17_547_264
    state = 2 * (m["kda_state_bytes_per_sequence"] + m["kda_conv_bytes_per_sequence"])
    mla = 27_648 * 4096
    assert perf["decode_bytes_per_step"] == pytest.approx(trunk_read + experts + state + mla, rel=1e-12)
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


# ---- review: the worked example by hand, layouts, bad input, awkward hardware, docs in step ----------

def test_worked_example_by_hand_from_spec_numbers():
    """docs/planner.md's B300 example recomputed from spec §1.3/§2/§8 constants only (not the planner's
    memory dict): TP8, eight 128K sequences, MLA latent on every TP rank, KDA state split by heads."""
    r = plan("k3", hardware_key="b300", serve_spec=ServeSpec(context=131072, concurrency=8))
    hw, B, ctx = hardware.get("b300"), 8, 131072
    trunk = 113_509_540_864  # non-routed bf16 + fp32 islands = text total_size - 92 x 896 x 17,547,264
    assert trunk == 1_559_965_606_912 - 92 * 896 * 17_547_264 == r["memory"]["non_routed_bytes"]
    trunk_read = trunk - 163840 * 7168 * 2 + B * 7168 * 2  # the embedding table: only B rows
    distinct = 896 * (1 - (1 - 16 / 896) ** B)
    kda, conv, mla = 69 * 96 * 128 * 128 * 4, 69 * 3 * 12288 * 3 * 2, 24 * 576 * 2 * ctx
    experts = 92 * distinct * 17_547_264
    per_dev = (experts + trunk_read + B * 2 * (kda + conv)) / 8 + B * mla  # latent replicated on 8 ranks
    comm = B * 93 * 2 * (2 * 7168) * 2 * 7 / 8 / hw.interconnect_bandwidth
    step = per_dev / hw.memory_bandwidth + comm
    p = r["performance"]
    assert p["decode_bytes_per_step"] == pytest.approx(experts + trunk_read + B * (2 * (kda + conv) + mla), rel=1e-12)
    assert p["decode_step_ms"] == pytest.approx(1e3 * step, rel=1e-12) and p["decode_bound"] == "memory"
    assert r["cost"]["usd_per_million_output_tokens"] == pytest.approx(8 * 6.125 / (B / step * 3600) * 1e6)
    dev = r["deployment"]["per_device_bytes"]
    assert dev["mla_cache"] == B * mla and dev["kda_state"] == B * (kda + conv) / 8
    assert dev["weights"] == pytest.approx(1_559_965_606_912 / 8)
    free = 0.9 * hw.memory_bytes - dev["weights"] - dev["activations"]
    assert r["deployment"]["max_concurrency_at_context"] == int(free // ((kda + conv) / 8 + mla)) == 17


def test_layout_ep_per_stage_nodes_and_forced_counts():
    k3 = preset("k3")
    lay = serve.plan(k3, hardware.get("b200"), ServeSpec())["deployment"]["layout"]
    # a layer's experts live in its stage: EP is the stage's 8 GPUs, not all 16
    assert lay == {"devices": 16, "tp": 8, "pp": 2, "ep": 8, "nodes": 2, "attention": "tp"}
    lay = serve.plan(k3, hardware.get("rtx4090"), ServeSpec())["deployment"]["layout"]
    assert lay["tp"] == 4 and lay["nodes"] == lay["pp"]  # TP4 on a six-GPU box: one stage per box
    odd = serve.plan(k3, hardware.get("h100"), ServeSpec(devices=3))
    assert odd["deployment"]["layout"]["tp"] == 1 and odd["deployment"]["layout"]["pp"] == 3
    assert odd["deployment"]["fits"] is False and odd["deployment"]["max_concurrency_at_context"] == 0
    with pytest.raises(ValueError, match="devices 1000 .*PP125.*at most 744"):
        serve.plan(k3, hardware.get("h100"), ServeSpec(devices=1000))


def test_dp_attention_capacity_and_decode_compute():
    """DP attention: whole sequences per rank (capacity adds up over a stage's ranks, whatever the batch);
    at batch 1 one rank runs the trunk and attention alone, only the experts are shared."""
    cfg, hw = preset("k3"), hardware.get("b300")
    one, eight = (serve.plan(cfg, hw, ServeSpec(context=8192, concurrency=c, devices=16, attention="dp"))
                  for c in (1, 8))
    assert one["deployment"]["max_concurrency_at_context"] == eight["deployment"]["max_concurrency_at_context"]
    m, dev = one["memory"], one["deployment"]["per_device_bytes"]
    free = 0.9 * hw.memory_bytes - dev["weights"] - dev["activations"]
    per_seq = (m["kda_state_bytes_per_sequence"] + m["kda_conv_bytes_per_sequence"]
               + m["mla_cache_bytes_per_sequence"]) / 2
    assert one["deployment"]["max_concurrency_at_context"] == 8 * int(free // per_seq)
    slow = serve.plan(cfg, hw, ServeSpec(context=8192, concurrency=1, devices=16, attention="dp", mfu=1e-3))
    fl = slow["performance"]["decode_flops_breakdown"]
    compute = fl["routed"] / (1e-3 * hw.flops["fp4"]) / 16 + fl["other"] / (1e-3 * hw.flops["bf16"]) / 2
    assert slow["performance"]["decode_bound"] == "compute"
    assert slow["performance"]["decode_step_ms"] == pytest.approx(1e3 * 2 * compute, rel=1e-3)  # + a tiny comm


def test_time_to_first_token_fills_the_pipeline():
    r = serve.plan(preset("k3"), hardware.get("h200"), ServeSpec(context=131072))
    p, pp = r["performance"], r["deployment"]["layout"]["pp"]
    assert pp == 2
    assert p["time_to_first_token_s"] == pytest.approx((131072 / 8192 + pp - 1) * 8192 / p["prefill_tokens_per_s"])


@pytest.mark.parametrize("key,args", [
    ("rtx4090", dict(attention="dp")), ("rtx4090", dict(context=4096)), ("m3-ultra", {}), ("cpu-ddr5", {}),
    ("h100", dict(devices=3)), ("gb200", dict(concurrency=512, context=8192)), ("a100", dict(usable_memory=1e-6)),
    ("h200", dict(context=10**12)), ("mi300x", dict(expert_format="int4", trunk_format="int8"))])
def test_awkward_plans_are_finite_and_render(key, args):
    r = plan("k3", hardware_key=key, serve_spec=ServeSpec(**args))
    text = json.dumps(r, allow_nan=False)  # NaN or inf would raise here
    json.loads(text, parse_float=lambda v: float(v) if float(v) >= 0 else pytest.fail(f"negative {v}"),
               parse_int=lambda v: int(v) if int(v) >= 0 else pytest.fail(f"negative {v}"))
    from openk3.plan import report

    out = report.text(r)
    assert "Deployment on" in out and not any(w in out.split() for w in ("nan", "inf", "$inf"))
    if not r["deployment"]["fits"] and "layout" not in r["deployment"]:
        assert "need" in r["deployment"]["reason"] and "performance" not in r


def test_multi_machine_apple_and_small_models():
    m3 = plan("k3", hardware_key="m3-ultra", serve_spec=ServeSpec())
    assert m3["deployment"]["layout"] == {"devices": 4, "tp": 1, "pp": 4, "ep": 1, "nodes": 4, "attention": "tp"}
    assert m3["performance"]["decode_comm_ms"] == 0  # no TP over Thunderbolt; PP hand-offs are not modelled
    nano = plan("nano", hardware_key="cpu-ddr5", serve_spec=ServeSpec())
    assert nano["deployment"]["layout"]["devices"] == 1 and nano["train"]["gpus"] == 1


def _main(capsys, *args):
    import openk3.__main__ as cli

    try:
        rc = cli.main(["plan", *map(str, args)])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    bad_json, wrong_type = tmp_path / "bad.json", tmp_path / "wrong.json"
    bad_json.write_text("{not json")
    cfg = preset("nano").to_dict()
    cfg["linear_attn_config"]["full_attn_layers"] = 4
    wrong_type.write_text(json.dumps(cfg))
    cases = [
        (["--context", 0], "context"), (["--concurrency", -1], "concurrency"), (["--usable", 1.5], "usable_memory"),
        (["--mbu", 0], "mbu"), (["--mfu", "nan"], "mfu"), (["--devices", 0], "devices"),
        (["--devices", 10**6], "devices 1000000"), (["--prefill-chunk", 0], "prefill_chunk"),
        (["--train-tokens", -5], "tokens"), (["--train-tokens", "inf"], "tokens"), (["--seq-len", 0], "seq_len"),
        (["--micro-batch-tokens", 0], "micro_batch_tokens"), (["--train-mfu", 2], "training mfu"),
        (["--train-gpus", 0], "gpus"), (["--set", "foo"], "foo"), (["--set", "num_experts=abc"], "num_experts"),
        (["--set", "linear_attn_config=5"], "linear_attn_config"), (["--set", "moe_layer_freq=x"], "moe_layer_freq"),
        (["--set", "num_shared_experts=-1"], "num_shared_experts"),
        (["--set", "num_hidden_layers=1000000000"], "num_hidden_layers"),
        (["--config", "/nonexistent.json"], "/nonexistent.json"), (["--config", tmp_path], str(tmp_path)),
        (["--config", bad_json], str(bad_json)), (["--config", wrong_type], "linear_attn_config.full_attn_layers"),
        (["--hardware", "nope"], "nope"), (["--preset", "foo"], "foo"),
        (["--plot", tmp_path / "missing" / "x.png"], "--plot"), (["--plot", tmp_path], "--plot"),
        (["--context", "abc"], "--context"),
    ]
    for args, needle in cases:
        rc, out, err = _main(capsys, *args)
        assert rc == 2, (args, rc, err)
        last = err.strip().splitlines()[-1]  # argparse's own errors print the usage above it
        assert needle in last and last.startswith("openk3 plan: error:") and "Traceback" not in err, (args, err)
        assert len(err.strip().splitlines()) == 1 or err.startswith("usage:"), (args, err)


def test_no_fit_prints_a_table_and_valid_json(capsys):
    rc, out, _ = _main(capsys, "--hardware", "rtx4090", "--usable", "0.001")
    assert rc == 0 and "fits  no:" in out and "Training" in out
    rc, out, _ = _main(capsys, "--hardware", "rtx4090", "--usable", "0.001", "--json")
    d = json.loads(out)
    assert rc == 0 and d["deployment"]["fits"] is False and "performance" not in d and d["train"]["gpus"] is None
    rc, out, _ = _main(capsys, "--train-gpus", "8")
    assert rc == 0 and "does NOT fit" in out


def test_plot_curve_is_the_planned_budget(tmp_path):
    from openk3.plan import report

    cfg, hw = preset("k3"), hardware.get("b300")
    for spec in (ServeSpec(context=131072, concurrency=8), ServeSpec(context=8192, concurrency=64, attention="dp")):
        r = serve.plan(cfg, hw, spec)
        lay = serve.Layout(**r["deployment"]["layout"])
        row = report.memory_curve(cfg, spec, [spec.context], lay)[0]
        total = sum(row[k] for k in ("weights", "activations", "kda_state", "mla_cache"))
        assert total == pytest.approx(r["deployment"]["per_device_bytes"]["total"] * lay.devices)
    png = tmp_path / "dp.png"
    report.plot_memory(plan("k3", hardware_key="b300", serve_spec=spec), cfg, hw, spec, str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_docs_worked_example_roofline_and_audit_are_current():
    from pathlib import Path

    from openk3.plan import report

    doc = (Path(__file__).resolve().parents[1] / "docs" / "planner.md").read_text()
    r = plan("k3", hardware_key="b300", serve_spec=ServeSpec(context=131072, concurrency=8))
    assert report.text(r) + "wrote docs/planner_memory.png\n" in doc, "docs/planner.md: rerun the worked example"
    cfg, hw = preset("k3"), hardware.get("b300")
    for c in (1, 16, 64):  # the "roofline against measured engines" table
        step = serve.plan(cfg, hw, ServeSpec(context=8704, concurrency=c))["performance"]["decode_step_ms"]
        assert f"| {step:.2f} ms |" in doc, c
    ttft = serve.plan(cfg, hw, ServeSpec(context=8192))["performance"]["time_to_first_token_s"]
    assert f"| {1e3 * ttft:.0f} ms |" in doc
    for it in audit.audit():
        assert f"| {it['claim']} | {it['claimed']} | {it['corrected']} |" in doc, it["claim"]


def test_format_overrides_leave_the_release_table_alone(capsys):
    """`--expert-format` overrides a copy of the release's formats: a later plan in the same process
    still prices the release (the table was once handed out and mutated)."""
    from openk3.__main__ import main

    assert main(["plan", "--expert-format", "int4", "--trunk-format", "fp8", "--json"]) == 0
    capsys.readouterr()
    assert plan("k3")["formats"]["experts"] == "mxfp4" and models.release_formats("k3")["trunk_format"] == "bf16"
