"""The run loop every trainer drives. Pretraining (`train.trainer`), SFT (`posttrain.trainers.sft`), RL
(`posttrain.trainers.rl`) and MOPD (`posttrain.trainers.mopd`) are a `Job` each — a step function with its
data, its evaluation and its checkpoint — handed to `run_loop`:

    run_loop(job, Cadence(max_steps=200, eval_every=50, save_every=100, log_every=10), metrics_log)

The loop owns what they share: the step loop, the metrics log (every record as one JSON line), the progress
bar and the console lines, evaluating every `eval_every` steps and at the last step (before that step is
saved, so a finished run's checkpoint holds its final evaluation), saving every `save_every` steps and at the
end, the stop on a non-finite loss, the `on_event(kind, info)` callback ("step", "eval", "checkpoint": tests
simulate kills with it), and the `finally` that closes the bar, the log and the job whatever happens.

Starting and resuming are the run folder's (`train.state.open_run_folder`: torn saves cleaned, the newest
intact checkpoint found; `settings_changes` / `record_config` for the settings; `resume_run`), done by each
job's setup before the loop runs, so a resumed job enters the loop at its checkpoint's step and the loop
continues from there: bit for bit the uninterrupted run on CPU in fp32 (tests/test_trainer.py,
test_posttrain_sft.py, test_posttrain_rl.py, test_posttrain_mopd.py kill runs inside a checkpoint write).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

EventHook = Callable[[str, dict], None]


@dataclass(frozen=True)
class Cadence:
    """How far and how often: `max_steps` optimizer steps; evaluate every `eval_every` steps (0: only at the
    end) and save every `save_every` (0: only at the end); a console line every `log_every` steps (and at the
    first and the last)."""

    max_steps: int
    eval_every: int = 0
    save_every: int = 0
    log_every: int = 1


class Job:
    """What a trainer hands `run_loop`. `step` is the optimizer steps done (a resumed job starts at its
    checkpoint's); `next_step` takes one and returns its metrics record (logged as it is); `evaluates` says
    whether `evaluate` has anything to score; `save` writes the checkpoint of `step`. The loop sets `report`
    (where `note` lines go) before the first step."""

    tag = "run"
    report: logging.Logger

    @property
    def step(self) -> int:
        raise NotImplementedError

    @property
    def evaluates(self) -> bool:
        return False

    def next_step(self) -> dict:
        raise NotImplementedError

    def evaluate(self) -> dict:
        raise NotImplementedError

    def save(self) -> Path | None:
        raise NotImplementedError

    def plot(self) -> None:
        """Redraw the job's pictures (after an evaluation, a checkpoint and at the end); nothing by default."""

    def step_line(self, rec: dict, max_steps: int) -> str:
        return f"step {rec.get('step', self.step)}/{max_steps}"

    def eval_line(self, rec: dict) -> str:
        return f"eval step {rec.get('step', self.step)}"

    def postfix(self, rec: dict) -> dict[str, str]:
        """What the progress bar shows beside the count."""
        return {"loss": f"{rec['loss']:.3f}"} if isinstance(rec.get("loss"), (int, float)) else {}

    def note(self, msg: str) -> None:
        self.report.info(msg)

    def close(self) -> None:
        """Release what the job holds (hooks, sandboxes); runs in the loop's `finally`."""


class _NoLog:
    """The metrics log of a process that does not write (ranks other than 0)."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


NO_LOG = _NoLog()


def run_loop(job: Job, cadence: Cadence, log, *, report: logging.Logger, progress: bool = True,
             on_event: EventHook | None = None, last_saved: int | None = None, last_eval: int | None = None) -> None:
    """Drive `job` from its `step` to `cadence.max_steps` (module docstring). `log`: the metrics log (its
    `log(record)` and `close()`; `NO_LOG` on ranks that do not write). `last_saved` / `last_eval`: the steps
    the run had already saved and evaluated (a resume), so the end neither saves nor evaluates twice.
    `report` receives the console lines; `on_event` is called after each step's record is logged, each
    evaluation and each checkpoint."""
    from tqdm import tqdm

    job.report = report
    n = cadence.max_steps
    bar = tqdm(total=n, initial=min(job.step, n), file=sys.stderr, disable=not progress, unit="step",
               dynamic_ncols=True, desc=job.tag)

    def emit(kind: str, info: dict) -> None:
        if on_event is not None:
            on_event(kind, info)

    def evaluate() -> None:
        rec = job.evaluate()
        log.log(rec)
        report.info(job.eval_line(rec))
        job.plot()
        emit("eval", rec)

    def save() -> None:
        path = job.save()
        job.plot()
        if path is not None:  # (a rank that does not write returns None)
            emit("checkpoint", {"step": job.step, "path": str(path)})

    try:
        while job.step < n:
            rec = job.next_step()
            log.log(rec)
            step = job.step
            bar.set_postfix(job.postfix(rec), refresh=False)
            bar.update(1)
            if step % cadence.log_every == 0 or step == 1 or step == n:
                report.info(job.step_line(rec, n))
            emit("step", rec)
            loss = rec.get("loss")
            if isinstance(loss, float) and not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step}")
            if job.evaluates and (cadence.eval_every and step % cadence.eval_every == 0 or step == n):
                evaluate()
                last_eval = step
            if cadence.save_every and step % cadence.save_every == 0:
                save()
                last_saved = step
        if job.evaluates and last_eval != job.step:
            evaluate()
        if last_saved != job.step:
            save()
        else:
            job.plot()
    finally:
        bar.close()
        log.close()
        job.close()
