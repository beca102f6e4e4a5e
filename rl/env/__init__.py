"""Text environments for multi-turn rollouts: `reset(seed) -> observation`, `step(action) -> StepResult`.

`make_env(name, ...)` builds one of the embedded environments (no download): `calc`, the tool-use
arithmetic environment on GSM8K-format problems, and `grid`, a seeded 4x4 frozen-lake puzzle.
"""

from rl.env.base import Environment, StepResult
from rl.env.calc import CalcEnv, safe_eval
from rl.env.grid import GridEnv

__all__ = ["CalcEnv", "Environment", "GridEnv", "StepResult", "safe_eval"]
