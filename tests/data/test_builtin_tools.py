"""``builtin:arithmetic/tools``: chats that call the ``calc`` tool, as the environment expects
them, rendered and masked so that SFT learns the call and the answer but not the response."""

from __future__ import annotations

import ast
import operator
from pathlib import Path

import pytest

from astrai.data.builtin import arithmetic_problems, builtin_records, sft_records, tool_records
from astrai.data.prepare import prepare
from astrai.data.rewards import REWARDS
from astrai.data.storage import H5Storage
from astrai.tokenizer import DEFAULT_CHAT_TEMPLATE

OPTIONS = {"ops": "+-", "max_operand": 99, "solution": "columns"}
PROBLEM = {"id": "p", "prompt": "What is 89 + 99?", "expression": "89 + 99", "answer": "188"}
EXPECTED = (
    "<|im_start|>user\nWhat is 89 + 99?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "calc", "arguments": {"expr": "89 + 99"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n188\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n89 + 99 = 188. The answer is 188.<|im_end|>\n"
)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(expression: str) -> int:
    """The expression's value, computed apart from the generator (integer + - * only)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp):
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        assert isinstance(node, ast.Constant) and isinstance(node.value, int)
        return node.value

    return walk(ast.parse(expression, mode="eval").body)


def _uses_tool(record: dict) -> bool:
    return any("tool_calls" in m for m in record["messages"])


def _tool_chat() -> list[dict]:
    (record,) = tool_records([{**PROBLEM, "solution": "unused"}], tool_fraction=1.0)
    return record["messages"]


def test_renders_the_hermes_tool_call_like_transformers(tok, tok_dir: Path) -> None:
    import transformers

    messages = _tool_chat()
    assert tok.apply_chat_template(messages) == EXPECTED
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tok_dir)
    theirs = hf.apply_chat_template(messages, chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False)
    assert theirs == EXPECTED
    assert "tools" not in tool_records([{**PROBLEM, "solution": "x"}], tool_fraction=1.0)[0]


def test_loss_mask_covers_the_call_and_the_answer_not_the_response(tok) -> None:
    ids, mask = tok.encode_chat(_tool_chat())
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(tok.decode(ids[start:i]))
            start = None
    assert runs == [
        '<tool_call>\n{"name": "calc", "arguments": {"expr": "89 + 99"}}\n</tool_call><|im_end|>',
        "89 + 99 = 188. The answer is 188.<|im_end|>",
    ]
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert "<tool_response>\n188\n</tool_response>" in unmasked


def test_fraction_is_seeded_and_near_tool_fraction() -> None:
    problems = arithmetic_problems(2000, seed=3, **OPTIONS)
    records = tool_records(problems, tool_fraction=0.3, seed=3)
    share = sum(map(_uses_tool, records)) / len(records)
    assert 0.27 < share < 0.33
    assert records == tool_records(problems, tool_fraction=0.3, seed=3)
    assert records != tool_records(problems, tool_fraction=0.3, seed=4)
    assert tool_records(problems[:100], tool_fraction=0.3, seed=3) == records[:100]
    # the direct records are the SFT records; 0 and 1 are all of one kind
    direct = sft_records(problems)
    assert all(r == d for r, d in zip(records, direct) if not _uses_tool(r))
    assert tool_records(problems, tool_fraction=0.0) == direct
    assert all(map(_uses_tool, tool_records(problems, tool_fraction=1.0)))


def test_tool_responses_and_answers_are_correct() -> None:
    records = list(builtin_records("arithmetic/tools/val", n=300, seed=2, max_terms=3))
    with_tool = [r for r in records if _uses_tool(r)]
    assert 100 < len(with_tool) < 200  # default tool_fraction 0.5
    assert all(r["id"].startswith("arith-val-2") for r in records)
    for record in with_tool:
        user, call, response, final = record["messages"]
        assert (user["role"], call["role"], response["role"], final["role"]) == (
            "user",
            "assistant",
            "tool",
            "assistant",
        )
        (tool_call,) = call["tool_calls"]
        expr = tool_call["function"]["arguments"]["expr"]
        assert tool_call["function"]["name"] == "calc" and user["content"] == f"What is {expr}?"
        assert response["content"] == record["answer"] == str(_value(expr))
        assert final["content"] == f"{expr} = {_value(expr)}. The answer is {_value(expr)}."
        assert REWARDS["exact_match"](record, final["content"]) == 1.0


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half", None, True])
def test_bad_tool_fraction_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="tool_fraction"):
        list(builtin_records("arithmetic/tools", n=4, tool_fraction=bad))


def test_tool_fraction_passes_through_prepare(tmp_path: Path, tok) -> None:
    opts = {"n": 40, "seed": 1, **OPTIONS}
    call = tok.token_to_id("<tool_call>")
    for fraction, expected in ((1.0, 40), (0.0, 0)):
        out = tmp_path / str(fraction)
        builtin = {**opts, "tool_fraction": fraction}
        prepare("sft", "builtin:arithmetic/tools/val", out, tok, builtin=builtin, progress=False)
        storage = H5Storage(out / "arithmetic-tools-val.h5")
        calls = sum(call in storage.get("input_ids", i).tolist() for i in range(len(storage)))
        assert calls == expected
