"""What the existing routers ask a worker for, beyond the OpenAI routes (docs/serving.md,
"Data-parallel serving"), under the names of the servers they were written for:

- vLLM's ``POST /tokenize``: `vllm-router`'s cache-aware policy asks every worker for a
  request's prompt tokens and matches prefixes on tokens; without it the router falls
  back to its text tree. It is `astrai.serve.tokenize_routes`, mounted by the app.
- SGLang's ``GET /get_server_info`` (and ``/server_info``): `sglang-router` registers a
  worker under the model it reports there (``served_model_name`` / ``model_path``); without
  it every worker is "unknown" and the router's ``/v1/models`` says so. It reads SGLang's
  ``/get_model_info`` (``/model_info``) next, answered here too. Both name the served model
  (never a directory: the server's file system is not the clients' business).

Each answers as its reference does; a bad body is the usual 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from astrai.serve.state import ServerState


def install_router_compat(app: FastAPI, state: ServerState) -> None:
    """Mount the open ``GET /get_server_info``, ``/get_model_info`` (and their short
    names) on `app`."""

    def model_info() -> dict[str, Any]:
        name = state.settings.model_name
        return {"model_path": name, "tokenizer_path": name, "is_generation": True}

    def server_info() -> dict[str, Any]:
        name = state.settings.model_name
        return {
            "model_path": name,
            "served_model_name": name,
            "tokenizer_path": name,
            "context_length": state.engine.max_seq_len,
        }

    for path, route in (("model_info", model_info), ("server_info", server_info)):
        app.get(f"/get_{path}")(route)
        app.get(f"/{path}")(route)
