"""The run loop every trainer drives (openk3/train/loop.py), on a job that only records what it was asked to do:
the cadence (evaluate every N and at the last step, before saving it; save every M and at the end), a resumed
job neither saving nor evaluating twice, the order of the events, the non-finite-loss stop, and the `finally`."""

from __future__ import annotations

import math

import pytest
from helpers import Killed

from openk3.log import reporter
from openk3.train.loop import NO_LOG, Cadence, Job, run_loop

REPORT = reporter("test")


class Recorder(Job):
    tag = "test"

    def __init__(self, start: int = 0, *, evaluates: bool = True, losses: dict[int, float] | None = None):
        self.done, self.calls, self.closed = start, [], False
        self._evaluates, self.losses = evaluates, losses or {}

    @property
    def step(self) -> int:
        return self.done

    @property
    def evaluates(self) -> bool:
        return self._evaluates

    def next_step(self) -> dict:
        self.done += 1
        self.calls.append(("step", self.done))
        return {"step": self.done, "loss": self.losses.get(self.done, 1.0 / self.done)}

    def evaluate(self) -> dict:
        self.calls.append(("eval", self.done))
        return {"kind": "eval", "step": self.done}

    def save(self):
        self.calls.append(("save", self.done))
        return f"ckpt-{self.done}"

    def plot(self) -> None:
        self.calls.append(("plot", self.done))

    def close(self) -> None:
        self.closed = True


class Log:
    def __init__(self):
        self.records, self.closed = [], False

    def log(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        self.closed = True


def only(calls, *kinds):
    return [c for c in calls if c[0] in kinds]


def run(job, cadence, log=None, **kw):
    events = []
    run_loop(job, cadence, log or NO_LOG, report=REPORT, progress=False,
             on_event=lambda kind, info: events.append((kind, info["step"])), **kw)
    return events


def test_cadence_evaluates_before_saving_the_last_step():
    job, log = Recorder(), Log()
    events = run(job, Cadence(max_steps=7, eval_every=3, save_every=2, log_every=5), log)
    assert only(job.calls, "eval", "save") == [("save", 2), ("eval", 3), ("save", 4), ("eval", 6), ("save", 6),
                                               ("eval", 7), ("save", 7)]
    assert [r["step"] for r in log.records] == [1, 2, 3, 3, 4, 5, 6, 6, 7, 7]  # every step and eval record
    assert events[-3:] == [("step", 7), ("eval", 7), ("checkpoint", 7)]
    assert log.closed and job.closed


def test_zero_intervals_mean_only_at_the_end_and_a_job_without_evaluation_never_evaluates():
    job = Recorder(evaluates=False)
    run(job, Cadence(max_steps=4))
    assert only(job.calls, "eval", "save") == [("save", 4)]


def test_a_resumed_finished_job_neither_saves_nor_evaluates_again():
    job = Recorder(start=5)
    run(job, Cadence(max_steps=5, eval_every=5, save_every=5), last_saved=5, last_eval=5)
    assert only(job.calls, "step", "eval", "save") == []
    assert job.calls == [("plot", 5)]  # the picture is redrawn (it may predate the last records)


def test_a_resume_at_a_checkpoint_after_its_eval_was_lost_evaluates_then_does_not_save_again():
    job = Recorder(start=5)
    run(job, Cadence(max_steps=5, eval_every=5, save_every=5), last_saved=5, last_eval=None)
    assert only(job.calls, "eval", "save") == [("eval", 5)]


def test_a_non_finite_loss_stops_the_run_and_everything_is_closed():
    job, log = Recorder(losses={3: math.nan}), Log()
    with pytest.raises(FloatingPointError, match="loss is nan at step 3"):
        run(job, Cadence(max_steps=10, save_every=2), log)
    assert only(job.calls, "save") == [("save", 2)] and job.closed and log.closed


def test_a_kill_in_a_hook_leaves_nothing_after_it_and_closes():
    job, log = Recorder(), Log()

    def kill(kind, info):
        if kind == "step" and info["step"] == 3:
            raise Killed

    with pytest.raises(Killed):
        run_loop(job, Cadence(max_steps=6, save_every=3), log, report=REPORT, progress=False, on_event=kill)
    assert only(job.calls, "save") == [] and job.done == 3 and job.closed and log.closed


def test_console_lines_at_the_first_every_nth_and_the_last_step(caplog):
    # (pytest hangs its capture handler on every logger that does not propagate, such as the reporters' root,
    # when it exists as the test starts: REPORT below makes sure it does)
    job = Recorder(evaluates=False)
    run(job, Cadence(max_steps=7, log_every=3))
    assert [r.getMessage() for r in caplog.records] == ["step 1/7", "step 3/7", "step 6/7", "step 7/7"]


def test_reporter_lines_are_tagged_on_stdout_and_warnings_on_stderr(capsys):
    reporter("test").info("hello")
    reporter("test").warning("careful")
    out, err = capsys.readouterr()
    assert out == "[test] hello\n" and err == "[test] warning: careful\n"
