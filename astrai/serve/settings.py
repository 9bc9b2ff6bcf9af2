"""Server settings that are not the engine's (the engine is built by the caller)."""

from __future__ import annotations

from dataclasses import dataclass

from astrai.inference.params import MAX_TOKENS_POLICIES, check_choice


@dataclass
class ServeSettings:
    """What `create_app` needs besides the engine.

    `tool_call_format`: ``"hermes"`` (``<tool_call>{json}</tool_call>``, our chat
    template's format), ``"START|END"`` for other tags, or ``"none"`` to never parse tool
    calls. `tool_parser` (vLLM's names; wins over `tool_call_format` when set):
    ``hermes``, ``llama3_json``, ``mistral``, ``pythonic``, ``qwen3_coder``, ``auto``
    (chosen from the model's chat template) or ``none`` (`astrai.serve.tool_parsers`).
    `disconnect_poll_s`: how often a non-streaming request checks that its client
    is still there. A cap on prompt tokens is the engine's (`InferenceEngine(...,
    max_prompt_tokens=)`, the one prompt check): `python -m astrai.serve` passes its
    `max_prompt_tokens` there.

    Limits (checked before a request costs anything): `max_body_bytes` (413 beyond it,
    refused while the body streams in), `max_prompt_chars` (400 naming the field, checked
    before tokenizing; None: no limit). Prompts are rendered and tokenized on a pool of
    `tokenizer_threads` threads, off the event loop. `request_timeout_s` bounds a
    non-streamed request (504 in the protocol's shape; its engine tasks are cancelled).

    `max_tokens_policy`: what an explicit `max_tokens` (`max_completion_tokens`) that does
    not fit in the context after the prompt gets. ``"error"`` (default): a 400 naming the
    field, the context length and the request's total, as OpenAI and vLLM answer;
    ``"clamp"`` (astrai's own): generate until the context is full, finish reason
    `length` / `max_tokens`. An omitted `max_tokens` is always capped to what fits.
    """

    model_name: str = "astrai"
    api_key: str | None = None
    tool_call_format: str = "hermes"
    tool_parser: str | None = None
    retry_after_s: int = 1
    disconnect_poll_s: float = 0.5
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int | None = 1_000_000
    tokenizer_threads: int = 2
    request_timeout_s: float | None = 300.0
    max_tokens_policy: str = "error"
    # qwen3 | deepseek_r1 | auto (from the chat template) | none: astrai.serve.reasoning
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        check_choice("max_tokens_policy", self.max_tokens_policy, MAX_TOKENS_POLICIES)
        from astrai.serve.reasoning import check_reasoning_parser

        check_reasoning_parser(self.reasoning_parser)  # a ValueError naming its choices
        if self.tool_parser is not None:
            from astrai.serve.tool_parsers import resolve

            resolve(self.tool_parser)  # a ValueError naming tool_parser and its choices

    @property
    def tool_parser_spec(self) -> str:
        """The effective tool-call format: `tool_parser`, else `tool_call_format`."""
        return self.tool_call_format if self.tool_parser is None else self.tool_parser
