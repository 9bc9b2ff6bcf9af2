"""GRPO: the module (options, loss, advantages, reference, Lightning hooks) and the rollout
sources it trains on (engine, asynchronous, ledger replay); docs/training.md ("GRPO")."""

from astrai.train.strategies.grpo.generation import Rollouts, build_rollouts
from astrai.train.strategies.grpo.module import GRPOModule
from astrai.train.strategies.grpo.options import GRPOOptions
from astrai.train.strategies.grpo.reward_pool import score
from astrai.train.strategies.grpo.rewards import parse_rewards
from astrai.train.strategies.grpo.source import RolloutSource

__all__ = [
    "GRPOModule",
    "GRPOOptions",
    "RolloutSource",
    "Rollouts",
    "build_rollouts",
    "parse_rewards",
    "score",
]
