"""Structured outputs: what a request's output must match (a JSON schema, a regex, a grammar).

A `StructuredOutput` is a request's constraint, carried by `SamplingParams.structured`. It
holds its spec as canonical text (a JSON schema re-serialized, keeping its key order: the
output's property order; a regex; a Lark grammar), so equal constraints share one compiled grammar (`astrai.inference.grammar`). The
grammar library is llguidance (the one vLLM and SGLang use): this module only writes its
grammar text; compiling, masking and matching are `grammar.py` and `constrain.py`. It is
imported when a grammar is first written, so `SamplingParams` (`params.py`, which checks a
constraint's shape) loads without it.

JSON comes out compact with Python's separators (`{"a": 1, "b": [2, 3]}`), no free
whitespace: a model cannot wander off in blanks, and a schema's output has one spelling.
The tool-call form is one call in a tag pair (hermes: `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`), `arguments` matching the named tool's `parameters` schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "lark", "tool_call")

# llguidance's JSON compile options: compact JSON, Python's separators, no free whitespace.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True)
class StructuredOutput:
    """One request's output constraint; build it with the class methods.

    `kind`: one of `KINDS`; `spec`: its canonical text (JSON schema, regex, Lark grammar,
    or the tool-call form's JSON `{"tools": [...], "start": ..., "end": ...}`); `field`:
    the request field an error about it names (`structured` for the engine API,
    `response_format` or `tool_choice` over HTTP).
    """

    kind: str
    spec: str = ""
    field: str = "structured"

    # ------------------------------------------------------------------ constructors
    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | str, *, field: str = "structured"
    ) -> StructuredOutput:
        """Output is JSON valid under `schema` (a dict, or its JSON text)."""
        return cls("json_schema", _canonical_schema(schema, field), field)

    @classmethod
    def json_object(cls, *, field: str = "structured") -> StructuredOutput:
        """Output is any JSON object (OpenAI's `json_object`)."""
        return cls("json_object", '{"type": "object"}', field)

    @classmethod
    def regex(cls, pattern: str, *, field: str = "structured") -> StructuredOutput:
        """Output matches the regular expression `pattern` (Rust regex syntax)."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{field}: a regex must be a non-empty string, got {pattern!r}")
        return cls("regex", pattern, field)

    @classmethod
    def lark(cls, grammar: str, *, field: str = "structured") -> StructuredOutput:
        """Output is a sentence of the Lark grammar (llguidance's dialect; `%json{...}`
        embeds a JSON schema)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError(f"{field}: a grammar must be a non-empty string, got {grammar!r}")
        return cls("lark", grammar, field)

    @classmethod
    def tool_call(
        cls,
        tools: Sequence[Mapping[str, Any]],
        *,
        start: str = "<tool_call>",
        end: str = "</tool_call>",
        field: str = "tool_choice",
    ) -> StructuredOutput:
        """Output is one call of one of `tools` (`{"name": ..., "parameters": schema}`;
        no `parameters`: any JSON object), wrapped in `start` ... `end`."""
        if isinstance(tools, str | bytes) or not isinstance(tools, Sequence) or not tools:
            raise ValueError(f"{field}: needs a non-empty list of tools, got {tools!r}")
        entries = []
        for i, tool in enumerate(tools):
            name = tool.get("name") if isinstance(tool, Mapping) else None
            if not isinstance(name, str) or not name:
                raise ValueError(f"{field}: tools[{i}] has no name")
            params = tool.get("parameters") or {"type": "object"}
            schema = json.loads(_canonical_schema(params, f"{field}: tools[{i}].parameters"))
            entries.append({"name": name, "parameters": schema})
        spec = {"tools": entries, "start": start, "end": end}
        return cls("tool_call", json.dumps(spec, ensure_ascii=False), field)

    # ------------------------------------------------------------------ grammar text
    def grammar(self, special_id: Callable[[str], int | None] = lambda text: None) -> str:
        """llguidance's grammar text for this constraint (the compiled-grammar cache key).
        `special_id(text)`: the id of `text` if the tokenizer has it as one special token (a
        tool-call tag is then matched as that token, the way the model writes it, not as
        its spelling). ValueError naming `field` if the spec cannot even be read."""
        import llguidance as llg

        try:
            if self.kind in ("json_schema", "json_object"):
                return llg.LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(self.spec)
            if self.kind == "lark":
                return llg.LLMatcher.grammar_from_lark(self.spec)
            if self.kind == "tool_call":
                return llg.LLMatcher.grammar_from_lark(
                    _tool_call_lark(json.loads(self.spec), special_id)
                )
        except ValueError as err:
            raise ValueError(f"{self.field}: invalid {self.kind}: {err}") from err
        raise ValueError(f"{self.field}: unknown kind {self.kind!r}, expected one of {KINDS}")


def per_prompt(
    structured: StructuredOutput | Sequence[StructuredOutput | None] | None, n: int
) -> list[StructuredOutput | None]:
    """`run_batch`'s `structured` (one for all, or one per prompt) as one entry per prompt."""
    if structured is None or isinstance(structured, StructuredOutput):
        return [structured] * n
    if isinstance(structured, str | bytes) or not isinstance(structured, Sequence):
        raise ValueError(
            f"structured must be a StructuredOutput or a list of them, got {structured!r}"
        )
    if len(structured) != n:
        raise ValueError(f"structured has {len(structured)} entries for {n} prompts")
    return list(structured)  # each entry is checked with its request (`SamplingParams`)


def _canonical_schema(schema: Mapping[str, Any] | str, field: str) -> str:
    """The schema as compact JSON text; ValueError naming `field` unless it is an object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"{field}: the JSON schema is not valid JSON: {err}") from err
    if not isinstance(schema, Mapping):
        raise ValueError(f"{field}: a JSON schema must be an object, got {schema!r}")
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{field}: the JSON schema is not JSON-serializable: {err}") from err


def _tool_call_lark(spec: dict[str, Any], special_id: Callable[[str], int | None]) -> str:
    """Lark grammar of one call `start\\n{"name": N, "arguments": {...}}\\nend`, arguments
    under tool N's schema (the hermes template's spelling of a call)."""
    rules = []
    for tool in spec["tools"]:
        call = {
            "type": "object",
            "properties": {"name": {"const": tool["name"]}, "arguments": tool["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": JSON_OPTIONS,
        }
        rules.append("%json " + json.dumps(call, ensure_ascii=False))
    ids = [special_id(tag) for tag in (spec["start"], spec["end"])]
    start, end = (
        json.dumps(tag) if i is None else f"<[{i}]>"
        for tag, i in zip((spec["start"], spec["end"]), ids)
    )
    alternatives = "\n    | ".join(rules)
    return f'start: {start} "\\n" call "\\n" {end}\ncall: {alternatives}\n'
