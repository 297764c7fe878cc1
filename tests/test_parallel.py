"""Data parallelism on torch.distributed (issue 19; openk3/parallel/): the mesh's rules and the equivalence of
2 gloo processes with one process on the same global batch (tests/parallel_worker.py, under torchrun)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openk3.parallel.mesh import Mesh, ParallelConfig, init_mesh, null_mesh
from openk3.train.config import RESUME_FREE, TrainConfig, apply_overrides

WORKER = Path(__file__).with_name("parallel_worker.py")
ROOT = Path(__file__).resolve().parents[1]


# ---- the mesh's rules ----------------------------------------------------------------------------------

def test_degrees_are_checked_against_the_world_and_the_batch():
    with pytest.raises(ValueError, match=r"parallel.dp_shard must be an integer >= 1, got 0"):
        ParallelConfig(dp_shard=0)
    with pytest.raises(ValueError, match="torchrun --standalone --nproc_per_node 2"):
        ParallelConfig(dp_shard=2).check(1)
    with pytest.raises(ValueError, match=r"multiply to 4 \(e.g. parallel.dp_shard=4\)"):
        ParallelConfig(dp_shard=2).check(4)
    with pytest.raises(ValueError, match="batch_size 6 is the global batch .* multiple of 4"):
        ParallelConfig(dp_shard=2, dp_replicate=2).check(4, batch_size=6)
    with pytest.raises(ValueError, match="parallel.cp=2: cp parallelism is not implemented yet"):  # by name
        ParallelConfig(dp_shard=2, cp=2).check(4)
    ParallelConfig(pp=2).check(2, batch_size=4, grad_accum=2)  # fits: pipeline stages alone
    with pytest.raises(ValueError, match="this version runs pipeline parallelism alone"):
        ParallelConfig(dp_shard=2, pp=2).check(4)
    with pytest.raises(ValueError, match=r"parallel.pp_cuts=\[3, 6\]: parallel.pp=2 stages need 1 cut"):
        ParallelConfig(pp=2, pp_cuts=(3, 6)).check(2)
    ParallelConfig(dp_shard=2, dp_replicate=2).check(4, batch_size=8)  # fits
    ParallelConfig(dp_shard=2, ep=2).check(2, batch_size=8)  # fits: experts over the whole shard group
    with pytest.raises(ValueError, match=r"parallel.ep=3 must divide parallel.dp_shard x parallel.cp = 2"):
        ParallelConfig(dp_shard=2, ep=3).check(2)
    for layout in ({"dp_shard": 4, "ep": 2}, {"dp_shard": 2, "dp_replicate": 2, "ep": 2}):  # not yet
        with pytest.raises(ValueError, match="parallel.ep = parallel.dp_shard, parallel.dp_replicate=1"):
            ParallelConfig(**layout).check(4)


def test_one_process_gets_the_null_mesh_whose_collectives_are_identities(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    mesh = init_mesh(ParallelConfig(), batch_size=5)
    assert not mesh.distributed and mesh.world_size == mesh.dp_size == 1 and mesh.is_main
    t = torch.arange(6.0).reshape(3, 2)
    assert mesh.all_reduce_sum(t) is t and mesh.all_gather_rows(t) is t and mesh.batch_rows(5) == slice(0, 5)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        init_mesh(ParallelConfig())
    rank1 = Mesh(ParallelConfig(dp_shard=2), rank=1)
    assert rank1.batch_rows(8) == slice(4, 8)


def test_the_config_section_round_trips_and_may_change_on_resume():
    cfg = apply_overrides(TrainConfig(), ["parallel.dp_shard=2", "parallel.dp_replicate=2"])
    assert cfg.parallel == ParallelConfig(dp_shard=2, dp_replicate=2)
    assert TrainConfig.from_dict(cfg.to_dict()).parallel == cfg.parallel
    assert TrainConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "parallel"}).parallel == \
        ParallelConfig()  # runs saved before the section existed
    assert {"parallel.dp_shard", "parallel.dp_replicate"} <= RESUME_FREE
    with pytest.raises(ValueError, match="parallel.dp_shard"):
        apply_overrides(TrainConfig(), ["parallel.dp_shard=0"])


def test_what_data_parallelism_does_not_do_yet_is_refused():
    from openk3.config import preset
    from openk3.model.model import K3ForCausalLM
    from openk3.train.optim import build_optimizer
    from openk3.train.trainer import Trainer

    model = K3ForCausalLM.build(preset("nano"), seed=0)
    two = Mesh(ParallelConfig(dp_shard=2))  # two data ranks (no process group needed to refuse)
    for override in ("qk_clip=true", "aux_loss_coef=0.01"):
        cfg = apply_overrides(TrainConfig(), [override])
        with pytest.raises(ValueError, match="with data parallelism is not implemented yet"):
            Trainer(model, None, build_optimizer(model, cfg.optim), None, cfg, mesh=two)
    assert null_mesh().dp_size == 1


# ---- 2 processes == 1 process -------------------------------------------------------------------------

def _run(out: Path, world: int, layout: str = "shard", steps: int = 3, accum: int = 1) -> dict:
    """parallel_worker.py on `world` processes: one run, or with `layout` as space-separated LAYOUT:N specs,
    those runs in turn in the same processes ({spec: result})."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    args = [str(out), str(steps), *layout.split()] if ":" in layout else [str(out), str(steps), layout, str(accum)]
    if world == 1:  # the worker's run in this process (no interpreter and torch start-up; the same code)
        import parallel_worker

        parallel_worker.run(str(out), steps, layout, accum)
        return torch.load(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", str(WORKER),
           *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("w1") / "w1.pt", 1)


def assert_same_run(single: dict, got: dict) -> None:
    for a, b in zip(single["losses"], got["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (single["losses"], got["losses"])
    for a, b in zip(single["grad_norms"], got["grad_norms"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)
    assert set(got["params"]) == set(single["params"])
    worst = max((single["params"][k] - got["params"][k]).abs().max().item() for k in single["params"])
    assert worst <= 1e-6, worst
    assert single["biases"] and set(got["biases"]) == set(single["biases"])
    bias = max((single["biases"][k] - got["biases"][k]).abs().max().item() for k in single["biases"])
    assert bias <= 1e-5, bias  # QB's quantile of the gathered scores; the scores differ in the last bits
    # the run moved: the comparison is not of untrained weights
    assert single["losses"][0] != single["losses"][-1]


def test_four_micro_batches_equal_one_batch(single, tmp_path):
    """grad_accum=4 (one row at a time) in one process: the same steps as the whole batch at once (T8)."""
    assert_same_run(single, _run(tmp_path / "a4.pt", 1, accum=4))
    with pytest.raises(ValueError, match="must divide into grad_accum=3"):
        apply_overrides(TrainConfig(), ["batch_size=4", "grad_accum=3"]).validate()
    with pytest.raises(ValueError, match="x grad_accum=2 micro-batches; choose a multiple of 4"):
        ParallelConfig(dp_shard=2).check(2, batch_size=6, grad_accum=2)


LAYOUTS = ("shard:1", "replicate:1", "ep:1", "ep:2", "pp:1", "pp:2")
# one launch of 2 processes runs them all in turn: the six fp32 layouts, mixed precision under expert parallelism,
# and the first layout once more (its repeat must be bit for bit the same)
RUNS = (*LAYOUTS, "ep-bf16:1", "shard-sign:1", "shard:1#again")


@pytest.fixture(scope="module")
def single_bf16(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("b1") / "b1.pt", 1, "bf16")


@pytest.fixture(scope="module")
def single_sign(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("s1") / "s1.pt", 1, "sign")


@pytest.mark.slow(seconds=28)  # one torchrun launch of 2 processes running nine runs in turn (~28 s on 2 CPUs)
def test_two_data_ranks_equal_one_process_in_every_layout(single, single_bf16, single_sign, tmp_path):
    """One launch of 2 gloo processes runs, one after another (each with a fresh model, mesh and trainer on the one
    process group; only the first joins a fresh group, and EP and PP also start fresh launches in the resume test):

    1. FSDP2 (dp_shard=2), HSDP (dp_replicate=2), expert parallelism (ep=2: 16 of the 32 experts per rank, the
       rest FSDP2; with 1 and 2 micro-batches: the FSDP2 parameters accumulate there too) and pipeline stages (pp=2:
       layers 0-2 and 3, the AttnRes bank crossing; GPipe with 1 micro-batch, 1F1B with 2), nano cut to 4 layers in
       fp32 with Muon + AdamW and Quantile Balancing, rows of uneven loss-token counts: losses, gradient norms,
       parameters and QB biases equal the single process on the same global batches.
    2. The trainer's mixed precision (`dtype=bf16`: fp32 parameters, optimizer state and fp32 islands, bf16 autocast
       matmuls) with expert parallelism (the experts spread, everything else FSDP2; FSDP2 alone measured the same)
       equals one process in bf16: the same rounding points, only the gradient sums' order differs. Measured: the
       first loss to the bit (fp32's differs by 1.2e-5), later losses within 3e-5 relative, parameters within
       1.6e-4 after 3 steps (bf16 against fp32 in one process: 5.6e-4).
    3. The sign rule (`balance=sign`) under FSDP2: the all-reduced expert loads give the single process's biases.
    4. The first layout again, after the others in the same processes: identical losses, gradient norms, weights
       and QB biases, bit for bit (T9: no nondeterministic reduction order in the collectives or the QB gather, and
       nothing a run leaves behind changes the next)."""
    runs = _run(tmp_path / "w2.pt", 2, " ".join(RUNS))
    assert list(runs) == list(RUNS)
    assert single["dispatched"] == 0 and single["local_experts"] == [32] * 3 and single["world"] == 1
    for spec in LAYOUTS:
        got = runs[spec]
        layout, accum = spec.split(":")[0], int(spec.split(":")[1])
        try:
            assert got["world"] == 2
            assert_same_run(single, got)
            if layout == "ep":  # each of the 3 MoE layers once per micro-batch and step
                assert got["dispatched"] == 3 * 3 * accum and got["local_experts"] == [16] * 3
            else:
                assert got["dispatched"] == 0
            assert got["stages"] == ([[0, 3], [3, 4]] if layout == "pp" else None)
        except AssertionError as e:
            raise AssertionError(f"layout {spec}: {e}") from e

    # 2. mixed precision
    got, ref = runs["ep-bf16:1"], single_bf16
    # the first forward: no gradient has been summed yet, so only the experts' split across ranks differs (smaller
    # matmuls): to the bit with AVX2/AVX-512 kernels, 7.6e-8 relative with ATEN_CPU_CAPABILITY=default, whose
    # scalar kernels block the sums by shape; fp32's first loss differs from bf16's by 4e-5 relative, far outside
    assert abs(got["losses"][0] - ref["losses"][0]) <= 5e-7 * abs(ref["losses"][0]), (got["losses"], ref["losses"])
    for a, b in zip(ref["losses"], got["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (ref["losses"], got["losses"])
    for a, b in zip(ref["grad_norms"], got["grad_norms"], strict=True):
        assert abs(a - b) <= 1e-2 * abs(a)
    worst = max((ref["params"][k] - got["params"][k]).abs().max().item() for k in ref["params"])
    assert worst <= 5e-4, worst
    assert got["dispatched"] == 3 * 8 and got["local_experts"] == [16] * 8  # 9 layers: 8 MoE, 3 steps
    # bf16 really ran (its losses are not fp32's), and the islands are fp32 parameters whatever the compute
    import parallel_worker

    assert parallel_worker.run(None, 1, "shard", layers=9)["losses"][0] != ref["losses"][0]
    islands = [k for k in got["params"] if k.endswith(("A_log", "dt_bias", "conv1d.weight"))]
    assert islands and all(got["params"][k].dtype == torch.float32 for k in islands)

    # 3. the sign rule: every bias a whole number of sign_rate steps (not QB's), the same as in one process
    got, ref = runs["shard-sign:1"], single_sign
    assert_same_run(ref, got)
    for k, b in ref["biases"].items():
        assert torch.allclose(b / 0.01, (b / 0.01).round(), atol=1e-3) and not torch.equal(b, single["biases"][k])

    # 4. the repeat
    a, b = runs["shard:1"], runs["shard:1#again"]
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"]
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert all(torch.equal(a["biases"][k], b["biases"][k]) for k in a["biases"])


# ---- the launch: torchrun -m openk3 train -------------------------------------------------------------

TRAIN = ["--preset", "nano", "--no-progress", "model.vocab_size=512", "model.num_hidden_layers=4",
         "data.max_bytes=200000", "seq_len=32", "batch_size=4", "eval_every=2", "save_every=2",
         "eval_batches=1", "warmup=1", "samples=0"]


def _openk3_train(out: Path, world: int, *args: str) -> None:
    if world == 1:  # the same command in this process (one thread, as the worker runs): no interpreter start-up
        from openk3.__main__ import main

        assert main(["train", "--out", str(out), *args, "threads=1"]) == 0
        return
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    proc = subprocess.run([*launch, "-m", "openk3", "train", "--out", str(out), *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _losses(out: Path) -> list[float]:
    from openk3.train.metrics import losses_by_step, read_metrics

    by_step = losses_by_step(read_metrics(str(out / "metrics.jsonl")))
    return [by_step[k] for k in sorted(by_step)]


@pytest.mark.slow(seconds=55)  # 2 one-process runs (in this process) and 4 torchrun launches of nano, ~45-60 s
def test_torchrun_openk3_train_resumes_on_another_world_size(tmp_path):
    """`torchrun --nproc_per_node 2 -m openk3 train` (the degrees default to dp_shard = the world size) with
    the same command line as one process: a run started on 2 processes with expert parallelism (optimizer state,
    experts' included, in DCP shards) resumes on 1, and one started on 1 (whole optimizer state) resumes on 2
    with FSDP2 alone and as 2 pipeline stages (then as 2 shards reading the weights' DCP shards), each ending
    where the uninterrupted
    one-process run ends (losses, weights); only rank 0 writes (one metrics line per step); a torn DCP staging
    folder is removed. Each save follows an evaluation, whose forward leaves the root FSDP unit gathered (naming
    the optimizer state through the model then failed with a KeyError)."""
    import openk3

    one = tmp_path / "one"
    _openk3_train(one, 1, *TRAIN, "--max-steps", "4")
    tok = ["--tokenizer", str(one / "tokenizer")]
    two_then_one, one_then_two = tmp_path / "two-one", tmp_path / "one-two"
    # expert parallel on the way out (parallel.ep=2 alone: the 2 processes become dp_shard=2)
    _openk3_train(two_then_one, 2, *TRAIN, *tok, "--max-steps", "2", "parallel.ep=2")
    state = json.loads((two_then_one / "train_config.json").read_text())
    assert state["parallel"]["dp_shard"] == 2 and state["parallel"]["ep"] == 2
    # the 2-process save: weights whole (release format), optimizer state as DCP shards inside the checkpoint
    step2 = two_then_one / "checkpoints" / "step_000002"
    shards = list((step2 / "optimizer_dcp").glob("*.distcp"))
    assert (step2 / "optimizer_dcp" / ".metadata").is_file() and len(shards) == 2  # one file per rank
    assert torch.load(step2 / "trainer_state.pt", weights_only=True)["optimizer"]["dcp"] == "optimizer_dcp"
    (two_then_one / "checkpoints" / ".dcp-step_000004").mkdir()  # a save killed before it committed
    _openk3_train(two_then_one, 1, "--no-progress", "--max-steps", "4")  # loads the DCP shards in one process
    assert not (two_then_one / "checkpoints" / ".dcp-step_000004").exists()  # removed as a torn save
    # the uninterrupted run as if killed after step 2's save: its own checkpoint resumes on 2 processes
    shutil.copytree(one, one_then_two)
    shutil.rmtree(one_then_two / "checkpoints" / "step_000004")
    (one_then_two / "checkpoints" / "latest").write_text("step_000002\n")
    one_then_pp = tmp_path / "one-pp"
    shutil.copytree(one_then_two, one_then_pp)
    _openk3_train(one_then_two, 2, "--no-progress", "--max-steps", "4")
    # the same checkpoint resumed as 2 pipeline stages, 2 micro-batches each step (1F1B), saving each step
    # through DCP (weights too); then, as if killed after step 3's save (--max-steps 3 would shorten the LR
    # schedule), the last step as 2 FSDP2 shards, which read their rows of the weights from those DCP shards
    _openk3_train(one_then_pp, 2, "--no-progress", "--max-steps", "4", "parallel.pp=2", "grad_accum=2",
                  "save_every=1")
    assert json.loads((one_then_pp / "train_config.json").read_text())["parallel"]["pp"] == 2
    step3 = one_then_pp / "checkpoints" / "step_000003"
    assert (step3 / "optimizer_dcp" / ".metadata").is_file() and (step3 / "model_dcp" / ".metadata").is_file()
    pp_losses = _losses(one_then_pp)
    shutil.rmtree(one_then_pp / "checkpoints" / "step_000004")
    (one_then_pp / "checkpoints" / "latest").write_text("step_000003\n")
    (step3 / "model.safetensors").write_bytes(b"")  # proves the 2-process resume reads the DCP weights
    _openk3_train(one_then_pp, 2, "--no-progress", "--max-steps", "4", "parallel.pp=1")
    assert json.loads((one_then_pp / "train_config.json").read_text())["parallel"]["dp_shard"] == 2
    assert abs(pp_losses[3] - _losses(one_then_pp)[3]) <= 1e-5 * abs(pp_losses[3])  # stages or shards
    ref = _losses(one)
    ref_w = dict(openk3.load(one / "checkpoints" / "step_000004", dtype="float32").named_parameters())
    for run, resumed in ((two_then_one, [2]), (one_then_two, [2]), (one_then_pp, [2, 3])):
        got = _losses(run)
        assert len(got) == 4 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(ref, got, strict=True)), (ref, got)
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert sum(r["kind"] == "train" for r in lines) == 4  # rank 1 wrote nothing
        # each leg resumed where it should (a leg that started over would log the same losses from step 1)
        assert [r["step"] for r in lines if r["kind"] == "resume"] == resumed, (run.name, lines)
        w = dict(openk3.load(run / "checkpoints" / "step_000004", dtype="float32").named_parameters())
        worst = max((ref_w[k] - w[k]).abs().max().item() for k in ref_w)
        assert worst <= 1e-5, (run.name, worst)  # measured 1.1e-6 (2 -> 1) and 4.8e-7 (1 -> 2)


def test_dry_run_prints_the_layout_and_starts_nothing(tmp_path, capsys):
    """`openk3 train --dry-run`: the mesh, each rank's rows, memory per rank from the planner's arithmetic (so
    the two agree), where the experts live; nothing written, no process group; a bad layout exits 2 by name."""
    from openk3.__main__ import main
    from openk3.config import preset
    from openk3.plan.train import TrainSpec, per_gpu_bytes

    out = tmp_path / "run"
    base = ["train", "--preset", "nano", "--out", str(out), "--dry-run", "batch_size=8", "seq_len=64"]
    assert main([*base, "parallel.dp_shard=2", "grad_accum=2"]) == 0
    text = capsys.readouterr().out
    assert "dry run: 2 processes; mesh dp_replicate 1 x dp_shard 2" in text
    assert "torchrun --standalone --nproc_per_node 2 -m openk3 train" in text
    assert "rank 1: replica 0, shard 1: rows 4-7 of each global batch of 8, in 2 micro-batches of 2 x 64" in text
    mem = per_gpu_bytes(preset("nano"), TrainSpec(seq_len=64, micro_batch_tokens=128), 2)
    assert f"total {mem['total'] / 2**20:,.1f} MiB" in text
    assert "routed experts; ep 1: every rank holds all" in text
    assert not out.exists()
    assert main([*base, "parallel.dp_shard=3"]) == 2  # 8 rows do not divide among 3 ranks
    assert "choose a multiple of 3" in capsys.readouterr().err
    assert main([*base, "parallel.dp_shard=2", "parallel.ep=2"]) == 0
    text = capsys.readouterr().out
    assert "ep 2: each rank holds 16 whole experts of every MoE layer" in text
    assert "all-to-all of 64-wide rows (the latent width)" in text
    assert "rank 0: experts 0-15" in text and "rank 1: experts 16-31" in text
    assert main([*base, "parallel.dp_shard=4", "parallel.ep=2"]) == 2
    assert "parallel.ep = parallel.dp_shard" in capsys.readouterr().err  # ep < dp_shard: not yet
    assert main([*base, "batch_size=6", "parallel.dp_shard=3", "parallel.ep=3"]) == 2
    assert "must divide the model's num_experts=32" in capsys.readouterr().err
    assert main([*base, "parallel.pp=2", "grad_accum=2"]) == 0
    text = capsys.readouterr().out
    assert "pipeline: 2 stages cut at AttnRes block boundaries; every stage sees the whole batch of 8 rows in 2 " \
           "micro-batches of 4 x 64 tokens (1F1B" in text
    assert "stage 0 (rank 0): layers 0-2 + embedding; sends 2 x [micro-batch, 64, 128]" in text
    assert "stage 1 (rank 1): layers 3-8 + output mix, norm, head" in text
    assert main([*base, "parallel.pp=2", "parallel.pp_cuts=[4]"]) == 2  # a mid-block cut
    assert "layer 4 is inside an AttnRes block (blocks start every 3 layers: 0, 3, 6)" in capsys.readouterr().err


def test_pipeline_stages_are_cut_at_attnres_block_boundaries():
    """T5's layout rules: automatic cuts balance layers over block boundaries only (K3's 93 layers in blocks
    of 12 give PP8 one block per stage), explicit cuts inside a block are refused by name, and the packed
    tensor crossing each boundary holds the snapshots so far plus the prefix."""
    from openk3.config import preset
    from openk3.parallel.pipeline import bank_rows, stage_bounds

    nano, k3 = preset("nano"), preset("k3")
    assert stage_bounds(nano, 2) == [(0, 3), (3, 9)] and stage_bounds(nano, 3) == [(0, 3), (3, 6), (6, 9)]
    assert stage_bounds(k3, 8) == [(i * 12, min(i * 12 + 12, 93)) for i in range(8)]
    assert stage_bounds(nano, 2, (6,)) == [(0, 6), (6, 9)]
    assert [bank_rows(k3, 12 * i) for i in range(1, 8)] == [2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="layer 4 is inside an AttnRes block"):
        stage_bounds(nano, 2, (4,))
    with pytest.raises(ValueError, match="cuts must increase strictly within 1..8"):
        stage_bounds(nano, 3, (6, 3))
    with pytest.raises(ValueError, match="parallel.pp=4: the model has only 3 AttnRes blocks"):
        stage_bounds(nano, 4)
    plain = dataclasses.replace(nano, attn_res_block_size=None)  # Kimi-Linear: a residual stream, any cut
    assert stage_bounds(plain, 2, (4,)) == [(0, 4), (4, 9)] and bank_rows(plain, 4) == 1


# ---- expert parallelism (parallel.ep) -----------------------------------------------------------------

def test_an_expert_parallel_moe_layer_equals_the_layer_in_one_process(tmp_path):
    """T2, one layer: nano's LatentMoE with its 32 experts split over 2 gloo ranks (all-to-all of the 64-wide
    latent rows, dropless) against the undistributed layer on the concatenated tokens: outputs, input
    gradients and every weight gradient, in float64 and float32, with random (uneven) loads and with every
    token steered to rank 0's experts, so that rank 1's experts get no rows and still run the backward
    collectives (zero gradients, not none)."""
    out = tmp_path / "layer.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests" / "ep_layer_worker.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = torch.load(out)
    assert len(ranks) == 2
    rows = {name: [r[name].pop("rows_received") for r in ranks] for name in ranks[0]}
    assert all(sum(r) == 2 * 13 * 4 for r in rows.values()), rows  # 2 ranks x 13 tokens x top-4, none dropped
    assert rows["torch.float64/steered"] == rows["torch.float32/steered"] == [2 * 13 * 4, 0]
    assert any(r[0] != r[1] for name, r in rows.items() if "random" in name), rows  # uneven loads
    for rank, results in enumerate(ranks):
        assert set(results) == {"torch.float64/random", "torch.float64/steered", "torch.float32/random",
                                "torch.float32/steered"}
        for name, errs in results.items():
            tol = 1e-12 if "float64" in name else 2e-5
            assert {"out", "dx", "gate.weight", "experts.w1", "experts.w2", "routed_expert_down_proj.weight",
                    "shared_experts.down_proj.weight"} <= set(errs)
            assert max(errs.values()) <= tol, (rank, name, errs)


@pytest.mark.slow(seconds=15)  # two torchrun agents of one process each, nano for 2 steps (~15 s)
def test_the_slurm_script_trains_on_two_nodes_through_the_rendezvous(tmp_path):
    """scripts/slurm/train.sbatch with stand-ins for `srun` (runs its command once per task, concurrently) and
    `scontrol` (the first node is this host): two "nodes" are two torchrun agents that meet through torchrun's
    c10d rendezvous, as on a cluster, and train one 2-process FSDP2 run; rank 0 writes the run folder."""
    import socket
    import stat

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {
        "scontrol": "#!/bin/sh\necho localhost\n",
        "srun": "#!/bin/bash\n# stand-in: srun's own --options first, then the command, once per task\nn=1\n"
                "while [[ $1 == --* ]]; do case $1 in --ntasks=*) n=${1#--ntasks=};; esac; shift; done\n"
                "pids=()\nfor ((i = 0; i < n; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i \"$@\" & pids+=($!); done\n"
                "rc=0\nfor p in \"${pids[@]}\"; do wait \"$p\" || rc=1; done\nexit $rc\n",
    }
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHONPATH=str(ROOT), PYTHON=sys.executable, GPUS_PER_NODE="1",
               SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_ID="4242",
               OPENK3_RDZV_PORT=str(port))
    out = tmp_path / "run"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch"), *TRAIN, "--out", str(out),
                           "--max-steps", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[slurm] 2 node(s) x 1 process(es); rendezvous localhost:{port} (job 4242)" in proc.stdout
    assert json.loads((out / "train_config.json").read_text())["parallel"]["dp_shard"] == 2
    assert len(_losses(out)) == 2 and (out / "checkpoints" / "step_000002" / "model.safetensors").is_file()
