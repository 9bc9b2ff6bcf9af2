"""Many LoRA adapters over one base, as vLLM serves them: which model a request names, the
`/v1/models` cards, and (only with `allow_runtime_lora`) `POST /v1/load_lora_adapter` /
`POST /v1/unload_lora_adapter`.

A request picks an adapter by its `model` field; the base stays reachable by the served
model name (and by a request that names no model, or `"model": null`). Where the engine
serves adapters (`engine.lora_enabled`) a name that is neither gets a 404, as vLLM answers;
an engine without adapters keeps answering any name with the base model, as this server
always did, so clients that send a placeholder name keep working. The engine owns the
adapters (`astrai.inference.adapters`): this module only maps names and errors to HTTP.

Runtime loading is the operator's choice (`RuntimeLoRA`, mounted by `install_runtime_lora`
only when `ServeSettings.allow_runtime_lora` is true, as vLLM mounts its routes only under
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a client's `lora_path` must lie inside
`allowed_lora_roots` (`astrai.serve.lora_paths`; refused without looking outside them), and
the adapters the engine already served when the app was built (the operator's
`lora_modules`) are pinned: a client can neither unload nor replace them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from astrai.inference.adapters import AdapterError, AdapterInfo, AdapterInUse, AdapterNotFound
from astrai.serve.errors import APIError
from astrai.serve.lora_paths import AdapterRoots, LoRAPathNotAllowed, check_lora_name

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine

logger = logging.getLogger("astrai.serve")

NO_LORA = (
    "this server was started without LoRA adapter support; start it with "
    "lora_modules='{name: dir}' or engine.lora='{max_loras: 4, max_lora_rank: 16}' "
    "(python -m astrai.serve), or build its engine with InferenceEngine(..., lora={})"
)
#: the routes `install_runtime_lora` mounts; elsewhere they are a 404 saying how to mount them
RUNTIME_LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
RUNTIME_LORA_OFF = (
    "loading and unloading LoRA adapters at runtime is off on this server; the operator "
    "turns it on with python -m astrai.serve allow_runtime_lora=true "
    "allowed_lora_roots=[<dir>] (docs/serving.md)"
)


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of `POST /v1/load_lora_adapter`."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of `POST /v1/unload_lora_adapter` (`lora_int_id` is accepted, unused)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def model_not_found(name: str) -> APIError:
    """vLLM's 404 for a `model` that is neither the base nor a loaded adapter."""
    return APIError(
        404,
        f"The model `{name}` does not exist.",
        kind="not_found",
        param="model",
        code="model_not_found",
    )


class ServedModels:
    """The names this server answers to: the base model, a reward model, an embedding
    model, the adapters."""

    def __init__(
        self,
        engine: InferenceEngine,
        base: str,
        created: float,
        reward: str | None = None,
        embedding: str | None = None,
    ) -> None:
        self.engine = engine
        self.base = base
        self.reward = reward
        self.embedding = embedding
        self.created = int(created)

    @property
    def serves_adapters(self) -> bool:
        """Whether the engine can serve adapters (and so unknown model names get a 404)."""
        return bool(getattr(self.engine, "lora_enabled", False))

    def adapters(self) -> dict[str, AdapterInfo]:
        """The loaded adapters' `AdapterInfo`, by name. A training run's live adapter (no
        directory: `serve_policy`) is left out: it is what the base name already serves."""
        if not self.serves_adapters:
            return {}
        return {info.name: info for info in self.engine.list_adapters() if info.path}

    def resolve(self, body: BaseModel) -> str | None:
        """The adapter a request body's `model` names; None for the base model. A name the
        server does not serve is a 404 (only where the engine serves adapters)."""
        if not self.serves_adapters or "model" not in body.model_fields_set:
            return None
        name = getattr(body, "model", None)
        if name is None or name == self.base:
            return None
        if name in self.adapters():
            return name
        raise model_not_found(name)

    # ------------------------------------------------------------------ /v1/models
    def _card(self, name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "astrai",
            "root": root,
            "parent": parent,
        }

    def cards(self) -> list[dict[str, Any]]:
        """vLLM's model list: the base (`parent` null), the reward and embedding models,
        then each adapter with `parent` the base. `root` is each one's own name, never a directory: the
        server's file system is not the clients' business."""
        out = [self._card(self.base, self.base, None)]
        for other in (self.reward, self.embedding):
            if other is not None:
                out.append(self._card(other, other, None))
        out += [self._card(name, name, self.base) for name in self.adapters()]
        return out

    def card(self, model_id: str) -> dict[str, Any]:
        for card in self.cards():
            if card["id"] == model_id:
                return card
        raise APIError(
            404,
            f"The model {model_id!r} does not exist",
            kind="not_found",
            param="model",
            code="model_not_found",
        )


class RuntimeLoRA:
    """`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` of one app: loads from
    inside `roots` only, never unloads the adapters served when it was made (`pinned`)."""

    def __init__(self, models: ServedModels, roots: AdapterRoots) -> None:
        self.models = models
        self.engine = models.engine
        self.roots = roots
        self.pinned = frozenset(models.adapters())  # the operator's (lora_modules)

    def _check_enabled(self) -> None:
        if not self.models.serves_adapters:
            raise APIError(400, NO_LORA, code="lora_not_enabled")

    async def load(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Load an adapter while serving (the files are read off the event loop)."""
        self._check_enabled()
        try:
            name = check_lora_name(body.lora_name)
        except ValueError as err:
            raise APIError(400, str(err), param="lora_name") from None
        if name in (self.models.base, self.models.reward, self.models.embedding):
            raise APIError(
                400,
                f"lora_name: {name!r} is the name of a served model; pick another",
                param="lora_name",
            )
        if name in self.models.adapters():
            raise APIError(
                400, f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        try:
            path = self.roots.resolve(body.lora_path)
        except LoRAPathNotAllowed as err:
            raise APIError(400, str(err), param="lora_path", code="lora_path_not_allowed") from None
        try:
            await asyncio.to_thread(self.engine.load_adapter, name, path)
        except AdapterError as err:  # names the file and the limit (rank, shape, registry)
            raise APIError(400, str(err)) from None
        except OSError as err:  # unreadable files: the message names them
            raise APIError(400, f"lora_path: {err}", param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """Unload an adapter a client loaded; refused (400) for a pinned one and while
        queued or running requests use it."""
        self._check_enabled()
        name = body.lora_name
        if name in self.pinned:
            raise APIError(
                400,
                f"The lora adapter '{name}' was loaded at start-up (lora_modules) and cannot "
                "be unloaded; only adapters loaded at runtime can",
                param="lora_name",
                code="adapter_pinned",
            )
        try:
            await asyncio.to_thread(self.engine.unload_adapter, name)
        except AdapterNotFound:
            raise APIError(
                404,
                f"The lora adapter '{name}' cannot be found.",
                kind="not_found",
                param="lora_name",
                code="adapter_not_found",
            ) from None
        except AdapterInUse as err:
            raise APIError(400, str(err), param="lora_name", code="adapter_in_use") from None
        except AdapterError as err:
            raise APIError(400, str(err), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def install_runtime_lora(
    app: FastAPI, models: ServedModels, roots: Sequence[str], dependencies: list[Any]
) -> RuntimeLoRA:
    """Mount vLLM's load / unload routes on `app` (behind `dependencies`: the API key)."""
    runtime = RuntimeLoRA(models, AdapterRoots.of(roots))
    auth = [Depends(d) for d in dependencies]

    @app.post(RUNTIME_LORA_PATHS[0], dependencies=auth, response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return await runtime.load(body)

    @app.post(RUNTIME_LORA_PATHS[1], dependencies=auth, response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return await runtime.unload(body)

    return runtime
