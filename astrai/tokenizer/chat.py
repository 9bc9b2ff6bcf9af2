"""Chat formatting: validating conversations, picking and rendering a named template, and
finding the assistant turns for an SFT loss mask without knowing the template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from astrai.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, TemplateError

__all__ = ["CHAT_ROLES", "TURNS_FORMS", "ChatFormatter", "as_turns", "span_mask"]

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
#: what a prompt / completion / chosen / rejected field may hold (the error's wording)
TURNS_FORMS = "must be a string, a message or a list of messages"


def as_turns(value: Any, role: str) -> list[dict[str, Any]] | None:
    """The turns of a record field: a string as one turn of ``role``, a message or a list of
    messages as they are (TRL's standard and conversational forms); ``None`` for anything
    else, so that each caller names the field in its own error."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, Mapping):
        return [dict(value)]
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        return [dict(m) for m in value]
    return None


class ChatFormatter:
    """A tokenizer's named chat templates plus the special-token variables they see.

    Templates compile eagerly: a broken template should fail when the tokenizer loads,
    not mid-request.
    """

    def __init__(
        self,
        chat_template: str | Mapping[str, str] | None,
        variables: Mapping[str, str | None],
    ) -> None:
        if chat_template is None:
            templates: dict[str, str] = {"default": DEFAULT_CHAT_TEMPLATE}
        elif isinstance(chat_template, str):
            templates = {"default": chat_template}
        else:
            templates = dict(chat_template)
            if not templates:
                raise ValueError("chat_template: empty mapping of named templates")
        self._templates = templates
        self._compiled = {name: ChatTemplate(src) for name, src in templates.items()}
        self._variables = {k: v for k, v in variables.items() if v is not None}

    @property
    def templates(self) -> dict[str, str]:
        """Sources of all named templates (a copy)."""
        return dict(self._templates)

    @property
    def default_template(self) -> str:
        """Source of the ``default`` template, or of the first one when none is so named."""
        return self._templates.get("default") or next(iter(self._templates.values()))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        extra: Mapping[str, Any],
    ) -> str:
        """Validate and render a conversation as transformers' ``apply_chat_template`` does."""
        normalized = _normalize_messages(messages)
        return self._render(normalized, _check_tools(tools), add_generation_prompt, extra)

    def render_with_assistant_spans(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        extra: Mapping[str, Any],
        stop_strings: Sequence[str],
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns.

        The span of assistant turn ``i`` runs from the end of
        ``render(messages[:i], add_generation_prompt=True)`` to the end of
        ``render(messages[:i+1])``, cut after the last of ``stop_strings`` in it (so the
        turn's closing ``<|im_end|>`` is in, a trailing newline is not). This needs a
        prefix-stable template (true for ChatML-like ones); otherwise TemplateError.
        """
        normalized = _normalize_messages(messages)
        tool_list = _check_tools(tools)
        full = self._render(normalized, tool_list, add_generation_prompt, extra)

        spans: list[tuple[int, int]] = []
        for i, message in enumerate(normalized):
            if message["role"] != "assistant":
                continue
            before = self._render(normalized[:i], tool_list, True, extra)
            through = self._render(normalized[: i + 1], tool_list, False, extra)
            if not through.startswith(before):
                raise TemplateError(
                    f"chat template is not prefix-stable: rendering messages[:{i}] with the "
                    f"generation prompt is not a prefix of rendering messages[:{i + 1}], so the "
                    "assistant loss mask cannot be computed"
                )
            if not full.startswith(through):
                raise TemplateError(
                    f"chat template is not prefix-stable: rendering messages[:{i + 1}] is not a "
                    "prefix of rendering the whole conversation (the template changes earlier "
                    "turns depending on later ones), so the assistant loss mask cannot be computed"
                )
            start, end = len(before), len(through)
            turn = through[start:end]
            cut = max((turn.rfind(s) + len(s) for s in stop_strings if s in turn), default=-1)
            if cut >= 0:
                end = start + cut
            if end > start:
                spans.append((start, end))
        return full, spans

    def _template_for(self, tools: Sequence[Mapping[str, Any]] | None) -> ChatTemplate:
        """Pick a template the way transformers does: ``tool_use`` when tools are given and
        such a template exists, else ``default``."""
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        if len(self._compiled) == 1:
            return next(iter(self._compiled.values()))
        raise TemplateError(
            f"no 'default' chat template among the named templates {sorted(self._compiled)}"
        )

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        extra: Mapping[str, Any],
    ) -> str:
        variables: dict[str, Any] = {**self._variables, **extra}
        return self._template_for(tools).render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )


def span_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose (start, end) offsets overlap one of ``spans``, else 0.

    Both sequences must be in order, as tokenizer offsets and rendered turns are.
    """
    mask = [0] * len(offsets)
    k = 0
    for t, (s, e) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= s:
            k += 1
        if k == len(spans):
            break
        if _overlaps(s, e, *spans[k]):
            mask[t] = 1
    return mask


def _overlaps(tok_start: int, tok_end: int, span_start: int, span_end: int) -> bool:
    if tok_start == tok_end:  # zero-width offsets (trimmed whitespace): treat as a point
        return span_start <= tok_start < span_end
    return tok_start < span_end and tok_end > span_start


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate chat messages and drop None-valued keys, exactly as transformers does
    before rendering (so ``content=None`` and a missing ``content`` render the same)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}] has unknown role {role!r}; expected one of {sorted(CHAT_ROLES)}"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{i}] ({role}): content must be a string or None, "
                f"got {type(content).__name__}"
            )
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise ValueError(f"messages[{i}] ({role}): only assistant messages have tool_calls")
            _check_tool_calls(tool_calls, i)
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _check_tool_calls(tool_calls: Any, index: int) -> None:
    if isinstance(tool_calls, (str, bytes)) or not isinstance(tool_calls, Sequence):
        raise ValueError(f"messages[{index}].tool_calls must be a list")
    for j, call in enumerate(tool_calls):
        where = f"messages[{index}].tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ValueError(f"{where} must be a dict")
        function = call.get("function", call)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(
                f"{where}: missing function name (expected {{'function': {{'name'}}}})"
            )
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, (str, Mapping)):
            raise ValueError(f"{where}: arguments must be a dict or a JSON string")


def _check_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]] | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError("tools must be a list of JSON-schema dicts")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TypeError(f"tools[{i}] must be a dict (JSON schema), got {type(tool).__name__}")
    return list(tools)
