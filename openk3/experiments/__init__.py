"""Experiments: each claim of the project as a run with a control and a 95 % interval (issue 30, item 3).

    openk3 experiment --list
    openk3 experiment rl-heldout --profile smoke --seed 0 --out runs/exp/rl-heldout

    from openk3.experiments import run_experiment
    result = run_experiment("mopd-vs-merge", "smoke", seed=0, out="runs/exp/mopd")   # the result.json dict

An experiment module has NAME, CLAIM, METRIC, PROFILES ({profile name: its settings}) and `run(profile, s,
seed, say, out) -> result.Result` (called with one of its PROFILES and that profile's settings `s`; `out`, the
experiment's folder, keeps what a full profile can continue from); the shared part (the result schema, the
verdict rule, result.json and result.png) is `result.py`, the trained arms `arms.py`, the smoke profiles' tiny
model and tasks `tasks.py`, the full profiles' start, problems and evaluation `full.py`; the scaling
lab's five compute-multiplier experiments are objects of `scaling.py` (on `openk3.scaling`). Rooms, bottom to
top: tasks and full, then result and arms, then the experiments.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

#: name -> module; the order of `openk3 experiment --list`
EXPERIMENTS = {
    "rl-heldout": "openk3.experiments.rl_heldout",
    "mopd-vs-merge": "openk3.experiments.mopd_vs_merge",
    "effort-budget": "openk3.experiments.effort_budget",
    # the scaling lab (issue 31): one shared module, an object per claim
    "k3-vs-k2": "openk3.experiments.scaling:k3_vs_k2",
    "attnres": "openk3.experiments.scaling:attnres",
    "latent-moe": "openk3.experiments.scaling:latent_moe",
    "kda-hybrid": "openk3.experiments.scaling:kda_hybrid",
    "muon-vs-adamw": "openk3.experiments.scaling:muon_vs_adamw",
}


def experiment(name: str) -> ModuleType:
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r} (experiments: {', '.join(EXPERIMENTS)})")
    path, _, attr = EXPERIMENTS[name].partition(":")
    module = importlib.import_module(path)
    return getattr(module, attr) if attr else module


def run_experiment(name: str, profile: str, seed: int, out: str | os.PathLike, say=None,
                   overrides: dict | None = None) -> dict:
    """Run experiment `name` at `profile` with `seed`, write out/result.json and out/result.png; returns the
    JSON form. `say(line)`: progress (default: the "[experiment]" reporter). `overrides`: settings that replace
    the profile's (tests run a full profile's code at toy sizes so; the result records the settings used)."""
    from pathlib import Path

    from openk3.experiments.result import write_result

    module = experiment(name)
    if profile not in module.PROFILES:
        raise ValueError(f"{name}: profile {profile!r} is not available (available: {', '.join(module.PROFILES)})")
    if say is None:
        from openk3.log import reporter

        say = reporter("experiment").info
    settings = dict(module.PROFILES[profile])
    unknown = sorted(set(overrides or {}) - set(settings))
    if unknown:
        raise ValueError(f"{name}: unknown settings {unknown} for profile {profile!r} (settings: {sorted(settings)})")
    settings.update(overrides or {})
    Path(out).mkdir(parents=True, exist_ok=True)
    result = module.run(profile, settings, seed, say, Path(out))
    return write_result(result, out)
