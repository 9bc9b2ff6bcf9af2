"""vLLM's `structured_outputs` request field as an engine constraint (`StructuredOutput`).

`{"structured_outputs": {...}}` (an extra body field of `/v1/chat/completions` and
`/v1/completions`) holds exactly one of `json` (a JSON schema, or its JSON text: the path
`response_format: json_schema` takes), `json_object: true`, `regex`, `choice` (the output is
exactly one of the strings) or `grammar` (a Lark grammar in llguidance's dialect, the one
`StructuredOutput.lark` takes). Each is checked and compiled here, in the prepare step, so
a malformed one is a 400 naming `structured_outputs.<kind>` before anything is queued.
Another constraint on the same chat request (`response_format` other than text, a forced
`tool_choice`) is a 400 naming both: the answer cannot follow two.
"""

from __future__ import annotations

import json

from astrai.inference.structured import StructuredOutput
from astrai.serve.errors import APIError
from astrai.serve.schemas import StructuredOutputsParams
from astrai.serve.structured import compiled
from astrai.tokenizer import AutoTokenizer

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def structured_outputs_constraint(
    params: StructuredOutputsParams | None, tokenizer: AutoTokenizer
) -> StructuredOutput | None:
    """The request's `structured_outputs` as a compiled constraint (None when absent)."""
    if params is None:
        return None
    unsupported = {
        "structural_tag": params.structural_tag,
        "whitespace_pattern": params.whitespace_pattern,
    }
    for name, value in unsupported.items():
        if value is not None:
            field = f"structured_outputs.{name}"
            raise APIError(400, f"{field}: not supported by this server", param=field)
    given = [k for k, v in _values(params).items() if v is not None and v is not False]
    if len(given) != 1:
        named = ", ".join(given) if given else "none"
        raise APIError(
            400,
            f"structured_outputs: give exactly one of {', '.join(KINDS)} (got {named})",
            param="structured_outputs",
        )
    kind = given[0]
    field = f"structured_outputs.{kind}"
    value = _values(params)[kind]
    if kind == "json":
        return compiled(lambda: StructuredOutput.json_schema(value, field=field), tokenizer, field)
    if kind == "json_object":
        return compiled(lambda: StructuredOutput.json_object(field=field), tokenizer, field)
    if kind == "regex":
        return compiled(lambda: StructuredOutput.regex(value, field=field), tokenizer, field)
    if kind == "grammar":
        return compiled(lambda: StructuredOutput.lark(value, field=field), tokenizer, field)
    grammar = choice_grammar(value, field)
    return compiled(lambda: StructuredOutput.lark(grammar, field=field), tokenizer, field)


def choice_grammar(choices: list[str], field: str = "structured_outputs.choice") -> str:
    """A Lark grammar whose sentences are exactly `choices`: an alternation of string
    literals (JSON-quoted, so any character in a choice is matched as itself)."""
    if not choices:
        raise APIError(400, f"{field}: needs at least one choice", param=field)
    empty = [i for i, c in enumerate(choices) if not c]
    if empty:
        raise APIError(400, f"{field}: choice [{empty[0]}] is an empty string", param=field)
    literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return f"start: {literals}\n"


def conflict(other: str) -> APIError:
    """The 400 naming both fields of a request constrained by `structured_outputs` and by
    `other` (`response_format`, `tool_choice`) as well."""
    return APIError(
        400,
        f"structured_outputs: cannot be combined with {other} (both constrain the output); "
        "send one",
        param="structured_outputs",
    )


def _values(params: StructuredOutputsParams) -> dict[str, object]:
    return {
        "json": params.json_,
        "json_object": params.json_object,
        "regex": params.regex,
        "choice": params.choice,
        "grammar": params.grammar,
    }
