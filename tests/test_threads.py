"""The thread count of a training run: fixed when someone gives one, measured (all CPUs or one) otherwise."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from openk3 import common
from openk3.train import trainer as trainer_mod
from openk3.train.config import TrainConfig, apply_overrides
from openk3.train.threads import ThreadTuner

BASE = ["model.vocab_size=1024", "data.max_bytes=300000", "seq_len=32", "batch_size=2", "max_steps=9",
        "eval_every=0", "save_every=0", "eval_batches=1", "warmup=1", "samples=0"]


def drive(tuner: ThreadTuner, seconds_on, steps: int) -> tuple[list[int], list[str]]:
    """Run `steps` steps whose time is `seconds_on(threads, step)`; the thread count of each and the notes."""
    used, notes = [], []
    saved = torch.get_num_threads()
    try:
        for step in range(1, steps + 1):
            n = tuner.threads_for(step)
            assert torch.get_num_threads() == n
            used.append(n)
            if note := tuner.record(step, seconds_on(n, step)):
                notes.append(note)
    finally:
        torch.set_num_threads(saved)
    return used, notes


def test_trials_then_keeps_the_faster_and_rechecks():
    """Steps 2-3 on 2 threads, 4-5 on 1, then the faster; the window repeats every `every` steps, so a host that
    takes a core away later (2 threads now 3x slower) moves the run to one thread, and back when it returns."""
    def seconds(n, step):
        busy = 20 <= step < 40
        return {2: 3.0 if busy else 0.6, 1: 1.0}[n]

    used, notes = drive(ThreadTuner(2, every=10, trial=2), seconds, 47)  # used[i]: step i + 1
    assert used[:6] == [2, 2, 2, 1, 1, 2]  # step 1 warm-up on the first option, trial 2-3 / 4-5, then 2
    assert used[11:16] == [2, 2, 1, 1, 2]  # window 12-15 (quiet): stays on 2
    assert used[21:31] == [2, 2, 1, 1, 1, 1, 1, 1, 1, 1]  # window 22-25 sees the busy host: 1 thread
    assert used[31:36] == [2, 2, 1, 1, 1]  # window 32-35, still busy: stays on 1
    assert used[41:47] == [2, 2, 1, 1, 2, 2]  # window 42-45, quiet again: back to 2
    assert len(notes) == 3 and notes[0].startswith("threads: 2 of 2 CPUs (steps 2-5: 2 threads 0.60 s/step")
    assert notes[1].startswith("threads: 1 of 2 CPUs (steps 22-25")


def test_one_cpu_never_trials_and_a_tie_keeps_more_threads():
    used, notes = drive(ThreadTuner(1, every=10), lambda n, s: 1.0, 12)
    assert used == [1] * 12 and notes == []
    used, notes = drive(ThreadTuner(4, every=10), lambda n, s: 1.0, 12)
    assert used[5:] == [4] * 7 and notes and notes[0].startswith("threads: 4 of 4 CPUs")


def test_one_slow_trial_step_is_noise():
    """The minimum of a window's steps counts: one hiccup on the faster option does not lose it the choice."""
    used, _ = drive(ThreadTuner(2, every=10), lambda n, s: {2: 5.0 if s == 2 else 0.5, 1: 1.0}[n], 8)
    assert used[5:] == [2, 2, 2]


@pytest.mark.parametrize("env,value,want", [("OPENK3_THREADS", "3", 3), ("OMP_NUM_THREADS", "2", 2),
                                            ("OPENK3_THREADS", "", None)])
def test_a_given_count_is_fixed(monkeypatch, env, value, want):
    monkeypatch.delenv("OPENK3_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(env, value)
    assert common.fixed_threads(None) == want
    assert common.fixed_threads(5) == 5  # the argument (--threads) wins


@pytest.mark.parametrize("value", ["two", "-1"])
def test_a_bad_count_is_named(monkeypatch, value):
    monkeypatch.setenv("OPENK3_THREADS", value)
    with pytest.raises(ValueError, match=f"OPENK3_THREADS.*{value}"):
        common.fixed_threads(None)


def test_train_without_a_count_measures_and_records_threads(tmp_path, monkeypatch, capsys):
    """`train` with nobody choosing a count: a tuner over all CPUs (2 here, whatever the machine) and one, its
    choice printed, each step's count in metrics.jsonl; with a count: that count and no tuner. torch's thread
    setting is recorded, not applied: two real threads beside the other test worker would stall (module doc)."""
    monkeypatch.delenv("OPENK3_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(common, "cpus_available", lambda: 2)
    monkeypatch.setattr(trainer_mod, "ThreadTuner", lambda cpus: ThreadTuner(cpus, every=6, trial=1))
    asked = [torch.get_num_threads()]
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: asked[-1])
    cfg = dataclasses.replace(apply_overrides(TrainConfig(), BASE))
    trainer_mod.train(cfg, tmp_path / "auto", progress=False)
    out = capsys.readouterr().out
    assert "2 thread(s) to start (auto: 2 or 1, whichever steps faster)" in out
    assert "[train] threads: " in out and "of 2 CPUs (steps 2-3:" in out
    recs = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    threads = [r["threads"] for r in recs if r.get("kind") == "train"]
    assert threads[:3] == [2, 2, 1] and threads[7:9] == [2, 1]  # trials at steps 2-3 and 8-9
    assert set(threads[3:7]) in ({1}, {2})  # the choice in between
    del asked[1:]
    trainer_mod.train(dataclasses.replace(cfg, threads=1, max_steps=2), tmp_path / "fixed", progress=False)
    out = capsys.readouterr().out
    assert "1 thread(s), fp32" in out and "[train] threads:" not in out and set(asked[1:]) == {1}
