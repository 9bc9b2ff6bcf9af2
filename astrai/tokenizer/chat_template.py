"""Chat templates: sandboxed Jinja2 rendering compatible with HF ``transformers``.

Chat templates ship with model checkpoints, i.e. they are untrusted code. They are
compiled in Jinja2's ``ImmutableSandboxedEnvironment`` with the same options, filters and
globals as ``transformers`` (``trim_blocks``, ``lstrip_blocks``, ``tojson``,
``raise_exception``, ``strftime_now``), so a template renders here exactly as it does in
``tokenizer.apply_chat_template`` and a checkpoint behaves the same in both worlds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CHAT_TEMPLATE", "ChatTemplate", "TemplateError"]


class TemplateError(ValueError):
    """A chat template is malformed, unsafe, or failed while rendering.

    A ``ValueError`` so that callers validating user input (the server, data preparation)
    can treat a bad template like any other bad input.
    """


# ChatML with Qwen2.5/Hermes-style tool calling. Written with explicit whitespace control
# ({%- / {{-) so the output does not depend on trim_blocks/lstrip_blocks, and so that
# rendering a conversation prefix gives a prefix of the full rendering (needed for
# template-independent assistant loss masks).
DEFAULT_CHAT_TEMPLATE = """\
{#- astrai default: ChatML with Hermes/Qwen2.5-style tool calls -#}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' and messages[0].content %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + (messages[0].content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\\n' + (message.content or '') + '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if message.content or not loop.first %}
                    {{- '\\n' }}
                {%- endif %}
                {{- '<tool_call>\\n{"name": ' + (tool_call.name | tojson) + ', "arguments": ' }}
                {%- if tool_call.arguments is not defined or tool_call.arguments is none %}
                    {{- '{}' }}
                {%- elif tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown role ' + (message.role | tojson) + ' in message ' + (loop.index0 | string)) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _raise_exception(message: str) -> None:
    """Template global: lets a template reject input with its own message (HF convention)."""
    raise TemplateError(str(message))


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's ``tojson``: plain ``json.dumps`` (Jinja's own filter HTML-escapes ``<>&'``)."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """Template global used by templates that print today's date (e.g. Llama 3.1)."""
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` global without the class itself, so templates cannot reach its attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}"
        )


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` global that refuses underscore names, like HF's, to block dunder games."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # ``self`` comes through *args, as in Jinja's Namespace, so ``namespace(self=...)`` works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts HF's ``{% generation %}...{% endgeneration %}`` and renders the body as is.

    Assistant masks are computed template-independently (see ``AutoTokenizer.encode_chat``),
    but templates written for HF's mask tracker must still compile here.
    """

    tags = {"generation"}  # noqa: RUF012 (Jinja's API)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return caller()


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Sandbox that fails loudly on unsafe attribute access.

    Jinja's default returns an ``Undefined`` that prints as "" and only raises when used
    further; a template poking at ``__class__`` is hostile or broken, so raise at once.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _make_environment() -> jinja2.Environment:
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplate:
    """A compiled, sandboxed chat template.

    Compilation happens once in the constructor, so syntax errors surface when a tokenizer
    is loaded rather than on the first request.
    """

    def __init__(self, source: str) -> None:
        if not isinstance(source, str):
            raise TypeError(f"chat template must be a string, got {type(source).__name__}")
        self.source = source
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(
                f"chat template syntax error at line {e.lineno}: {e.message}"
            ) from e
        except SecurityError as e:
            raise TemplateError(f"chat template is unsafe: {e}") from e

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the same variables HF passes (``documents`` defaults to None).

        Every failure is raised as :class:`TemplateError` so callers need one ``except``.
        """
        kwargs.setdefault("documents", None)
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except TemplateError:
            raise
        except SecurityError as e:
            raise TemplateError(
                f"chat template tried an unsafe operation and was stopped by the sandbox: {e}"
            ) from e
        except jinja2.TemplateError as e:
            line = _template_lineno(e)
            where = f" at line {line}" if line is not None else ""
            raise TemplateError(f"chat template failed to render{where}: {e}") from e
        except (TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
            line = _template_lineno(e)
            where = f" at line {line}" if line is not None else ""
            raise TemplateError(
                f"chat template failed to render{where}: {type(e).__name__}: {e}"
            ) from e

    def __repr__(self) -> str:
        first = self.source.strip().splitlines()[0] if self.source.strip() else ""
        return f"ChatTemplate({first[:60]!r}...)"


def _template_lineno(exc: BaseException) -> int | None:
    """Line of the template where ``exc`` was raised (Jinja rewrites tracebacks to the source)."""
    lineno = getattr(exc, "lineno", None)
    if isinstance(lineno, int):
        return lineno
    tb = exc.__traceback__
    found = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            found = tb.tb_lineno
        tb = tb.tb_next
    return found
