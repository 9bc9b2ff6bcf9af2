"""The replica routes a reinforcement-learning trainer drives (SGLang's names).

Always mounted (with the server's `api_key` when it has one): `POST /generate` (token ids
in, token ids and log-probs out, exactly `InferenceEngine.run_batch`'s results, run on the
engine's background loop with every other request) and `GET /get_weight_version`. Opt-in
(`allow_weight_updates`): pause / continue and the weight updates (`weight_routes.py`).
Every response carries `X-Policy-Version` (`rl_gate.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from astrai.inference import EngineNotReady
from astrai.inference.batch import BatchResult, batch_output
from astrai.inference.params import SamplingParams
from astrai.remote.wire import params_from_json
from astrai.serve.errors import APIError
from astrai.serve.refusals import bad_settings
from astrai.serve.rl_gate import GenerationGate, RLMiddleware
from astrai.serve.weight_routes import WeightRoutes

if TYPE_CHECKING:
    from astrai.inference import GenerateResult, InferenceEngine
    from astrai.serve.state import ServerState


class GenerateRequest(BaseModel):
    """`POST /generate`'s body: prompts as token ids, `SamplingParams` fields by name."""

    model_config = ConfigDict(extra="forbid")

    input_ids: list[list[StrictInt]] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    seed: StrictInt | None = None
    policy_version: StrictInt | None = None


def stale_version(asked: int, current: int) -> APIError:
    return APIError(
        409,
        f"stale_policy_version: the request asks for policy version {asked}, this replica "
        f"holds version {current}",
        code="stale_policy_version",
    )


def output_json(result: BatchResult) -> dict[str, Any]:
    return {
        "output_ids": result.token_ids,
        "logprobs": result.logprobs,
        "finish_reason": result.finish_reason,
        "cached_prompt_tokens": result.cached_prompt_tokens,
        "error": result.error,
    }


class Generation:
    """`/generate`: the prompt groups of one request on the engine's loop, awaited here."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine: InferenceEngine = state.engine

    def params(self, body: GenerateRequest) -> SamplingParams:
        try:
            params = params_from_json(body.sampling_params, seed=body.seed)
            return params.validate(vocab_size=self.engine.vocab_size)
        except (TypeError, ValueError) as err:
            raise bad_settings(err) from None

    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list:
        """Prompt `i` as one group seeded `seed + i * n` (`run_batch`'s seeds); a refused
        setting cancels what was queued and is a 400."""
        results: list[GenerateResult] = []
        n, seed = params.n, params.seed
        try:
            for i, ids in enumerate(prompts):
                p = params if seed is None else dataclasses.replace(params, seed=seed + i * n)
                results += self.engine.submit_group(ids, p)
        except EngineNotReady as err:
            self.cancel(results)
            raise APIError(503, str(err), kind="overloaded") from err
        except (TypeError, ValueError) as err:  # an adapter not loaded, a bad stop id
            self.cancel(results)
            raise bad_settings(err) from None
        return results

    def cancel(self, results: list[GenerateResult]) -> None:
        for r in results:
            if not r.done:
                self.engine.cancel(r)

    async def wait(self, results: list[GenerateResult], request: Request) -> None:
        """Until every result is done; the client gone or the request's timeout: cancelled."""
        loop = asyncio.get_running_loop()
        progress = asyncio.Event()
        for r in results:
            r.listen(lambda: loop.call_soon_threadsafe(progress.set))
        settings = self.state.settings
        timeout = settings.request_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not all(r.done for r in results):
                try:
                    await asyncio.wait_for(progress.wait(), settings.disconnect_poll_s)
                except TimeoutError:
                    if await request.is_disconnected():  # nobody reads the answer
                        raise APIError(400, "client disconnected") from None
                progress.clear()
                if deadline is not None and time.monotonic() > deadline:
                    raise APIError(
                        504, f"request timed out after {timeout} s", kind="timeout", code="timeout"
                    )
        finally:
            self.cancel(results)

    async def __call__(self, body: GenerateRequest, request: Request) -> dict[str, Any]:
        self.state.check_ready()
        version = self.engine.policy_version  # the gate keeps it for this request's life
        if body.policy_version is not None and body.policy_version != version:
            raise stale_version(body.policy_version, version)
        params = self.params(body)
        results = self.submit(body.input_ids, params)
        await self.wait(results, request)
        outputs = [
            output_json(batch_output(r.task, return_logprobs=False, return_details=True))
            for r in results
        ]
        return {"policy_version": version, "outputs": outputs}


def install_rl_routes(
    app: FastAPI, state: ServerState, check_key: Callable[..., Any]
) -> GenerationGate:
    """Mount the RL routes on `app` (the opt-in ones answer 403 unless
    `state.settings.allow_weight_updates`) and the middleware that gates generation and
    adds `X-Policy-Version`; the gate."""
    engine = state.engine
    gate = GenerationGate()
    app.state.rl_gate = gate
    app.add_middleware(RLMiddleware, gate=gate, version=lambda: engine.policy_version)
    auth = [Depends(check_key)]
    generation = Generation(state)

    @app.post("/generate", dependencies=auth)
    async def generate(body: GenerateRequest, request: Request) -> dict[str, Any]:
        return await generation(body, request)

    @app.get("/get_weight_version", dependencies=auth)
    async def get_weight_version() -> dict[str, int]:
        return {"policy_version": engine.policy_version}

    WeightRoutes(state, gate).install(app, check_key)
    return gate
