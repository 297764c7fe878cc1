"""Verifiable task families for agentic RL (offline, generated from a seed, graded in a verifier fork).

    from openk3.agent.tasks import generate, families
    task = generate("tool_arith", seed=3, difficulty=2, split="test")

Families: `fix_test` (fix seeded bugs in a tiny Python repo), `data_wrangle` (CSV/JSON/SQLite aggregates),
`tool_arith` (multi-step arithmetic through the key-value store), `multi_hop` (multi-hop retrieval across notes
files, with decoys) and `implement_spec` (implement a list function from a one-sentence spec). See base.py
for the Task record, the registry, the splits and the grader protocol.
"""

# the families: each module registers its own on import (the registry, base.py, imports none of them)
from openk3.agent.tasks import data_wrangle, fix_test, implement_spec, multi_hop, tool_arith  # noqa: F401
from openk3.agent.tasks.base import (
    FAMILIES,
    SPLITS,
    Call,
    Family,
    Task,
    families,
    generate,
    parse_grade,
    register,
    run_calls,
    split_of,
)

__all__ = ["FAMILIES", "SPLITS", "Call", "Family", "Task", "families", "generate", "parse_grade",
           "register", "run_calls", "split_of"]
