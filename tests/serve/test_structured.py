"""The protocol fields as constraints (`astrai.serve.structured`) called from Python, where
no body limit holds a schema's depth: too deep a schema is a 400 naming the field, never a
RecursionError (over HTTP the body limit refuses it first: test_limits.py)."""

from __future__ import annotations

import sys

import pytest

from astrai.serve import ServeSettings
from astrai.serve.errors import APIError
from astrai.serve.schemas import ResponseFormat
from astrai.serve.structured import response_format_constraint, tool_call_constraint


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_past_the_recursion_limit_is_a_400(tokenizer):
    deep = _deep_schema(sys.getrecursionlimit())
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}
    )
    with pytest.raises(APIError) as err:
        response_format_constraint(fmt, tokenizer)
    assert err.value.status == 400 and err.value.param == "response_format"
    assert "nested too deeply" in err.value.message
    with pytest.raises(APIError) as err:
        tool_call_constraint([{"name": "f", "parameters": deep}], ServeSettings(), tokenizer)
    assert err.value.status == 400 and err.value.param == "tools"
