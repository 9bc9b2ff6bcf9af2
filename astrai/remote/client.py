"""`ReplicaClient`: a trainer's handle on one `python -m astrai.serve` replica.

The replica's RL routes (`astrai.serve.rl_routes`, SGLang's names) over HTTP, with the
failures split the way a caller acts on them: `ReplicaUnavailable` (no connection, the
connection dropped, a 5xx: try another replica) and `ReplicaError` (the replica answered
4xx: the request itself is wrong, retrying elsewhere would fail the same way), with
`StalePolicyVersion` for a 409 on a generation that asked for another policy version.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from astrai.inference.params import SamplingParams
from astrai.remote.wire import params_to_json

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT = 5.0  # seconds: a health probe is a question, not a wait
POLICY_VERSION_HEADER = "x-policy-version"


class ReplicaUnavailable(Exception):
    """The replica could not be reached, dropped the connection or failed (5xx)."""


class ReplicaError(Exception):
    """The replica refused the request (4xx); the message is the replica's."""

    def __init__(self, message: str, *, status: int, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class StalePolicyVersion(ReplicaError):
    """`generate(policy_version=v)` on a replica whose weights are another version (409)."""


@dataclass
class RemoteResult:
    """One sample of `ReplicaClient.generate`, with the engine's `BatchResult` attributes."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    error: str | None = None
    cached_prompt_tokens: int = 0


class ReplicaClient:
    """Calls to one replica at `url` (``http://host:port``), with `api_key` when it has one.

    `timeout` bounds each call (seconds; a generation or a weight update can take long).
    One client may be used from several threads at once (httpx's client can be shared).
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __repr__(self) -> str:
        return f"ReplicaClient({self.url!r})"

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ calls
    def _call(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """The JSON answer of `method path`; `ReplicaUnavailable` / `ReplicaError` otherwise."""
        try:
            response = self._http.request(
                method, path, json=body, timeout=self.timeout if timeout is None else timeout
            )
        except httpx.HTTPError as err:  # refused, reset, timed out, closed mid-answer
            raise ReplicaUnavailable(f"{self.url}{path}: {type(err).__name__}: {err}") from err
        if response.status_code < 400:
            return response.json()
        message, code = _error_of(response)
        text = f"{self.url}{path}: {response.status_code}: {message}"
        if response.status_code >= 500:
            raise ReplicaUnavailable(text)
        kind = StalePolicyVersion if response.status_code == 409 else ReplicaError
        raise kind(text, status=response.status_code, code=code)

    def health(self) -> bool:
        """Whether the replica answers `/health` with 200 (any failure: False)."""
        try:
            return self._http.get("/health", timeout=HEALTH_TIMEOUT).status_code == 200
        except httpx.HTTPError:
            return False

    def policy_version(self) -> int:
        return int(self._call("GET", "/get_weight_version")["policy_version"])

    def generate(
        self,
        input_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None,
        policy_version: int | None = None,
    ) -> list[RemoteResult]:
        """`len(input_ids) * params.n` results, prompt-major: result `i * n + j` drawn with
        seed `seed + i * n + j`, as `InferenceEngine.run_batch(input_ids, params,
        seed=seed, return_details=True)` gives them. With `policy_version`, a replica
        holding other weights answers 409 (`StalePolicyVersion`) and generates nothing."""
        body = {
            "input_ids": [list(map(int, ids)) for ids in input_ids],
            "sampling_params": params_to_json(params),
            "seed": seed,
            "policy_version": policy_version,
        }
        answer = self._call("POST", "/generate", body)
        return [
            RemoteResult(
                token_ids=out["output_ids"],
                logprobs=out["logprobs"],
                finish_reason=out["finish_reason"],
                error=out.get("error"),
                cached_prompt_tokens=out.get("cached_prompt_tokens", 0),
            )
            for out in answer["outputs"]
        ]

    def pause(self) -> None:
        """`/pause_generation`: returns once the requests in flight have finished; new ones
        wait until `resume`."""
        self._call("POST", "/pause_generation")

    def resume(self) -> None:
        self._call("POST", "/continue_generation")

    def update_weights_from_disk(
        self, path: str, version: int, lora_name: str | None = None
    ) -> int:
        """Load the safetensors directory `path` (a PEFT adapter directory with
        `lora_name`) as policy `version`; the replica's version after it."""
        body = {"model_path": str(path), "policy_version": version, "lora_name": lora_name}
        return int(self._call("POST", "/update_weights_from_disk", body)["policy_version"])

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> None:
        """Join the weight-update group (blocks until every member joined)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._call("POST", "/init_weights_update_group", body)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        version: int,
        group_name: str,
        lora_name: str | None = None,
    ) -> int:
        """Receive the named tensors by broadcast from rank 0 of `group_name` (the sender
        broadcasts them meanwhile); the replica's version after it."""
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "policy_version": version,
            "lora_name": lora_name,
        }
        return int(self._call("POST", "/update_weights_from_distributed", body)["policy_version"])

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})


def _error_of(response: httpx.Response) -> tuple[str, str | None]:
    """The message and code of an error answer (OpenAI's shape), or its text."""
    try:
        error = response.json()["error"]
        return str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError):
        return response.text[:500] or response.reason_phrase, None


__all__ = [
    "POLICY_VERSION_HEADER",
    "RemoteResult",
    "ReplicaClient",
    "ReplicaError",
    "ReplicaUnavailable",
    "StalePolicyVersion",
]
