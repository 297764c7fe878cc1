"""Learning-rate schedules as multipliers of the peak LR: warmup + cosine (K3: 1% warmup, then cosine),
WSD (K2: warmup, stable, decay), constant.

`step` is the 0-based index of the optimizer step about to be taken. Warmup is linear from 0
(multiplier step / warmup, so step 0 runs at LR 0 and only fills optimizer moments).
"""

from __future__ import annotations

import math


def lr_multiplier(step: int, *, kind: str, warmup: int, total: int, min_ratio: float = 0.1,
                  decay_frac: float = 0.2, decay_shape: str = "linear") -> float:
    """Multiplier in [0, 1] at `step`.

    - "cosine": after warmup, half-cosine from 1 at `warmup` to `min_ratio` at `total` (then flat).
    - "wsd": 1 until the decay starts at `total - round(decay_frac * total)` (never before warmup
      ends), then down to `min_ratio` at `total`, shaped "linear", "sqrt" (1 - sqrt(progress), the
      WSD paper's form) or "cosine".
    - "constant": 1 after warmup.
    """
    if warmup > 0 and step < warmup:
        return step / warmup
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        span = max(total - warmup, 1)
        p = min(max((step - warmup) / span, 0.0), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    if kind == "wsd":
        start = max(total - round(decay_frac * total), warmup)
        if step < start:
            return 1.0
        p = min((step - start) / max(total - start, 1), 1.0)
        if decay_shape == "linear":
            f = 1 - p
        elif decay_shape == "sqrt":
            f = 1 - math.sqrt(p)
        elif decay_shape == "cosine":
            f = 0.5 * (1 + math.cos(math.pi * p))
        else:
            raise ValueError(f"unknown decay_shape {decay_shape!r}")
        return min_ratio + (1 - min_ratio) * f
    raise ValueError(f"unknown schedule kind {kind!r}")


class LRSchedule:
    """Applies `lr_multiplier` to anything with `set_lr_multiplier(m)` (an `OptimizerSet`).

    Construction applies step 0; call `step()` after each optimizer step (like torch schedulers).
    `state_dict` holds the step count, so a resumed run continues the same curve.
    """

    def __init__(self, optimizer, *, kind: str = "cosine", warmup: int, total: int, min_ratio: float = 0.1,
                 decay_frac: float = 0.2, decay_shape: str = "linear") -> None:
        self.optimizer = optimizer
        self.kw = dict(kind=kind, warmup=warmup, total=total, min_ratio=min_ratio, decay_frac=decay_frac,
                       decay_shape=decay_shape)
        lr_multiplier(0, **self.kw)  # validate the arguments early
        self.step_count = 0
        self._apply()

    @property
    def multiplier(self) -> float:
        return lr_multiplier(self.step_count, **self.kw)

    def _apply(self) -> None:
        self.optimizer.set_lr_multiplier(self.multiplier)

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step": self.step_count, **self.kw}

    def load_state_dict(self, sd: dict) -> None:
        self.step_count = int(sd["step"])
        self._apply()
