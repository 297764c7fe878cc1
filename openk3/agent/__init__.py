"""The agent runtime: sandboxes with persistent, forkable state, K3's tools, permissions, an RL environment.

`Sandbox` (sandbox.py) is the kernel boundary; `agentd.py` and `toolbox*.py` run inside it; the rest runs
on the host. See docs/agents.md for the threat model and the API.
"""

from .sandbox import Limits, RunResult, Sandbox, SandboxError, SandboxUnavailable, unavailable_reason

__all__ = ["Limits", "RunResult", "Sandbox", "SandboxError", "SandboxUnavailable", "unavailable_reason"]
