"""``strategy.rollout``: where GRPO's rollouts are generated (``rollout.*`` on the command
line).

``mode: colocate`` (the default): on the trainer's own engine, on the live weights
(:class:`Colocate`; the asynchronous generator on a copy of the policy). ``mode: server``
(:class:`ServerRollout`; TRL's ``vllm_mode="server"``): on rollout replicas, ``python -m
astrai.serve allow_weight_updates=true ...`` processes at ``servers``, which receive the
trainer's weights at each policy version over a ``torch.distributed`` group
(``weight_sync``) and generate each prompt group on one replica
(:mod:`astrai.train.remote_policy`). Checked once, before the model is built; every error
names its key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from astrai.train.policy_engine import PolicyEngine
from astrai.train.remote_policy import RemotePolicy, replica_channel

MODES = ("colocate", "server")
BACKENDS = ("gloo", "nccl")


class Colocate:
    """Rollouts on the trainer's own engine (``PolicyEngine``): nothing to set up."""

    mode = "colocate"

    def engine(self, policy_engine: PolicyEngine) -> PolicyEngine:
        return policy_engine

    def generator_weights(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The asynchronous generator's model: a copy of the policy."""
        from astrai.train.strategies.grpo.async_source import policy_copy

        return policy_copy(policy)

    def generator(self, trainer_engine: PolicyEngine, model: torch.nn.Module) -> PolicyEngine:
        """The asynchronous generator's engine: its own, on ``model``, sized as the
        trainer's."""
        _, tokenizer = trainer_engine.live()
        engine = PolicyEngine(lambda: (model, tokenizer), trainer_engine.factory)
        engine.needs = list(trainer_engine.needs)
        return engine


@dataclass(frozen=True)
class WeightSync:
    """``rollout.weight_sync``: the group the trainer (rank 0, hosting its store at
    ``master_address:master_port``, an address the replicas reach; 0: a free port) pushes
    weights over, with ``backend`` (gloo through the CPU, nccl GPU to GPU) and ``timeout``
    (seconds, the group's formation and each collective)."""

    master_address: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"
    timeout: float = 300.0


@dataclass(frozen=True)
class ServerRollout:
    """Rollouts on replicas at ``servers`` (``api_key`` when they have one; ``timeout``
    seconds per generation request)."""

    servers: tuple[str, ...]
    api_key: str | None = None
    timeout: float = 600.0
    weight_sync: WeightSync = WeightSync()

    mode = "server"

    def engine(self, policy_engine: PolicyEngine) -> RemotePolicy:
        """The trainer's rollout engine: the replicas (nothing contacted yet), fed from the
        policy engine's weights (the live model, or under FSDP2 its copy gathered from the
        shards), as long in context as its engine would be."""
        sync = self.weight_sync
        channel = replica_channel(
            self.servers,
            api_key=self.api_key,
            timeout=self.timeout,
            max_seq_len=_max_seq_len(policy_engine),
            master_address=sync.master_address,
            master_port=sync.master_port,
            backend=sync.backend,
            sync_timeout=sync.timeout,
        )
        return RemotePolicy(channel, policy_engine.live, _engine_weights(policy_engine))

    def generator_weights(self, policy: torch.nn.Module) -> SnapshotWeights:
        """The asynchronous generator's weights: the snapshots, no copy of the model."""
        return SnapshotWeights(policy)

    def generator(self, trainer_engine: RemotePolicy, holder: SnapshotWeights) -> RemotePolicy:
        """The asynchronous generator's rollout engine: the same replicas, fed from the
        weight snapshots its jobs carry."""
        return RemotePolicy(trainer_engine.channel, trainer_engine.live, holder.named)


class SnapshotWeights:
    """The asynchronous generator's weights in server mode: a snapshot of the policy as
    the generator starts, then the latest snapshot a job loaded (``load_state_dict``, as the
    colocated generator's model takes it). It is kept (one copy of the weights, where the
    colocated generator keeps a whole model): a push of the same step again reads it."""

    def __init__(self, policy: torch.nn.Module) -> None:
        from astrai.train.strategies.grpo.async_source import weight_snapshot

        self.state: Mapping[str, torch.Tensor] = weight_snapshot(policy)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state

    def named(self, step: int) -> list[tuple[str, torch.Tensor]]:
        return list(self.state.items())


def _engine_weights(policy_engine: PolicyEngine):
    def named(step: int) -> list[tuple[str, torch.Tensor]]:
        live, _ = policy_engine.live()
        weights = policy_engine.weights
        weights.refresh(live, step)  # FSDP2: gathered from the shards (every rank)
        return list(weights.engine_model(live).named_parameters())

    return named


def _max_seq_len(policy_engine: PolicyEngine) -> int:
    sizes = policy_engine.merged_sizes()
    if "max_seq_len" not in sizes:
        raise ValueError(
            "strategy.rollout.mode=server needs strategy.engine.max_seq_len (the context the "
            "replicas' engines have at least)"
        )
    return int(sizes["max_seq_len"])


RolloutMode = Colocate | ServerRollout


def parse_rollout(spec: Any) -> RolloutMode:
    """``strategy.rollout`` (None: colocate), checked; every error names its key."""
    if spec is None:
        return Colocate()
    if not isinstance(spec, Mapping):
        raise ValueError(f"strategy.rollout must be a mapping like {{mode: server}}, got {spec!r}")
    known = {"mode", "servers", "api_key", "timeout", "weight_sync"}
    unknown = set(spec) - known
    if unknown:
        raise ValueError(
            f"strategy.rollout: unknown key(s) {sorted(unknown)}; known: {sorted(known)}"
        )
    mode = spec.get("mode", "colocate")
    if mode not in MODES:
        raise ValueError(f"strategy.rollout.mode must be one of {MODES}, got {mode!r}")
    servers = spec.get("servers") or []
    if isinstance(servers, str):
        servers = [servers]
    if mode == "colocate":
        if servers:
            raise ValueError(
                "strategy.rollout.servers is set but strategy.rollout.mode=colocate: set "
                "rollout.mode=server to generate on them"
            )
        return Colocate()
    if not servers:
        raise ValueError(
            "strategy.rollout.mode=server needs strategy.rollout.servers, e.g. "
            "rollout.servers=[http://host-a:8000,http://host-b:8000] (replicas started with "
            "python -m astrai.serve allow_weight_updates=true; docs/scaling.md)"
        )
    for url in servers:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"strategy.rollout.servers: {url!r} is not an http(s):// address of a replica"
            )
    if len(set(servers)) != len(servers):
        raise ValueError(f"strategy.rollout.servers: a replica is listed twice: {servers}")
    timeout = spec.get("timeout", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"strategy.rollout.timeout must be seconds > 0, got {timeout!r}")
    return ServerRollout(
        servers=tuple(servers),
        api_key=spec.get("api_key"),
        timeout=float(timeout),
        weight_sync=_weight_sync(spec.get("weight_sync")),
    )


def _weight_sync(spec: Any) -> WeightSync:
    if spec is None:
        return WeightSync()
    if not isinstance(spec, Mapping):
        raise ValueError(f"strategy.rollout.weight_sync must be a mapping, got {spec!r}")
    names = {f.name for f in fields(WeightSync)}
    unknown = set(spec) - names
    if unknown:
        raise ValueError(
            f"strategy.rollout.weight_sync: unknown key(s) {sorted(unknown)}; known: "
            f"{sorted(names)}"
        )
    out = WeightSync(**dict(spec))
    if out.backend not in BACKENDS:
        raise ValueError(
            f"strategy.rollout.weight_sync.backend must be one of {BACKENDS}, got {out.backend!r}"
        )
    port = out.master_port
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(
            f"strategy.rollout.weight_sync.master_port must be a port (0: a free one), got {port!r}"
        )
    if not isinstance(out.timeout, (int, float)) or out.timeout <= 0:
        raise ValueError(
            f"strategy.rollout.weight_sync.timeout must be seconds > 0, got {out.timeout!r}"
        )
    return out


__all__ = [
    "Colocate",
    "RolloutMode",
    "ServerRollout",
    "SnapshotWeights",
    "WeightSync",
    "parse_rollout",
]
