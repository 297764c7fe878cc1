"""A run folder never loses what it holds (issue 28): a re-save killed between its two renames keeps the step
(D1); a folder whose checkpoints are gone, or an earlier run's settings, are not silently replaced; a finished
run that is run again writes no checkpoint and logs no second eval (S3); keep_checkpoints=1 resumes on the disk
it started on (S1); a full disk names the file being written and what was kept. One thread, nano cut to 4 layers
at seq 32 x batch 2 (the settings of tests/test_train_resume.py)."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import Killed
from test_train_resume import BASE, ckpt, copy_run, reference_run, tiny, tiny_disk, train_losses

import openk3
from openk3.checkpoint import runs, steps
from openk3.train import state as train_state
from openk3.train.config import TrainConfig
from openk3.train.metrics import read_metrics
from openk3.train.trainer import train


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4 (its own 512-id tokenizer): test_train_resume's,
    shared when both files run in one process."""
    return reference_run(tmp_path_factory)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


# ---- D1: a re-save killed between its two renames ---------------------------------------------------------

def test_a_resave_killed_between_its_two_renames_keeps_the_step(ref, tmp_path, monkeypatch):
    out, _ = copy_run(ref, tmp_path / "run")
    model = openk3.load(ckpt(out, 4), dtype=torch.float32)
    state = steps.load_trainer_state(ckpt(out, 4))
    real = os.replace

    def replace(src, dst):  # the kill comes after step_4 is moved aside, before the new copy is moved in
        if Path(src).name.startswith(".tmp-step_000004-"):
            raise Killed
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # SIGKILL runs no clean-up
    with pytest.raises(Killed):
        steps.save_checkpoint(out, 4, model, state)
    monkeypatch.undo()
    root = out / "checkpoints"
    assert not ckpt(out, 4).exists() and len(list(root.glob(".old-step_000004-*"))) == 1  # its only copy
    said = []
    found, saved, _ = train_state.open_run_folder(out, True, said.append, said.append)
    assert found == ckpt(out, 4) and saved["step"] == 4  # not step 2: the set-aside copy was renamed back
    assert any(s.startswith("restored step_000004") for s in said)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000004"]


def test_the_issues_repro_resumes_the_set_aside_step_and_keeps_the_runs_files(ref, tmp_path, capsys):
    """A finished run whose only checkpoint is the `.old-step_N-<pid>` a killed re-save left."""
    out, cfg = copy_run(ref, tmp_path / "run")
    shutil.rmtree(ckpt(out, 2))
    os.replace(ckpt(out, 4), out / "checkpoints" / ".old-step_000004-99999")
    losses = train_losses(out)
    summary = train(cfg, out, progress=False)
    assert summary["resumed_from"] == 4 and "restored step_000004" in capsys.readouterr().out
    assert train_losses(out) == losses
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000004"]


def test_the_issues_repro_from_the_command_line_resumes_with_the_runs_own_config(ref, capsys):
    """`openk3 train --out R`: the base config is R's own even while its step is set aside (not the defaults,
    which then differ from the checkpoint's)."""
    from openk3.__main__ import main

    out = ref.parent / "cli-repro"  # beside ref: the default cache (<out>/../.cache) is ref's
    shutil.copytree(ref, out)
    shutil.rmtree(ckpt(out, 2))
    os.replace(ckpt(out, 4), out / "checkpoints" / ".old-step_000004-99999")
    config = (out / "train_config.json").read_text()
    rc = main(["train", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "restored step_000004" in printed.out and "resuming from step 4" in printed.out
    assert (out / "train_config.json").read_text() == config


def test_a_run_whose_checkpoints_are_gone_is_refused_and_left_as_it_is(ref, tmp_path):
    out, cfg = copy_run(ref, tmp_path / "run")
    for step in (2, 4):
        shutil.rmtree(ckpt(out, step))
    before = files_of(out)
    for resume in (True, False):
        with pytest.raises(ValueError, match="the run's checkpoints are gone") as e:
            train(cfg, out, resume=resume, progress=False)
        assert str(out) in str(e.value) and "'step_000004'" in str(e.value) and "nothing was changed" in str(e.value)
        assert files_of(out) == before


def test_a_run_stopped_before_its_first_checkpoint_starts_over_only_with_its_settings(ref, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = tiny(tokenizer=str(ref / "tokenizer"), cache_dir=str(ref.parent / ".cache"))

    def kill(kind, info):
        if kind == "step":
            raise Killed

    with pytest.raises(Killed):
        train(cfg, out, progress=False, on_event=kill)
    before = files_of(out)
    with pytest.raises(ValueError, match=r"stopped before its first checkpoint, with other settings[^$]*"
                                         r"batch_size: 2 -> 4"):
        train(dataclasses.replace(cfg, batch_size=4), out, progress=False)
    assert files_of(out) == before
    capsys.readouterr()
    summary = train(cfg, out, progress=False)  # the same settings: it starts over, saying so
    assert summary["resumed_from"] is None and "starting over from step 0" in capsys.readouterr().out
    assert sorted(train_losses(out)) == [1, 2, 3, 4]


# ---- S3: a finished run run again -----------------------------------------------------------------------

def test_rerunning_a_finished_run_writes_no_checkpoint_and_no_second_eval(ref, tmp_path, monkeypatch):
    from openk3.train import trainer

    out, cfg = copy_run(ref, tmp_path / "run")
    saves = []
    monkeypatch.setattr(trainer, "save_checkpoint", lambda *args, **kwargs: saves.append(args[1]))
    summary = train(cfg, out, progress=False)
    evals = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["kind"] == "eval"]
    assert summary["resumed_from"] == 4 and saves == []
    assert [r["step"] for r in evals] == [4] and summary["val_bpb"] == evals[0]["val_bpb"]
    # the final eval runs before the last save, so the checkpoint holds it
    history = steps.load_trainer_state(ckpt(ref, 4))["history"]
    assert [h["step"] for h in history if h["kind"] == "eval"] == [4]


def test_a_run_finished_before_the_eval_was_saved_is_not_evaluated_twice(ref, tmp_path):
    """Runs finished by older versions saved the last step before the final eval: it is only in metrics.jsonl."""
    out, cfg = copy_run(ref, tmp_path / "run")
    state = steps.load_trainer_state(ckpt(out, 4))
    state["history"] = [h for h in state["history"] if h["kind"] != "eval"]
    steps.write_trainer_state(ckpt(out, 4) / runs.STATE_FILE, state)
    summary = train(cfg, out, progress=False)
    evals = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4] and summary["val_bpb"] == evals[0]["val_bpb"]


# ---- S1: the free-space check on resume ------------------------------------------------------------------

def test_checkpoints_to_fit_counts_what_is_on_disk_already():
    from openk3.train.space import checkpoints_to_fit

    assert checkpoints_to_fit(10, 0, 1) == 2  # a fresh run: the second save is written before the first goes
    assert checkpoints_to_fit(5, 1, 1) == 1  # resumed with its one checkpoint on disk
    assert checkpoints_to_fit(5, 3, 3) == 1
    assert checkpoints_to_fit(3, 4, 1) == 1  # keep lowered on resume: the first save prunes the rest
    assert checkpoints_to_fit(2, 0, 5) == 2 and checkpoints_to_fit(4, 2, None) == 4
    assert checkpoints_to_fit(0, 2, 1) == 0


def test_keep_one_checkpoint_resumes_on_the_disk_it_started_on(ref, tmp_path, monkeypatch):
    from openk3.train.space import checkpoint_bytes

    out, cfg = copy_run(ref, tmp_path / "run")
    shutil.rmtree(ckpt(out, 2))  # what keep_checkpoints=1 leaves
    size = checkpoint_bytes(TrainConfig.from_json(out / "train_config.json").model)
    tiny_disk(monkeypatch, size * 3 // 2)  # room for one more checkpoint, as the run had after its first save
    summary = train(dataclasses.replace(cfg, max_steps=8, keep_checkpoints=1), out, progress=False)
    assert summary["resumed_from"] == 4 and summary["steps"] == 8
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000008"]


# ---- a full disk names what it was writing ---------------------------------------------------------------

def test_a_full_disk_inside_torch_save_names_the_checkpoint(ref, tmp_path, monkeypatch, capsys):
    from openk3.__main__ import main

    def full(obj, fh, *args, **kwargs):
        """torch.save on a full disk: ENOSPC from a write, then its zip writer's RuntimeError while closing."""
        fh.write(b"PK")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6456768 vs 6456656") from e

    monkeypatch.setattr(torch, "save", full)
    out = tmp_path / "run"
    rc = main(["train", "--out", str(out), "--tokenizer", str(ref / "tokenizer"), "--no-progress",
               f"cache_dir={ref.parent / '.cache'}", *BASE])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{ckpt(out, 2)}: No space left on device (writing a checkpoint; its partial copy was removed" in err
    assert "no checkpoint was kept" in err and list((out / "checkpoints").iterdir()) == []


def test_small_files_and_the_metrics_log_name_themselves_on_a_full_disk(tmp_path, monkeypatch):
    from openk3.fsutil import write_atomic
    from openk3.train.metrics import MetricsLog

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    target = tmp_path / "train_config.json"
    target.write_text("old")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        write_atomic(target, b"new")
    assert e.value.filename == str(target) and e.value.errno == errno.ENOSPC
    assert "the file as it was is kept" in e.value.strerror
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["train_config.json"]
    log = MetricsLog(str(tmp_path / "metrics.jsonl"))
    log.close()
    log._fh = type("FullFile", (), {"write": full, "flush": full, "closed": True})()
    with pytest.raises(OSError) as e:
        log.log({"kind": "train", "step": 1})
    assert e.value.filename == str(tmp_path / "metrics.jsonl") and "records before it are kept" in e.value.strerror
