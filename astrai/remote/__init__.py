"""A trainer's side of rollout replicas: `python -m astrai.serve` processes that generate
for it and receive its weights.

`ReplicaClient` (client.py) speaks to one replica's RL routes (`astrai.serve.rl_routes`);
`WeightSender` (weight_sender.py) pushes a policy's weights to replicas over a
`torch.distributed` group (weight_group.py) or from a safetensors directory. Imports
`astrai.inference`, never the trainer or the server.
"""

from typing import TYPE_CHECKING

from astrai.lazy import lazy_exports

if TYPE_CHECKING:
    from astrai.remote.client import (
        RemoteResult,
        ReplicaClient,
        ReplicaError,
        ReplicaUnavailable,
        StalePolicyVersion,
    )
    from astrai.remote.weight_sender import WeightSender

__getattr__ = lazy_exports(
    globals(),
    {
        "astrai.remote.client": (
            "RemoteResult",
            "ReplicaClient",
            "ReplicaError",
            "ReplicaUnavailable",
            "StalePolicyVersion",
        ),
        "astrai.remote.weight_sender": ("WeightSender",),
    },
)

__all__ = [
    "RemoteResult",
    "ReplicaClient",
    "ReplicaError",
    "ReplicaUnavailable",
    "StalePolicyVersion",
    "WeightSender",
]
