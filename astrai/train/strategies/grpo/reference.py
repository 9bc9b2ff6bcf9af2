"""Moving the reference policy towards the live one (TR-DPO, Gorbatovski et al. 2024).

TRL calls it ``sync_ref_model`` with ``ref_model_sync_steps`` and ``ref_model_mixup_alpha``:
every ``sync_interval`` optimizer steps ``ref <- alpha * policy + (1 - alpha) * ref``
(``alpha = 1``: a plain copy). The reference then changes during training, so it must travel
in the checkpoint for a resumed run to be exact (:func:`reference_state` /
:func:`load_reference_state`).

Under ``trainer=fsdp2`` the reference and the policy are sharded alike (one mesh, one unit
per block), so the move is a local operation on each rank's shards; the checkpoint keeps the
reference whole (gathered tensor by tensor), so it loads at any number of ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from astrai.train.engine_weights import full_cpu_state, load_full_state


def check_sync_options(sync_interval: int, sync_alpha: float, kl_coef: float) -> None:
    """Raise a ValueError naming the bad field."""
    if isinstance(sync_interval, bool) or int(sync_interval) != sync_interval or sync_interval < 0:
        raise ValueError(f"GRPO sync_interval must be an int >= 0 (0: frozen), got {sync_interval}")
    if not 0.0 < float(sync_alpha) <= 1.0:
        raise ValueError(f"GRPO sync_alpha must be in (0, 1], got {sync_alpha}")
    if sync_interval and not kl_coef:
        raise ValueError(
            "GRPO sync_interval > 0 needs kl_coef > 0: with kl_coef 0 no reference model is kept"
        )


@torch.no_grad()
def sync_reference(reference: nn.Module, policy: nn.Module, alpha: float = 1.0) -> None:
    """``reference <- alpha * policy + (1 - alpha) * reference``, in place, tensor by tensor
    (parameters and buffers; integer buffers are copied). Both must have the same state keys
    (the reference is a copy of the policy, LoRA adapters included) and, when sharded, the
    same sharding: each rank moves its own shards."""
    ref_state = reference.state_dict()
    pol_state = policy.state_dict()
    if ref_state.keys() != pol_state.keys():
        missing = sorted(set(ref_state) ^ set(pol_state))[:5]
        raise ValueError(f"sync_reference: the models' state keys differ, e.g. {missing}")
    seen: set[int] = set()
    for name, ref in ref_state.items():
        if _storage(ref) in seen:  # tied weights (embeddings and head): one tensor, once
            continue
        seen.add(_storage(ref))
        src = _like(pol_state[name], ref)
        if alpha == 1.0 or not ref.is_floating_point():
            ref.copy_(src)
        else:
            ref.mul_(1.0 - alpha).add_(src, alpha=alpha)


def _like(src: Tensor, ref: Tensor) -> Tensor:
    """``src`` in ``ref``'s device, dtype and layout: as it is where both are sharded alike
    (each rank moves its own shards); else gathered whole and laid out as ``ref`` (a policy
    split by tensor parallelism too, a reference sharded by FSDP2 only)."""
    if isinstance(ref, DTensor):
        same = isinstance(src, DTensor) and (src.device_mesh, src.placements) == (
            ref.device_mesh,
            ref.placements,
        )
        if not same:
            whole = src.full_tensor() if isinstance(src, DTensor) else src
            local = ref.to_local()
            whole = whole.to(device=local.device, dtype=ref.dtype)
            return distribute_tensor(whole, ref.device_mesh, ref.placements)
    return src.to(device=ref.device, dtype=ref.dtype)


def _storage(t: Tensor) -> int:
    return t.to_local().data_ptr() if isinstance(t, DTensor) else t.data_ptr()


def reference_state(reference: nn.Module, synced_step: int) -> dict[str, Any]:
    """What a checkpoint keeps of a moving reference: its whole weights (on the CPU; a
    sharded reference is gathered, a collective every rank runs) and the optimizer step it
    was last synced at."""
    return {"state_dict": full_cpu_state(reference), "synced_step": int(synced_step)}


def load_reference_state(reference: nn.Module, state: dict[str, Any]) -> int:
    """Restore :func:`reference_state` into ``reference`` (sharded or not, at any number of
    ranks); return its ``synced_step``."""
    load_full_state(reference, state["state_dict"])
    return int(state["synced_step"])
