"""How many CPU threads a training run uses when nobody said: all CPUs or one, whichever steps faster now.

Why measure instead of fixing a number: on the small shared machines openk3 is built and tested on, a second
OpenMP thread made a nano training step 1.5x faster while the host gave the process both vCPUs, and 2.4x
slower while another process wanted one of them (OpenMP's threads then wait at every small matmul for a
thread that is not running; `docs/benchmarks.md`, "Threads"). Which of the two a machine is in changes by the
minute. So `openk3 train` starts on one thread and, from step `first` on, runs a short trial: `trial` steps on
one thread, then up to `trial` on all CPUs, cut short as soon as an all-CPU step is `cut` times slower than the
one-thread steps (so a bad trial costs one slow step, not a slow run); it keeps the faster and says so when its
choice changes. It retries every `every` steps while all CPUs win, and backs off (twice the wait each time, up
to 8x) while one thread wins.

A change of thread count changes the summation order inside matmuls (results differ at ~1e-7 relative), so
an auto run is not bit-reproducible from run to run; `--threads N` (or $OPENK3_THREADS / $OMP_NUM_THREADS)
fixes the count, and the tests run that way (`common.fixed_threads`, `common.cpus_available`).
"""

from __future__ import annotations

import torch


class ThreadTuner:
    """Chooses torch's thread count, one or `cpus`, from measured step times (module docstring).

    Use: `n = tuner.threads_for(step)` before each training step (it calls torch.set_num_threads when the
    count changes) and `tuner.record(step, seconds)` after it; `record` returns a line to print when a trial
    ends with a new choice (or the first time). Within a trial each option's shortest step counts (one slow
    step is host noise).
    """

    def __init__(self, cpus: int, *, every: int = 200, trial: int = 2, first: int = 2, cut: float = 1.5) -> None:
        assert cpus >= 1 and trial >= 1 and every > 2 * trial and cut > 1
        self.cpus, self.every, self.trial, self.cut = cpus, every, trial, cut
        self.choice = 1  # a first step on all CPUs of a busy host could take minutes
        self.next_trial = first if cpus > 1 else None  # None: never (one CPU)
        self.gap = every
        self.queue: list[int] = []  # the options of the trial's remaining steps
        self.times: dict[int, list[float]] = {}
        self.trials = 0  # trials completed
        self.first_step = 0  # of the trial in progress

    def threads_for(self, step: int) -> int:
        if not self.queue and self.next_trial is not None and step >= self.next_trial:
            self.queue = [1] * self.trial + [self.cpus] * self.trial
            self.times = {1: [], self.cpus: []}
            self.first_step = step
        n = self.queue[0] if self.queue else self.choice
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def record(self, step: int, seconds: float) -> str | None:
        if not self.queue:
            return None
        option = self.queue.pop(0)
        self.times[option].append(seconds)
        if option == self.cpus and seconds > self.cut * min(self.times[1]):
            self.queue = []  # all CPUs are already far slower: end the trial now
        if self.queue:
            return None
        best = {n: min(ts) for n, ts in self.times.items()}
        old, self.choice = self.choice, self.cpus if best[self.cpus] < best[1] else 1
        self.trials += 1
        if self.choice > 1:
            self.gap = self.every
        self.next_trial = step + 1 + self.gap
        if self.choice == 1:  # the next loss waits twice as long
            self.gap = min(2 * self.gap, 8 * self.every)
        if self.choice == old and self.trials > 1:
            return None
        return (f"threads: {self.choice} of {self.cpus} CPUs (steps {self.first_step}-{step}: 1 thread "
                f"{best[1]:.2f} s/step, {self.cpus} threads {best[self.cpus]:.2f} s/step; next check at step "
                f"{self.next_trial}; --threads N fixes it)")
