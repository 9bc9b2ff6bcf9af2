"""GRPO's rewards: the weighted sum of ``strategy.rewards`` (registry names of
:mod:`astrai.data.rewards` or Hydra ``_target_`` entries; see docs/rewards.md), parsed and
checked before any model is built."""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf

from astrai.data.rewards import RewardFn, get_reward


class WeightedReward(tuple):
    """One parsed ``strategy.rewards`` entry: the ``(name, weight)`` pair it is logged and
    summed under, which it compares equal to (the config's short form), plus the built
    callable :attr:`fn` that scores, its :attr:`timeout` (seconds per call; None: none) and
    the :attr:`failure_value` a failed, non-finite or timed-out call gives
    (:mod:`~astrai.train.strategies.grpo.reward_pool`)."""

    fn: RewardFn
    timeout: float | None
    failure_value: float

    def __new__(
        cls,
        name: str,
        weight: float,
        fn: RewardFn,
        timeout: float | None = None,
        failure_value: float = 0.0,
    ) -> WeightedReward:
        self = super().__new__(cls, (name, weight))
        self.fn = fn
        self.timeout = timeout
        self.failure_value = failure_value
        return self

    @property
    def name(self) -> str:
        return self[0]

    @property
    def weight(self) -> float:
        return self[1]

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self[0], self[1], self.fn, self.timeout, self.failure_value))

    def __repr__(self) -> str:
        return f"WeightedReward({self[0]!r}, {self[1]!r}, {self.fn!r})"


def _weight(value: Any, where: str) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        weight = math.nan
    if not math.isfinite(weight):
        raise ValueError(f"{where}.weight must be a finite number, got {value!r}")
    return weight


def _timeout(value: Any, where: str) -> float | None:
    if value is None:
        return None
    try:
        timeout = float(value)
    except (TypeError, ValueError):
        timeout = math.nan
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"{where}.timeout must be a number of seconds > 0 or null, got {value!r}")
    return timeout


def _failure_value(value: Any, where: str) -> float:
    try:
        failure = float(value)
    except (TypeError, ValueError):
        failure = math.nan
    if not math.isfinite(failure):
        raise ValueError(f"{where}.failure_value must be a finite number, got {value!r}")
    return failure


def _takes_timeout(target: Any) -> bool:
    """Whether a ``_target_`` takes a ``timeout`` argument of its own (e.g. ``CodeTests``:
    seconds per program), which then stays the target's."""
    try:
        return "timeout" in inspect.signature(get_object(str(target))).parameters
    except Exception:  # not importable or no signature: _built reports it
        return False


def _call_timeout(spec: dict[str, Any], where: str) -> Any:
    """The entry's time limit per call (taken out of ``spec``): ``call_timeout``, or
    ``timeout`` unless the ``_target_`` takes a ``timeout`` itself."""
    limit = spec.pop("call_timeout", None)
    if "timeout" in spec and not ("_target_" in spec and _takes_timeout(spec["_target_"])):
        if limit is not None:
            raise ValueError(f"{where}: give timeout or call_timeout, not both")
        limit = spec.pop("timeout")
    return limit


def _registered(name: Any, where: str) -> RewardFn:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a reward name must be a non-empty string, got {name!r}")
    try:
        return get_reward(name)
    except KeyError as err:
        raise KeyError(f"{where}: {err.args[0]}") from None
    except (ImportError, TypeError) as err:
        raise type(err)(f"{where}: {err}") from err


def _built(spec: dict[str, Any], where: str) -> RewardFn:
    """Instantiate a ``_target_`` entry (weight and name already taken out)."""
    target = spec["_target_"]
    if not isinstance(target, str) or not target:
        raise ValueError(f"{where}._target_ must be a dotted import path, got {target!r}")
    try:
        obj = get_object(target)
    except Exception as err:  # Hydra raises ImportError, or others from the module itself
        raise ImportError(f"{where}: _target_ {target!r} is not importable: {err}") from err
    partial = bool(spec.get("_partial_", False))
    if partial and inspect.isclass(obj):
        raise ValueError(
            f"{where}: _partial_ on the class {target!r} makes a constructor, not a reward: "
            "drop _partial_ (the instance is the reward)"
        )
    try:
        fn = instantiate(spec, _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__ or err
        called_fn = not partial and not inspect.isclass(obj) and isinstance(cause, TypeError)
        hint = " (a reward function needs `_partial_: true`)" if called_fn else ""
        raise ValueError(f"{where}: building _target_ {target!r} failed: {cause}{hint}") from err
    if not callable(fn):
        hint = (
            "" if partial or inspect.isclass(obj) else "; a reward function needs `_partial_: true`"
        )
        raise TypeError(
            f"{where}: _target_ {target!r} built a {type(fn).__name__}, which is not "
            f"callable as reward(record, completion){hint}"
        )
    return fn


def _reward_of(entry: Any, where: str) -> WeightedReward:
    """One ``strategy.rewards`` entry as a :class:`WeightedReward`."""
    if isinstance(entry, WeightedReward):
        return entry
    if isinstance(entry, str):
        return WeightedReward(entry, 1.0, _registered(entry, where))
    if isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str):
        return WeightedReward(entry[0], _weight(entry[1], where), _registered(entry[0], where))
    if not isinstance(entry, Mapping):
        built = " (already built: reward entries must reach parse_rewards as config)"
        raise TypeError(
            f"{where}: expected a reward name, {{name, weight}} or {{_target_, ...}}, got a "
            f"{type(entry).__name__}{built if callable(entry) else ''}"
        )
    spec = dict(entry)
    weight = _weight(spec.pop("weight", 1.0), where)
    name = spec.pop("name", None)
    limits = {
        "timeout": _timeout(_call_timeout(spec, where), where),
        "failure_value": _failure_value(spec.pop("failure_value", 0.0), where),
    }
    if "_target_" in spec:
        if name is None:
            name = str(spec["_target_"]).rsplit(".", 1)[-1]
        elif not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name must be a non-empty string, got {name!r}")
        return WeightedReward(name, weight, _built(spec, where), **limits)
    if name is None:
        raise KeyError(
            f"{where} needs 'name' (a registered reward) or '_target_' (an import path); "
            f"it has {sorted(entry)}"
        )
    if spec:
        raise ValueError(
            f"{where}: unknown keys {sorted(spec)} for registered reward {name!r} (takes "
            "name, weight, timeout and failure_value); options go with `_target_: <import path>`"
        )
    return WeightedReward(name, weight, _registered(name, where), **limits)


def parse_rewards(rewards: Any, where: str = "strategy.rewards") -> list[WeightedReward]:
    """Config -> :class:`WeightedReward` list, each reward built once, so a bad entry fails
    here, before any model is built, naming ``strategy.rewards[i]``.

    Accepted: a name, a ``{name: weight}`` mapping, or a list whose entries are a registered
    name, ``{name, weight}``, a ``(name, weight)`` pair, or ``{_target_, weight?, name?,
    _partial_?, **kwargs}`` (a function with ``_partial_: true`` or a class whose instance is
    the reward; Hydra builds it after ``weight``, default 1, and ``name``, default the
    target's last dotted component, are taken out). Every entry may add ``timeout``
    (seconds per call; ``call_timeout`` when the target takes a ``timeout`` of its own, as
    ``CodeTests`` does) and ``failure_value``. Log names must be unique."""
    rewards = plain_config(rewards)
    if isinstance(rewards, str):
        entries: list[tuple[Any, str]] = [(rewards, where)]
    elif isinstance(rewards, Mapping) and ("_target_" in rewards or "name" in rewards):
        entries = [(rewards, where)]
    elif isinstance(rewards, Mapping):
        entries = [((str(k), v), f"{where}.{k}") for k, v in rewards.items()]
    elif isinstance(rewards, (list, tuple)):
        entries = [(r, f"{where}[{i}]") for i, r in enumerate(rewards)]
    else:
        raise TypeError(f"{where}: expected a reward name, a list or a mapping, got {rewards!r}")
    if not entries:
        raise ValueError(f"GRPO needs at least one reward ({where} is empty)")
    items = [_reward_of(entry, at) for entry, at in entries]
    seen: dict[str, str] = {}
    for item, (_, at) in zip(items, entries):
        if item.name in seen:
            raise ValueError(
                f"{at}: reward name {item.name!r} is already used by {seen[item.name]}; give "
                "one of them another `name:` (it is the logged metric's name)"
            )
        seen[item.name] = at
    return items


def plain_config(config: Any) -> Any:
    """An OmegaConf node as plain containers (``rewards``, ``environment``,
    ``async_rollouts``: what their parsers read); anything else as it is."""
    return OmegaConf.to_container(config, resolve=True) if OmegaConf.is_config(config) else config
