"""How many CPU threads a training run uses when nobody said: all CPUs or one, whichever steps faster now.

Why measure instead of fixing a number: on the small shared machines openk3 is built and tested on, a second
OpenMP thread is worth 1.5x on a nano training step while the host gives the process both vCPUs, and costs
2.6x (a step 2.6 times slower than on one thread) while another process or the host takes one of them:
OpenMP's spinning threads then wait for milliseconds at every small matmul (measured in
`docs/benchmarks.md`, "Threads"). Which of the two a machine is in changes by the minute. So `openk3 train`
runs a short trial of each candidate every `every` steps (`trial` steps each, first after a warm-up step),
keeps the faster, and says when its choice changes.

A change of thread count changes the summation order inside matmuls (results differ at ~1e-7 relative), so
an auto run is not bit-reproducible from run to run; `--threads N` (or $OPENK3_THREADS / $OMP_NUM_THREADS)
fixes the count, and the tests run that way (`common.fixed_threads`, `common.cpus_available`).
"""

from __future__ import annotations

import torch


class ThreadTuner:
    """Picks torch's thread count among `options` (all CPUs, then one) from measured step times.

    Use: `n = tuner.threads_for(step)` before each training step (it calls torch.set_num_threads when the
    count changes) and `tuner.record(step, seconds)` after it; `record` returns a line to print when the choice
    changes. Trial windows start at step `first` and every `every` steps after: `trial` steps on each option in
    turn; the option with the shortest step in its window wins (the minimum, as one slow step is host noise).
    """

    def __init__(self, cpus: int, *, every: int = 200, trial: int = 2, first: int = 2) -> None:
        assert cpus >= 1 and every > trial * 2 and trial >= 1
        self.options = [cpus, 1] if cpus > 1 else [1]
        self.every, self.trial, self.first = every, trial, first
        self.choice = self.options[0]
        self.times: dict[int, list[float]] = {}
        self.trials = 0  # windows completed

    def _trial_option(self, step: int) -> int | None:
        """The option step `step` (1-based) tries, or None outside a trial window."""
        if len(self.options) == 1 or step < self.first:
            return None
        offset = (step - self.first) % self.every
        slot = offset // self.trial
        return self.options[slot] if slot < len(self.options) else None

    def threads_for(self, step: int) -> int:
        n = self._trial_option(step) or self.choice
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def record(self, step: int, seconds: float) -> str | None:
        option = self._trial_option(step)
        if option is None:
            return None
        self.times.setdefault(option, []).append(seconds)
        last_slot = (step - self.first) % self.every == self.trial * len(self.options) - 1
        if not last_slot:
            return None
        best = {n: min(ts) for n, ts in self.times.items()}
        self.times = {}
        self.trials += 1
        old, self.choice = self.choice, min(best, key=lambda n: (best[n], -n))  # a tie keeps more threads
        if self.choice == old and self.trials > 1:
            return None
        first, last = step - self.trial * len(self.options) + 1, step
        timing = ", ".join(f"{n} thread{'s' if n > 1 else ''} {best[n]:.2f} s/step" for n in self.options)
        return (f"threads: {self.choice} of {self.options[0]} CPUs (steps {first}-{last}: {timing}; rechecked every "
                f"{self.every} steps; --threads N fixes it)")
