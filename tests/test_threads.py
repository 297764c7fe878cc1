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

# nano cut to 4 layers; 4 steps: step 1, the trial (steps 2-3) and a step on the thread count it chose
BASE = ["model.vocab_size=512", "model.num_hidden_layers=4", "data.max_bytes=200000", "seq_len=32", "batch_size=2",
        "max_steps=4",
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
    """Step 1 on one thread; steps 2-3 on one, 4-5 on two; the faster wins. While two win, a trial every
    `every` steps; a host that takes a core away (two threads now 3x slower) moves the run to one thread after
    one slow step of the trial, and back at a later trial once the core returns."""
    def seconds(n, step):
        busy = 20 <= step < 40
        return {2: 3.0 if busy else 0.6, 1: 1.0}[n]

    tuner = ThreadTuner(2, every=10, trial=2)
    used, notes = drive(tuner, seconds, 60)  # used[i]: step i + 1
    assert used[:7] == [1, 1, 1, 2, 2, 2, 2]  # trial 2-5 -> two threads; next trial at step 16
    assert used[15:21] == [1, 1, 2, 2, 2, 2]  # trial 16-19 (quiet): stays on two; next at 30
    assert used[29:33] == [1, 1, 2, 1]  # trial 30-32: the busy host's first two-thread step ends it
    assert used[33:42] == [1] * 9 and used[42:46] == [1, 1, 2, 2]  # next trial at 43 (10 steps on), quiet again
    assert used[46:56] == [2] * 10 and used[56:60] == [1, 1, 2, 2]  # while two win: a trial every 10 steps
    assert len(notes) == 3 and notes[0].startswith("threads: 2 of 2 CPUs (steps 2-5: 1 thread 1.00 s/step, "
                                                   "2 threads 0.60 s/step; next check at step 16")
    assert notes[1].startswith("threads: 1 of 2 CPUs (steps 30-32") and "next check at step 43" in notes[1]


def test_one_thread_winning_backs_off():
    """While one thread keeps winning, the waits between trials double from `every` up to 8x `every`."""
    tuner = ThreadTuner(2, every=10, trial=1)
    used, notes = drive(tuner, lambda n, s: {2: 2.0, 1: 1.0}[n], 300)
    starts = [i + 1 for i in range(1, len(used)) if used[i] == 2]  # the two-thread step of each trial
    assert [b - a for a, b in zip(starts, starts[1:])] == [12, 22, 42, 82, 82]
    assert len(notes) == 1 and notes[0].startswith("threads: 1 of 2 CPUs")


def test_one_cpu_never_trials_and_a_slow_trial_step_is_noise():
    used, notes = drive(ThreadTuner(1, every=10), lambda n, s: 1.0, 12)
    assert used == [1] * 12 and notes == []
    # the minimum of each option's steps counts: one hiccup on two threads does not lose them the choice
    used, _ = drive(ThreadTuner(2, every=10, cut=10), lambda n, s: {2: 5.0 if s == 4 else 0.5, 1: 1.0}[n], 8)
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
    monkeypatch.setattr(trainer_mod, "ThreadTuner", lambda cpus: ThreadTuner(cpus, every=4, trial=1))
    asked = [torch.get_num_threads()]
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: asked[-1])
    cfg = dataclasses.replace(apply_overrides(TrainConfig(), BASE))
    trainer_mod.train(cfg, tmp_path / "auto", progress=False)
    out = capsys.readouterr().out
    assert "1 thread(s) to start (auto: 2 or 1, whichever steps faster)" in out
    assert "[train] threads: " in out and "of 2 CPUs (steps 2-3:" in out
    recs = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    threads = [r["threads"] for r in recs if r.get("kind") == "train"]
    assert threads[:3] == [1, 1, 2]  # step 1, then the trial at steps 2 (one thread) and 3 (two)
    assert 2 in threads[3:] or 1 in threads[3:]
    del asked[1:]
    trainer_mod.train(dataclasses.replace(cfg, threads=1, max_steps=2), tmp_path / "fixed", progress=False)
    out = capsys.readouterr().out
    assert "1 thread(s), fp32" in out and "[train] threads:" not in out and set(asked[1:]) == {1}
