"""The agent runtime: sandboxes with persistent, forkable state, K3's tools, permissions, an RL environment.

`Sandbox` (sandbox.py) is the kernel boundary; `agentd.py` and `toolbox*.py` run inside it; the rest runs
on the host. `SandboxEnv` (env.py) is the Gymnasium-style environment on token ids, `run_episode`
(episode.py) drives a model through it. See docs/agents.md for the threat model and the API.
"""

from .env import Obs, SandboxEnv
from .episode import Trajectory, run_episode
from .sandbox import Limits, RunResult, Sandbox, SandboxError, SandboxUnavailable, unavailable_reason

__all__ = ["Limits", "Obs", "RunResult", "Sandbox", "SandboxEnv", "SandboxError", "SandboxUnavailable",
           "Trajectory", "run_episode", "unavailable_reason"]
