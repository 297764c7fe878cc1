"""The training loop: config overrides, a tiny end-to-end run, exact kill-and-resume, torn checkpoints,
activation checkpointing, and the `openk3 train` command. One thread, nano cut to 4 layers at seq 32 x batch 2,
4 steps (checkpoints and evals at 2 and 4: a kill after step 3 resumes from step 2)."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import Killed, torn_write_at

from openk3.checkpoint import runs as run_folder
from openk3.checkpoint import steps
from openk3.config import preset
from openk3.parallel.ac import apply_activation_checkpointing
from openk3.train.balance import RoutingRecorder
from openk3.train.config import TrainConfig, apply_overrides, parse_value
from openk3.train.metrics import losses_by_step, read_metrics
from openk3.train.trainer import train

# nano cut to 4 layers (3 KDA + 1 MLA, dense and MoE FFNs, two AttnRes blocks): every layer kind at half the cost
BASE = ["model.vocab_size=1024", "model.num_hidden_layers=4", "data.max_bytes=300000", "seq_len=32", "batch_size=2",
        "max_steps=4", "eval_every=2", "save_every=2", "eval_batches=2", "warmup=1", "optim.lr=3e-3", "samples=1",
        "sample_tokens=4", "threads=1"]


def tiny(**changes) -> TrainConfig:
    return dataclasses.replace(apply_overrides(TrainConfig(), BASE), **changes)


def train_losses(out: Path) -> dict[int, float]:
    return losses_by_step(read_metrics(str(out / "metrics.jsonl")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def run_a(runs):
    """The uninterrupted reference run (trains its own tokenizer)."""
    out = runs / "A"
    summary = train(tiny(), out, progress=False)
    return out, summary


# ---- config -----------------------------------------------------------------------------------------

def test_overrides_are_typed():
    cfg = apply_overrides(TrainConfig(), [
        "optim.lr=1e-3", "optim.betas=[0.8,0.9]", "optim.grad_clip=none", "batch_size=4", "max_steps=1e3",
        "qk_clip=true", "eval_batches=null", "tokenizer=tok", "data.max_bytes=300_000", "model.hidden_size=64",
        "model.linear_attn_config.full_attn_layers=4,9", "warmup=0.1"])
    assert cfg.optim.lr == 1e-3 and cfg.optim.betas == (0.8, 0.9) and cfg.optim.grad_clip is None
    assert cfg.batch_size == 4 and cfg.max_steps == 1000 and isinstance(cfg.max_steps, int)
    assert cfg.qk_clip is True and cfg.eval_batches is None and cfg.tokenizer == "tok"
    assert cfg.data.max_bytes == 300000 and cfg.model.hidden_size == 64
    assert cfg.model.linear_attn_config.full_attn_layers == [4, 9]
    assert cfg.model.linear_attn_config.kda_layers == [1, 2, 3, 5, 6, 7, 8]  # re-derived
    assert cfg.warmup_steps == 100
    shallow = apply_overrides(TrainConfig(), ["model.num_hidden_layers=5"]).model
    assert shallow.linear_attn_config.full_attn_layers == [4, 5]  # K3's rule for the new depth
    assert parse_value(int | list[int] | None, "3") == 3 and parse_value(int | list[int] | None, "[1,2]") == [1, 2]
    # the original is untouched (frozen, copied)
    assert TrainConfig().optim.lr != 1e-3


def test_config_json_round_trip(tmp_path):
    cfg = apply_overrides(TrainConfig(), ["optim.betas=(0.8,0.9)", "model.vocab_size=1024", "data.max_bytes=1000",
                                          "schedule=wsd"])
    cfg.to_json(tmp_path / "c.json")
    again = TrainConfig.from_json(tmp_path / "c.json")
    assert again == cfg and isinstance(again.optim.betas, tuple)


@pytest.mark.parametrize("item, words", [
    ("optim.lrr=1", ["optim.lrr", "optim.lr"]),
    ("model.hiden_size=3", ["model.hidden_size"]),
    ("batchsize=3", ["batch_size"]),
    ("model.linear_attn_config.num_head=2", ["model.linear_attn_config.num_heads"]),
])
def test_unknown_keys_suggest_close_matches(item, words):
    with pytest.raises(ValueError, match="unknown config key") as e:
        apply_overrides(TrainConfig(), [item])
    for w in words:
        assert repr(w) in str(e.value)


@pytest.mark.parametrize("item, key", [
    ("batch_size=x", "batch_size"), ("batch_size=1.5", "batch_size"), ("qk_clip=maybe", "qk_clip"),
    ("optim.betas=1", "optim.betas"), ("optim.lr=fast", "optim.lr"), ("max_steps=none", "max_steps"),
])
def test_bad_values_name_key_and_value(item, key):
    with pytest.raises(ValueError) as e:
        apply_overrides(TrainConfig(), [item])
    msg = str(e.value)
    assert key in msg and repr(item.split("=", 1)[1]) in msg


def test_invalid_combinations_rejected():
    for item in ("batch_size=0", "dtype=fp16", "schedule=linear", "model.hidden_size=-1", "noequals"):
        with pytest.raises(ValueError):
            apply_overrides(TrainConfig(), [item])


# ---- a tiny run -------------------------------------------------------------------------------------

def test_tiny_run_writes_everything(run_a):
    import openk3

    out, summary = run_a
    recs = read_metrics(str(out / "metrics.jsonl"))
    train_recs = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4]
    for r in train_recs:
        for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "load_max_over_mean", "elapsed"):
            assert r[key] is not None, key
        assert r["load_max_over_mean"] >= 1.0
    assert train_recs[-1]["tokens"] == 4 * 2 * 32
    assert train_recs[0]["lr"] == 0.0 and train_recs[1]["lr"] == pytest.approx(3e-3)  # warmup 1 step
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4] and all(0 < r["val_bpb"] < 20 for r in evals)
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (640, 400)
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["model"]["vocab_size"] == 1024 and saved["seq_len"] == 32
    assert (out / "tokenizer" / "tiktoken.model").is_file()
    ckpt = out / "checkpoints" / "step_000004"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000004"
    assert (out / "checkpoints" / "step_000002" / "trainer_state.pt").is_file()
    model = openk3.load(ckpt, dtype=torch.float32)
    assert model.config.vocab_size == 1024
    assert (ckpt / "tiktoken.model").is_file()  # the checkpoint carries its tokenizer
    assert summary["steps"] == 4 and summary["val_bpb"] == evals[-1]["val_bpb"]
    assert len(summary["samples"]) == 1 and summary["samples"][0]["prompt"]


def test_finished_run_is_not_retrained(run_a):
    out, summary = run_a
    before = (out / "metrics.jsonl").read_text()
    again = train(tiny(), out, progress=False)
    assert again["resumed_from"] == 4 and again["steps"] == 4 and again["val_bpb"] == summary["val_bpb"]
    after = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["kind"] != "resume"]
    assert after == [json.loads(line) for line in before.splitlines()]


def test_no_resume_refuses_existing_checkpoints(run_a):
    with pytest.raises(ValueError, match="already has checkpoints"):
        train(tiny(), run_a[0], resume=False, progress=False)


# ---- kill and resume --------------------------------------------------------------------------------



def test_kill_and_resume_reproduces_losses_exactly(run_a, runs, capsys):
    ref_out, _ = run_a
    out = runs / "B"
    cfg = tiny(tokenizer=str(ref_out / "tokenizer"))

    def kill_at_step_3(kind, info):
        if kind == "step" and info["step"] == 3:
            raise Killed  # after step 3 is logged, before any checkpoint of it

    with pytest.raises(Killed):
        train(cfg, out, progress=False, on_event=kill_at_step_3)
    assert max(train_losses(out)) == 3  # step 3 was logged ...
    assert run_folder.find_latest(out).name == "step_000002"  # ... but only step 2 saved
    capsys.readouterr()
    summary = train(cfg, out, progress=False)
    assert "resuming from step 2" in capsys.readouterr().out
    assert summary["resumed_from"] == 2
    assert train_losses(out) == train_losses(ref_out)  # bit for bit
    assert summary["val_bpb"] == run_a[1]["val_bpb"]
    a = steps.load_trainer_state(ref_out / "checkpoints" / "step_000004")
    b = steps.load_trainer_state(out / "checkpoints" / "step_000004")
    assert a["history"] == b["history"] and a["loader"] == b["loader"]
    from safetensors.torch import load_file

    wa = load_file(ref_out / "checkpoints" / "step_000004" / "model.safetensors")
    wb = load_file(out / "checkpoints" / "step_000004" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_kill_inside_checkpoint_save_resumes_from_previous(run_a, runs, monkeypatch):
    ref_out, _ = run_a
    out = runs / "C"
    cfg = tiny(tokenizer=str(ref_out / "tokenizer"))
    with pytest.raises(Killed), torn_write_at(monkeypatch, 4):  # a partial file in the temp folder, then the kill
        train(cfg, out, progress=False)
    assert run_folder.find_latest(out).name == "step_000002"
    assert not (out / "checkpoints" / "step_000004").exists()
    # a kill leaves the temp folder behind (the exception path removes it; simulate the SIGKILL case)
    (out / "checkpoints" / ".tmp-step_000004-99999").mkdir()
    summary = train(cfg, out, progress=False)
    assert summary["resumed_from"] == 2
    assert train_losses(out) == train_losses(ref_out)
    assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())


def test_torn_metrics_line_and_stale_latest_are_tolerated(run_a, runs):
    ref_out, _ = run_a
    out = runs / "D"
    cfg = tiny(tokenizer=str(ref_out / "tokenizer"), max_steps=2)
    train(cfg, out, progress=False)
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"kind": "train", "step": 3, "lo')  # killed mid-line
    (out / "checkpoints" / "latest").write_text("step_000009\n")  # names nothing complete
    assert run_folder.find_latest(out).name == "step_000002"
    summary = train(dataclasses.replace(cfg, max_steps=4), out, progress=False)
    assert summary["resumed_from"] == 2
    losses = train_losses(out)
    assert sorted(losses) == [1, 2, 3, 4]
    assert [losses[s] for s in (1, 2)] == [train_losses(ref_out)[s] for s in (1, 2)]


# ---- loop options -----------------------------------------------------------------------------------

def test_activation_checkpointing_gives_the_same_gradients():
    from openk3.model.model import K3ForCausalLM

    cfg = preset("nano")
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for ckpt in (False, True):
        model = K3ForCausalLM.build(cfg, seed=0)
        if ckpt:
            apply_activation_checkpointing(model)
        recorder = RoutingRecorder(model).enable()
        model(ids).logsumexp(-1).mean().backward()
        # the forwards re-run inside backward are not routing records (QB would count them twice)
        assert all(len(r) == 1 for r in recorder.records.values()) and len(recorder.records) == 8
        recorder.disable()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert sum(g is not None for g in grads[0].values()) > 10
    for n, g in grads[0].items():
        if g is None:
            assert grads[1][n] is None, n
        else:
            assert torch.allclose(g, grads[1][n], rtol=1e-5, atol=1e-7), n


def _cli_main():
    """`openk3.__main__.main` once `train` is registered there; until then the same door built here."""
    import argparse
    import sys

    from openk3 import __main__ as door
    from openk3.commands import train as command

    if "train" in door.COMMANDS:
        return door.main

    def main(argv):
        parser = argparse.ArgumentParser(prog="openk3")
        sub = parser.add_subparsers(dest="command", required=True)
        command.add_arguments(sub.add_parser("train"))
        args = parser.parse_args(argv)
        try:
            return command.main(args) or 0
        except ValueError as e:
            print(f"openk3 train: error: {e}", file=sys.stderr)
            return 2

    return main


def test_cli_with_every_option(run_a, runs, capsys):
    """aux loss instead of QB, QK-clip, activation checkpointing and WSD, through the CLI."""
    main = _cli_main()

    out = runs / "E"
    args = ["train", "--preset", "nano", "--out", str(out), "--max-steps", "2", "--no-progress",
            "--tokenizer", str(run_a[0] / "tokenizer"), *BASE, "max_steps=2", "qb_rate=0", "aux_loss_coef=0.01",
            "qk_clip=true", "optim.qk_clip_tau=1e-3", "activation_checkpointing=true", "eval_every=0",
            "save_every=0", "schedule=wsd"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert '"aux_loss_coef": 0.01' in text and "validation bits per byte" in text
    recs = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["kind"] == "train"]
    assert len(recs) == 2 and all("aux_loss" in r and r["qk_clipped_heads"] > 0 for r in recs)
    assert TrainConfig.from_json(out / "train_config.json").activation_checkpointing is True
    assert run_folder.find_latest(out).name == "step_000002"  # saved at the end even with save_every=0
    assert main(["train", "--out", str(out), "--no-resume", "--no-progress", *BASE]) == 2  # refuses
    assert main(["train", "--out", str(out / "x"), "--no-progress", "optim.lrr=1"]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_bf16_autocast_step(run_a, runs, monkeypatch):
    from openk3.train import trainer

    drawn = []
    real = trainer.plot_losses
    monkeypatch.setattr(trainer, "plot_losses", lambda *a, **k: (drawn.append(a[0]), real(*a, **k)))
    out = runs / "F"
    summary = train(tiny(tokenizer=str(run_a[0] / "tokenizer"), max_steps=1, dtype="bf16", eval_every=0,
                         save_every=0), out, progress=False)
    assert summary["steps"] == 1
    # the final eval and the final save show the same history: loss.png is drawn once, not twice
    assert len(drawn) == 1 and (out / "loss.png").is_file()
