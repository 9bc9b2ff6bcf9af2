"""PPO's own options (``conf/strategy/ppo.yaml``), checked before any model is built.

Everything else a PPO run takes is GRPO's (rollouts, rewards, the policy loss and its clip,
the KL to a reference): :class:`~astrai.train.strategies.grpo.options.GRPOOptions`. The names
are verl's (``algorithm.gamma``, ``algorithm.lam``, ``algorithm.use_kl_in_reward``,
``algorithm.kl_penalty``, ``critic.cliprange_value``, ``critic.optim.lr``,
``trainer.critic_warmup``, ``critic.grad_clip``) and TRL's (``vf_coef``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from astrai.model.value import check_value_source
from astrai.train.strategies.grpo.rewards import plain_config
from astrai.train.strategies.ppo.gae import KL_PENALTIES

#: the keys of ``strategy.critic``
CRITIC_KEYS = ("init", "lr", "warmup_steps", "cliprange_value", "vf_coef", "grad_clip")


def _unit(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"PPO {name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _positive(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"PPO {name} must be a number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CriticOptions:
    """``strategy.critic``.

    Attributes:
        init: ``policy`` (a copy of the policy's backbone at its start, after ``init_from``,
            with a fresh value head) or a path: a critic export (``*ForTokenClassification``),
            a reward-model export (its ``score`` head) or a causal-LM export (its backbone,
            a fresh head); checked (config and weight index only) before loading.
        lr: the critic's learning rate: its own parameter group in the run's one optimizer
            (the schedule's multiplier applies to it too).
        warmup_steps: verl's ``critic_warmup``: the first this many optimizer steps train
            the critic alone (the policy loss weighted 0, its gradients dropped: the policy's
            weights do not move).
        cliprange_value: the prediction's clip around the rollout-time value (TRL, verl).
        vf_coef: the value loss's weight in the total loss (TRL).
        grad_clip: the critic's gradient-norm clip, apart from the policy's
            (``trainer.gradient_clip_val``); None: not clipped.
    """

    init: str = "policy"
    lr: float = 1e-5
    warmup_steps: int = 0
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    grad_clip: float | None = 1.0

    @classmethod
    def parse(cls, spec: Mapping[str, Any] | None) -> CriticOptions:
        spec = dict(spec or {})
        unknown = sorted(set(spec) - set(CRITIC_KEYS))
        if unknown:
            raise ValueError(
                f"PPO strategy.critic: unknown key(s) {unknown}; the keys are {CRITIC_KEYS}"
            )
        init = spec.get("init", "policy")
        if not isinstance(init, str) or not init:
            raise ValueError(f"PPO critic.init must be 'policy' or a path, got {init!r}")
        if init != "policy":
            try:
                check_value_source(init)
            except ValueError as err:
                raise ValueError(f"PPO critic.init: {err}") from err
        warmup = spec.get("warmup_steps", 0)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"PPO critic.warmup_steps must be an int >= 0, got {warmup!r}")
        vf_coef = _positive("critic.vf_coef", spec.get("vf_coef", 0.1))
        clip = spec.get("grad_clip", 1.0)
        return cls(
            init=init,
            lr=_positive("critic.lr", spec.get("lr", 1e-5)),
            warmup_steps=int(warmup),
            cliprange_value=_positive("critic.cliprange_value", spec.get("cliprange_value", 0.2)),
            vf_coef=vf_coef,
            grad_clip=None if clip is None else _positive("critic.grad_clip", clip),
        )


@dataclass(frozen=True)
class PPOOptions:
    """PPO's options beside GRPO's.

    Attributes:
        critic: :class:`CriticOptions`.
        gamma: GAE's discount, in [0, 1] (verl's default 1).
        lam: GAE's lambda, in [0, 1] (verl's default 1: the Monte-Carlo return minus the
            value; 0: the one-step TD error).
        use_kl_in_reward: verl's: ``-kl_coef * kl`` on every completion token's reward (the
            KL of the rollout policy to the reference by ``kl_penalty``), and no KL term in
            the loss; needs ``kl_coef > 0`` (the reference is kept for it).
        kl_penalty: the estimator: ``kl`` | ``abs`` | ``mse`` | ``low_var_kl`` (verl's).
    """

    critic: CriticOptions = field(default_factory=CriticOptions)
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"

    #: the keys that are PPO's, not GRPO's (``gamma`` is GRPO's reinforce_pp discount too)
    KEYS = ("critic", "gamma", "lam", "use_kl_in_reward", "kl_penalty")

    @classmethod
    def split(cls, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``kwargs`` as (PPO's own options, the rest: GRPO's and ``LMModule``'s)."""
        mine = {k: v for k, v in kwargs.items() if k in cls.KEYS}
        return mine, {k: v for k, v in kwargs.items() if k not in cls.KEYS}

    @classmethod
    def parse(
        cls,
        *,
        critic: Mapping[str, Any] | None = None,
        gamma: float = 1.0,
        lam: float = 1.0,
        use_kl_in_reward: bool = False,
        kl_penalty: str = "kl",
        kl_coef: float = 0.0,
    ) -> PPOOptions:
        """The options as the YAML gives them (``kl_coef``: GRPO's, read for the check)."""
        if kl_penalty not in KL_PENALTIES:
            raise ValueError(f"PPO kl_penalty must be one of {KL_PENALTIES}, got {kl_penalty!r}")
        if not isinstance(use_kl_in_reward, bool):
            raise ValueError(
                f"PPO use_kl_in_reward must be true or false, got {use_kl_in_reward!r}"
            )
        if use_kl_in_reward and not float(kl_coef) > 0:
            raise ValueError(
                "PPO use_kl_in_reward=true puts -kl_coef * kl on the rewards: set "
                f"strategy.kl_coef > 0 (got {kl_coef})"
            )
        return cls(
            critic=CriticOptions.parse(_critic_spec(critic)),
            gamma=_unit("gamma", gamma),
            lam=_unit("lam", lam),
            use_kl_in_reward=use_kl_in_reward,
            kl_penalty=kl_penalty,
        )


def _critic_spec(spec: Any) -> Mapping[str, Any] | None:
    spec = plain_config(spec)
    if spec is not None and not isinstance(spec, Mapping):
        raise ValueError(f"PPO strategy.critic must be a mapping of {CRITIC_KEYS}, got {spec!r}")
    return spec
