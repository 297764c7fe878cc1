"""The decode and serving benchmarks run end to end at toy sizes (their numbers are not checked: no timed asserts),
so a change that breaks a benchmark script fails CI rather than the next person measuring."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from helpers import needs_vector_inductor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")


@needs_cc
def test_bench_mxfp4_decode_runs(tmp_path):
    import bench_mxfp4_decode

    out = bench_mxfp4_decode.main(["--presets", "nano", "--tokens", "1", "3", "--layers", "1", "--repeats", "1",
                                   "--forms", "--json", str(tmp_path / "r.json")])
    rows = out["rows"]
    assert [r["tokens"] for r in rows] == [1, 3] and all(r["relative_error"] < 1e-5 for r in rows)
    assert all("portable" in r["vs_forms"] for r in rows)  # the other forms ran (and agreed: checked inside)
    assert (tmp_path / "r.json").exists()
    assert rows[0]["packed_bytes_per_layer"] == 32 * 3 * 64 * 64 * 17 // 32  # 4.25 bits per weight


@needs_cc
def test_bench_decode_with_mxfp4_experts_runs():
    """openk3 on packed experts against transformers on the same values: the greedy tokens agree."""
    pytest.importorskip("transformers")
    import bench_decode

    out = bench_decode.main(["--preset", "nano-kl", "--experts", "mxfp4", "--batch", "1", "2", "--prompt-len", "8",
                             "--new-tokens", "4", "--repeats", "1", "--warmup", "0"])
    assert out["experts"] == "mxfp4"
    assert all(r["greedy_agreement"] == 1.0 for r in out["batches"]), [r["greedy_agreement"] for r in out["batches"]]


def test_bench_mla_runs(tmp_path):
    import bench_mla

    out = bench_mla.main(["--presets", "nano", "--lengths", "5,33", "--repeats", "1",
                          "--json", str(tmp_path / "r.json")])
    assert [r["T"] for r in out["runs"]] == [5, 33] and (tmp_path / "r.json").exists()
    assert set(out["runs"][0]["ms"]) == {"naive", "sdpa, values as they are", "openk3"}


def test_bench_linear_layout_runs(tmp_path):
    import bench_linear_layout

    out = bench_linear_layout.main(["--presets", "nano-kl", "--batch", "1", "3", "--copies", "1", "--repeats", "1",
                                    "--json", str(tmp_path / "r.json")])
    rows = out["presets"]["nano-kl"]
    steps = [r for r in rows if "step_us" in r]
    assert [r["batch"] for r in steps] == [1, 3] and all(r["step_us"]["column-major"] > 0 for r in steps)
    assert sum(r["linears"] for r in rows if r.get("batch") == 1 and "linears" in r) > 30


@needs_vector_inductor
def test_bench_linear_layout_bf16_reduce_contenders_run_and_agree():
    import bench_linear_layout

    # one shape, compiled both ways; bench_shape raises if the bf16 reduce disagrees with float32 linears on the
    # same bf16 values
    r = bench_linear_layout.bench_shape(96, 40, 1, copies=2, repeats=1, dtype=torch.float32, bf16_reduce=True)
    assert set(r["us"]) == {"row-major", "column-major", "column-major, compiled", "bf16 reduce, compiled"}
    assert all(v > 0 for v in r["us"].values()) and r["bf16_speedup"] > 0
    with pytest.raises(ValueError, match="--dtype float32"):
        bench_linear_layout.bench_shape(8, 8, 1, copies=1, repeats=1, dtype=torch.float64, bf16_reduce=True)


def test_bench_serve_runs(tmp_path, capsys):
    """The serving benchmark starts `openk3 serve` in its own process, streams through it and stops it, and
    runs the same requests through an in-process engine: one row per contender and level, and the overhead."""
    import bench_serve

    out = bench_serve.main(["--preset", "nano", "--concurrency", "1", "8", "--requests", "3", "--prompt-len", "8",
                            "--max-tokens", "4", "--repeats", "2", "--json", str(tmp_path / "r.json")])
    levels, local = out["levels"], out["inprocess_levels"]
    assert [r["concurrency"] for r in levels] == [1, 8] and (tmp_path / "r.json").exists()
    assert [r["concurrency"] for r in local] == [1, 8]
    # medians of 2 runs of 3 requests each, every one of them 4 tokens
    assert all(r["repeats"] == 2 and r["completed"] == 6 and r["failed"] == 0 for r in levels + local), \
        [r["errors"] for r in levels + local]
    assert all(r["output_tokens_per_s"] > 0 and r["ttft_ms"]["p50"] > 0 for r in levels + local)
    assert all(r["tpot_ms"]["p50"] > 0 and r["e2e_ms"]["p50"] >= r["ttft_ms"]["p50"] for r in local)
    assert all(r["client_cpu_share"] > 0 for r in levels) and all("client_cpu_share" not in r for r in local)
    assert all(r["overhead"] == 1 - r["output_tokens_per_s"] / lr["output_tokens_per_s"]
               for r, lr in zip(levels, local, strict=True))
    text = capsys.readouterr().out
    assert text.count("| in-process |") == 2 and text.count("| HTTP |") == 2
    assert "HTTP + streaming overhead at 1 clients" in text and "target <= 10 %" not in text.split("at 8 clients")[0]
    assert "target <= 10 %: " in text.split("at 8 clients")[1]  # flagged at 8 clients only


def test_bench_serve_inprocess_closed_loop():
    """The in-process contender keeps exactly `concurrency` requests in flight and counts every token."""
    import bench_serve

    import openk3
    from openk3.tokenizer import Tokenizer

    llm = openk3.LLM(openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0),
                     Tokenizer({bytes([b]): b for b in range(256)}), max_num_seqs=4)
    engine, in_flight = llm.engine, []
    step = engine.step

    def counting_step():
        in_flight.append(len(engine.waiting) + len(engine.running))
        return step()

    engine.step = counting_step
    row = bench_serve.run_inprocess_level(engine, 2, 5, 6, 3)
    assert row["completed"] == 5 and row["failed"] == 0 and not engine.has_unfinished()
    # refilled as soon as one finishes: 2 in flight until the queue runs dry, then only the tail drains
    assert set(in_flight) == {1, 2} and in_flight == sorted(in_flight, reverse=True)
    assert row["output_tokens_per_s"] == 5 * 3 / row["wall_s"]


@pytest.mark.slow(seconds=20)  # one 1-process and one 2-process (torchrun) run of nano, ~10 s
def test_bench_distributed_runs(tmp_path):
    import bench_distributed

    out = bench_distributed.main(["--rows", "1", "--seq-len", "32", "--steps", "1", "--warmup", "1",
                                  "--json", str(tmp_path / "d.json")])
    assert [(r["world"], r["layout"]) for r in out["runs"]] == [(1, "one process"), (2, "FSDP2"), (2, "FSDP2 + EP")]
    assert out["runs"][1]["tokens_per_step"] == 2 * out["runs"][0]["tokens_per_step"]  # rows are per rank
    assert out["speedup"] > 0 and out["efficiency"] == out["speedup"] / 2
    comm = out["comm_bytes_per_rank_step"]
    assert comm["fsdp"] > comm["muon"] > 0 and comm["total"] > comm["fsdp"] and comm["all_to_all"] == 0
    ep = out["runs"][2]["comm_bytes_per_rank_step"]
    assert ep["all_to_all"] > 0 and ep["fsdp"] < comm["fsdp"] and ep["muon"] == comm["muon"]
    assert json.loads((tmp_path / "d.json").read_text())["runs"] == out["runs"]


def test_bench_structured_runs():
    import bench_structured

    out = bench_structured.main(["--batch", "1", "2", "--new-tokens", "4", "--repeats", "1", "--skip-k3-vocab"])
    rows = out["rows"]
    assert [(r["batch"], r["grammar"]) for r in rows] == [(1, "none"), (1, "JSON schema"), (2, "none"),
                                                          (2, "JSON schema")]
    assert all(r["decode_tok_s"] > 0 for r in rows) and rows[1]["mask_us_per_row_token"] > 0


def test_bench_threads_runs():
    """Each cell a fresh process with its own OMP settings; the thread count it asked for is the one it ran."""
    import bench_threads

    rows = bench_threads.main(["seq_len=16", "batch_size=1", "--steps", "1", "--busy", "0", "--threads", "2",
                               "--wait", "PASSIVE"])
    assert [(r["busy"], r["passive"], r["threads"], r["threads_seen"]) for r in rows] == [(0, True, 2, 2)]
    assert rows[0]["tokens_per_s"] > 0
