"""The opt-in RL routes (`allow_weight_updates`): pause and continue generation, and the
weight updates, from a safetensors directory or over a `torch.distributed` group with the
trainer (SGLang's names and bodies).

Off, each answers 403 before its body is read; on, it needs the server's `api_key` when
one is set. Bodies are read here, after those checks (never by FastAPI before them).
One update runs at a time. An update closes the generation gate (requests in flight
finish, new ones wait; `rl_gate.py`), copies the tensors in with the engine's loop paused
(`InferenceEngine.update_weights`, which also sets the new policy version and drops the
prefix cache), then opens the gate again unless `/pause_generation` closed it.

Over the group, every member takes part in one handshake before any tensor moves: a
replica that refuses (a name, shape or dtype the model has not, a version not newer)
makes every replica refuse, and none changes. A transfer that fails halfway (the trainer
died, or gave the group up) leaves a mix of versions: generation answers 503 until the
next complete update (`GenerationGate.spoil`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request

from astrai.remote.weight_group import WeightGroup, check_backend
from astrai.serve.errors import APIError
from astrai.serve.weight_updates import (
    DiskWeights,
    Entry,
    Targets,
    WeightProblem,
    check_entries,
    check_version,
    entries_of,
    receive,
    targets_for,
)

if TYPE_CHECKING:
    from astrai.serve.rl_gate import GenerationGate
    from astrai.serve.state import ServerState

logger = logging.getLogger("astrai.serve")

WEIGHT_UPDATES_OFF = (
    "weight updates are off on this server: start it with allow_weight_updates=true "
    "(conf/serve.yaml) to mount the RL routes"
)
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
PEER_REFUSED = (
    "another member of weight group {group!r} refused the update; nothing was changed "
    "(its replica's answer says why)"
)


def problem(err: WeightProblem | ValueError) -> APIError:
    """A 400 whose `param` is the field the message starts with (`names: ...`)."""
    message = str(err)
    return APIError(400, message, param=message.split(":")[0].split("[")[0] or None)


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise APIError(400, f"invalid JSON body: {err}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"body: expected a JSON object, got {type(body).__name__}")
    return body


def field(body: dict[str, Any], name: str, kind: type, default: Any = ...) -> Any:
    """`body[name]`, of type `kind` (bools are not ints here); a 400 naming it otherwise."""
    value = body.get(name, default)
    if value is ...:
        raise APIError(400, f"{name}: required", param=name)
    if value is not default and (not isinstance(value, kind) or isinstance(value, bool)):
        raise APIError(400, f"{name}: expected {kind.__name__}, got {value!r}", param=name)
    return value


class WeightRoutes:
    """The opt-in routes' state: the groups this replica joined, the one-at-a-time lock."""

    def __init__(self, state: ServerState, gate: GenerationGate) -> None:
        self.state = state
        self.engine = state.engine
        self.gate = gate
        self.enabled = state.settings.allow_weight_updates
        self.groups: dict[str, WeightGroup] = {}
        self.lock = asyncio.Lock()

    async def require_enabled(self) -> None:
        if not self.enabled:
            raise APIError(
                403, WEIGHT_UPDATES_OFF, kind="authentication", code="weight_updates_off"
            )

    def install(self, app: FastAPI, check_key: Callable[..., Any]) -> None:
        deps = [Depends(self.require_enabled), Depends(check_key)]  # in this order: 403 first
        for path, handler in (
            ("/pause_generation", self.pause),
            ("/continue_generation", self.resume),
            ("/init_weights_update_group", self.init_group),
            ("/destroy_weights_update_group", self.destroy_group),
            ("/update_weights_from_disk", self.from_disk),
            ("/update_weights_from_distributed", self.from_distributed),
        ):
            app.add_api_route(path, handler, methods=["POST"], dependencies=deps)

    # ------------------------------------------------------------------ pause
    async def pause(self) -> dict[str, Any]:
        """Returns when the requests in flight have finished; new ones wait for continue."""
        self.gate.paused = True
        await self.gate.close()
        return {"success": True, "policy_version": self.engine.policy_version}

    async def resume(self) -> dict[str, Any]:
        self.gate.paused = False
        if not self.lock.locked():  # an update in progress opens the gate when it ends
            self.gate.open()
        return {"success": True, "policy_version": self.engine.policy_version}

    @contextlib.asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        """One update at a time; at its end (done, refused or failed) the gate opens again
        unless generation is paused (a continue during the update left that to here)."""
        async with self.lock:
            try:
                yield
            finally:
                if not self.gate.paused:
                    self.gate.open()

    # ------------------------------------------------------------------ groups
    async def init_group(self, request: Request) -> dict[str, Any]:
        body = await json_body(request)
        address = field(body, "master_address", str)
        port = field(body, "master_port", int)
        rank = field(body, "rank_offset", int)
        world = field(body, "world_size", int)
        name = field(body, "group_name", str, DEFAULT_GROUP)
        backend = field(body, "backend", str, "gloo")
        try:
            check_backend(backend)
        except ValueError as err:
            raise APIError(400, str(err), param="backend") from None
        if not 0 < rank < world:
            raise APIError(
                400,
                f"rank_offset: {rank} is not a replica's rank in a group of {world} (the "
                "trainer is rank 0)",
                param="rank_offset",
            )
        try:
            group = await asyncio.to_thread(
                WeightGroup.join,
                address,
                port,
                name=name,
                rank=rank,
                world_size=world,
                backend=backend,
                device=self.engine.device,
            )
        except (RuntimeError, ValueError, TimeoutError) as err:  # torch.distributed's
            raise APIError(
                500, f"could not join weight group {name!r}: {err}", kind="server"
            ) from err
        old = self.groups.get(name)
        if old is not None:
            self.forget(name, old)
        self.groups[name] = group
        logger.info("joined weight group %r as rank %d of %d (%s)", name, rank, world, backend)
        return {"success": True, "group_name": name, "rank": rank}

    async def destroy_group(self, request: Request) -> dict[str, Any]:
        body = await json_body(request)
        name = field(body, "group_name", str, DEFAULT_GROUP)
        group = self.groups.get(name)
        if group is None:
            raise APIError(400, f"group_name: no weight group {name!r}", param="group_name")
        self.forget(name, group)
        return {"success": True}

    # ------------------------------------------------------------------ updates
    async def apply(self, targets: Targets, version: int, write: Callable[[], None]) -> dict:
        """`write()` (which copies into `targets`) with the gate closed and the engine's
        loop paused; the engine's version becomes `version`. The caller is `updating`."""
        await self.gate.close()  # opened again by `updating`
        try:
            await asyncio.to_thread(self.engine.update_weights, write, version)
        except Exception:
            if targets.written:
                self.gate.spoil()
            raise
        self.gate.restore()
        logger.info("weights updated to policy version %d (%s)", version, targets.what)
        return {"success": True, "policy_version": self.engine.policy_version}

    async def from_disk(self, request: Request) -> dict[str, Any]:
        body = await json_body(request)
        async with self.updating():
            try:
                version = check_version(body.get("policy_version"), self.engine.policy_version)
                lora = body.get("lora_name")
                targets = targets_for(self.engine, lora)
                source = DiskWeights(body.get("model_path"), adapter=lora is not None)
                if lora is not None:
                    targets.check_config(source.path)  # type: ignore[union-attr]
                entries = await asyncio.to_thread(source.entries)  # the headers only
                check_entries(targets, entries)
            except WeightProblem as err:
                raise problem(err) from None
            return await self.apply(targets, version, lambda: source.load(targets, entries))

    async def from_distributed(self, request: Request) -> dict[str, Any]:
        body = await json_body(request)
        name = body.get("group_name", DEFAULT_GROUP)
        group = self.groups.get(name) if isinstance(name, str) else None
        if group is None:  # no group: the trainer sees this answer before any collective
            raise APIError(400, f"group_name: no weight group {name!r}", param="group_name")
        async with self.updating():
            refusal: WeightProblem | None = None
            entries: list[Entry] = []
            try:
                version = check_version(body.get("policy_version"), self.engine.policy_version)
                targets = targets_for(self.engine, body.get("lora_name"))
                entries = entries_of(body.get("names"), body.get("shapes"), body.get("dtypes"))
                check_entries(targets, entries)
            except WeightProblem as err:
                refusal = err
            try:
                agreed = await asyncio.to_thread(group.handshake, refusal is None)
                if refusal is not None:
                    raise problem(refusal)
                if not agreed:
                    raise APIError(400, PEER_REFUSED.format(group=name), code="refused_by_peer")
                return await self.apply(targets, version, lambda: receive(group, targets, entries))
            except APIError:
                raise
            except Exception as err:  # the group failed: a member died, rank 0 gave it up
                self.forget(name, group)
                raise APIError(
                    500, f"weight group {name!r} failed: {type(err).__name__}: {err}", kind="server"
                ) from err

    def forget(self, name: str, group: WeightGroup) -> None:
        """Leave a group that failed (the trainer forms a new one)."""
        if self.groups.get(name) is group:
            del self.groups[name]
        group.close()
