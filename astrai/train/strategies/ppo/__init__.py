"""PPO with a learned critic: the module (GRPO's rollouts and policy loss, a value model,
GAE), its options, GAE and the clipped value loss; docs/training.md ("PPO")."""

from astrai.train.strategies.ppo.module import CRITIC_DIR, PPOModule
from astrai.train.strategies.ppo.options import CriticOptions, PPOOptions

__all__ = ["CRITIC_DIR", "CriticOptions", "PPOModule", "PPOOptions"]
