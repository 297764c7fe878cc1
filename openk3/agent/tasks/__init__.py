"""Verifiable task families for agentic RL (offline, generated from a seed, graded in a verifier fork).

    from openk3.agent.tasks import generate, families
    task = generate("tool_arith", seed=3, difficulty=2, split="test")

Families: `fix_test` (fix seeded bugs in a tiny Python repo), `data_wrangle` (CSV/JSON/SQLite aggregates),
`tool_arith` (multi-step arithmetic through the key-value store). See base.py for the Task record, the
splits and the grader protocol.
"""

from .base import FAMILIES, SPLITS, Call, Family, Task, generate, parse_grade, register, run_calls, split_of

FAMILY_MODULES = ("fix_test", "data_wrangle", "tool_arith")


def _load_families() -> None:
    """Import the family modules (each registers itself); idempotent."""
    import importlib

    for name in FAMILY_MODULES:
        importlib.import_module(f"{__name__}.{name}")


def families() -> list[str]:
    _load_families()
    return sorted(FAMILIES)


__all__ = ["FAMILIES", "SPLITS", "Call", "Family", "Task", "families", "generate", "parse_grade", "register",
           "run_calls", "split_of"]
