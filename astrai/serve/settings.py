"""Server settings that are not the engine's (the engine is built by the caller), and the
check of the address a server listens on. Torch-free: commands check these first."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from astrai.inference.embedding import POOLING_TYPES
from astrai.inference.params import MAX_TOKENS_POLICIES, check_choice, is_int
from astrai.serve.lora_paths import AdapterRoots


@dataclass
class ServeSettings:
    """What `create_app` needs besides the engine.

    `tool_parser` (vLLM's `--tool-call-parser` names): ``hermes`` (the default,
    ``<tool_call>{json}</tool_call>``, our chat template's format), ``llama3_json``,
    ``mistral``, ``pythonic``, ``qwen3_coder``, ``openai`` (GPT-OSS's harmony calls, with
    `reasoning_parser=openai_gptoss`), ``auto`` (chosen from the model's chat
    template), ``none`` (never parse tool calls), or ``"START|END"`` tags of a hermes-style
    format (`astrai.serve.tool_parsers`; GRPO's environments read the same setting).
    `disconnect_poll_s`: how often a non-streaming request checks that its client
    is still there. A cap on prompt tokens is the engine's (`InferenceEngine(...,
    max_prompt_tokens=)`, the one prompt check): `python -m astrai.serve` passes its
    `max_prompt_tokens` there.

    Limits (checked before a request costs anything): `max_body_bytes` (413 beyond it,
    refused while the body streams in), `max_prompt_chars` (400 naming the field, checked
    before tokenizing; None: no limit). Prompts are rendered and tokenized on a pool of
    `tokenizer_threads` threads, off the event loop. `request_timeout_s` bounds a
    non-streamed request (504 in the protocol's shape; its engine tasks are cancelled).
    `max_client_batch_size` (TEI's name): the most pairs one `/v1/score` request may hold.

    `max_tokens_policy`: what an explicit `max_tokens` (`max_completion_tokens`) that does
    not fit in the context after the prompt gets. ``"error"`` (default): a 400 naming the
    field, the context length and the request's total, as OpenAI and vLLM answer;
    ``"clamp"`` (astrai's own): generate until the context is full, finish reason
    `length` / `max_tokens`. An omitted `max_tokens` is always capped to what fits.
    """

    model_name: str = "astrai"
    api_key: str | None = None
    tool_parser: str = "hermes"
    retry_after_s: int = 1
    disconnect_poll_s: float = 0.5
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int | None = 1_000_000
    tokenizer_threads: int = 2
    request_timeout_s: float | None = 300.0
    max_client_batch_size: int = 1024  # pairs per /v1/score request (TEI's name)
    max_tokens_policy: str = "error"
    # qwen3 | deepseek_r1 | openai_gptoss | auto (from the chat template) | none:
    # astrai.serve.reasoning
    reasoning_parser: str | None = None
    allow_runtime_lora: bool = False
    allowed_lora_roots: tuple[str, ...] = ()
    # The RL routes that change the server's weights or pause it (astrai.serve.weight_routes)
    allow_weight_updates: bool = False
    # /v1/responses kept for `previous_response_id` (an LRU; astrai.serve.responses_store)
    max_stored_responses: int = 1000
    # /v1/embeddings' pooling of the final hidden states (vLLM's name; astrai.inference.embedding)
    pooling_type: str = "last"

    def __post_init__(self) -> None:
        check_choice("max_tokens_policy", self.max_tokens_policy, MAX_TOKENS_POLICIES)
        check_choice("pooling_type", self.pooling_type, POOLING_TYPES)
        # Values that would make every request fail are refused here, at start-up.
        if not is_int(self.max_body_bytes) or self.max_body_bytes <= 0:
            raise ValueError(
                f"max_body_bytes: must be a positive int (bytes), got {self.max_body_bytes!r}"
            )
        chars = self.max_prompt_chars
        if chars is not None and (not is_int(chars) or chars < 0):
            raise ValueError(f"max_prompt_chars: must be an int >= 0 or null, got {chars!r}")
        timeout = self.request_timeout_s
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(
                f"request_timeout_s: must be a positive number of seconds or null, got {timeout!r}"
            )
        if not is_int(self.max_client_batch_size) or self.max_client_batch_size < 1:
            raise ValueError(
                "max_client_batch_size: must be a positive int (pairs per /v1/score request), "
                f"got {self.max_client_batch_size!r}"
            )
        if not is_int(self.max_stored_responses) or self.max_stored_responses < 0:
            raise ValueError(
                "max_stored_responses: must be an int >= 0 (responses kept for "
                f"previous_response_id), got {self.max_stored_responses!r}"
            )
        if not isinstance(self.allow_runtime_lora, bool):
            raise ValueError(
                f"allow_runtime_lora: must be true or false, got {self.allow_runtime_lora!r}"
            )
        if not isinstance(self.allow_weight_updates, bool):
            raise ValueError(
                f"allow_weight_updates: must be true or false, got {self.allow_weight_updates!r}"
            )
        if isinstance(self.allowed_lora_roots, str):
            self.allowed_lora_roots = (self.allowed_lora_roots,)
        self.allowed_lora_roots = tuple(self.allowed_lora_roots or ())
        if self.allow_runtime_lora:
            AdapterRoots.of(self.allowed_lora_roots)  # a ValueError naming allowed_lora_roots
        from astrai.serve.reasoning import check_harmony_parsers, check_reasoning_parser

        check_reasoning_parser(self.reasoning_parser)  # a ValueError naming its choices
        check_harmony_parsers(self.tool_parser, self.reasoning_parser)
        from astrai.serve.tool_parsers import resolve

        resolve(self.tool_parser)  # a ValueError naming tool_parser and its choices


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine (`localhost`, 127.0.0.0/8,
    ::1). Any other name or address (0.0.0.0, ::, a hostname) may be reached from outside."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen(
    host: object,
    port: object,
    api_key: str | None,
    allow_unauthenticated: object = False,
    prefix: str = "",
) -> None:
    """A ValueError naming `<prefix>host` / `<prefix>port` / `<prefix>api_key` when a server
    cannot or should not listen there: `port` not an int in [0, 65535], or a `host` other
    than loopback without an `api_key`, unless `allow_unauthenticated` is true (anyone who
    reaches the port could then generate, and read the model's names and stats)."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"{prefix}host: must be an address or host name, got {host!r}")
    if not is_int(port) or not 0 <= port <= 65535:  # type: ignore[operator]
        raise ValueError(f"{prefix}port: must be an int in [0, 65535], got {port!r}")
    if not isinstance(allow_unauthenticated, bool):
        raise ValueError(
            f"{prefix}allow_unauthenticated: must be true or false, got {allow_unauthenticated!r}"
        )
    if not api_key and not is_loopback(host) and not allow_unauthenticated:
        raise ValueError(
            f"{prefix}host={host}: reachable from other machines, and no {prefix}api_key is "
            f"set: set {prefix}api_key=<key>, listen on {prefix}host=127.0.0.1, or say "
            f"{prefix}allow_unauthenticated=true to serve without a key"
        )
