"""Multi-turn environments and the episode runner of multi-turn GRPO rollouts.

`Environment` (one per episode: `reset` opens it, `step` answers each model turn) and
`run_episodes`, which plays them against the inference engine and returns token-level
`Episode`s (action mask, log-probs, reward). Built in: `Calculator` (arithmetic with a
``calc`` tool) and `CodeRepair` (programs run against tests, with a second attempt). The
names are imported on first use (`astrai.lazy`): `CodeRepair` brings in the evaluation
sandbox, the runner the inference parameters. The runner reads the model's turns with the
server's tool-call parser family (`astrai.serve.tool_parsers`), as `Environment.tool_parser`
chooses.
"""

from typing import TYPE_CHECKING

from astrai.lazy import lazy_exports

if TYPE_CHECKING:
    from astrai.train.environments.base import Environment, StepResult
    from astrai.train.environments.calculator import Calculator
    from astrai.train.environments.code import CodeRepair
    from astrai.train.environments.episodes import Episode, run_episodes

__getattr__ = lazy_exports(
    globals(),
    {
        "astrai.train.environments.base": ("Environment", "StepResult"),
        "astrai.train.environments.calculator": ("Calculator",),
        "astrai.train.environments.code": ("CodeRepair",),
        "astrai.train.environments.episodes": ("Episode", "run_episodes"),
    },
)

__all__ = ["Calculator", "CodeRepair", "Environment", "Episode", "StepResult", "run_episodes"]
