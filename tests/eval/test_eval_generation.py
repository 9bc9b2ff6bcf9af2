"""GenerationSuite: exact match on known completions (scripted, and the real engine's greedy
text from a dense-forward reference), built-in tasks, and bad prompt files."""

import re

import pytest
import torch
from suite_helpers import ScriptedEngine, engine_for, tiny_model, write_jsonl

from astrai.data.rewards import format_answer
from astrai.data.storage import DataError
from astrai.eval import GenerationSuite, builtin_prompts


def test_exact_match_on_scripted_completions(tok, tmp_path):
    rows = [
        {"prompt": "What is 2 + 3?", "answer": "5"},
        {"prompt": "What is 10 - 4?", "answer": 6},
        {"prompt": "What is 7 * 6?", "answer": "42"},
        {"prompt": "Say hi", "note": "no answer: exact_match skips it"},
    ]
    replies = {
        "What is 2 + 3?": "2 + 3 = 5. " + format_answer(5),
        "What is 10 - 4?": "It is 6, or maybe 7.",  # final number 7: wrong
        "What is 7 * 6?": format_answer(42),
        "Say hi": "hi",
    }
    engine = ScriptedEngine(tok, lambda prompt, seed: replies[prompt])
    suite = GenerationSuite(path=str(write_jsonl(tmp_path / "g.jsonl", rows)), max_tokens=8)
    result = suite.run(engine)
    assert [r.get("exact_match") for r in result.samples] == [1.0, 0.0, 1.0, None]
    assert result.metrics["exact_match"] == pytest.approx(2 / 3)
    lengths = [len(tok.encode(replies[r["prompt"]])) for r in rows]
    assert result.metrics["completion_len"] == pytest.approx(sum(lengths) / 4)
    assert engine.calls[0]["max_tokens"] == 8 and engine.calls[0]["temperature"] == 0.0
    assert not suite.chat  # plain prompts: raw text


def test_answer_regex_and_format_metric(tok):
    prompts = [{"prompt": "capital of France?", "answer": "Paris"}, {"prompt": "x", "answer": "y"}]
    replies = {"capital of France?": "ANSWER: Lyon ... ANSWER: Paris", "x": "ANSWER: z"}
    engine = ScriptedEngine(tok, lambda prompt, seed: replies[prompt])
    suite = GenerationSuite(
        prompts=prompts, answer_regex=r"ANSWER: (\w+)", metrics=["exact_match", "format"]
    )
    result = suite.run(engine)
    assert [r["extracted"] for r in result.samples] == ["Paris", "z"]
    assert result.metrics["exact_match"] == 0.5 and result.metrics["format"] == 0.0


def test_real_engine_greedy_completion_is_matched(tok, greedy_reference):
    model = tiny_model(tok)
    prompts = ["def add(a, b):", "import os\n"]
    expected = [tok.decode(greedy_reference(model, tok.encode(p), 6)) for p in prompts]
    records = [
        {"prompt": prompts[0], "answer": expected[0].strip()},
        {"prompt": prompts[1], "answer": expected[1].strip() + " (not it)"},
    ]
    suite = GenerationSuite(prompts=records, answer_regex=r"(?s)(.*)", max_tokens=6)
    with engine_for(model, tok, cache_mode="contiguous") as engine:
        result = suite.run(engine)
    assert [r["completion"] for r in result.samples] == expected
    assert [r["exact_match"] for r in result.samples] == [1.0, 0.0]
    assert result.metrics["completion_len"] == 6


@pytest.fixture(scope="module")
def greedy_reference():
    @torch.no_grad()
    def greedy(model, prompt, n):
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        return ids[len(prompt) :]

    return greedy


def test_builtin_arithmetic_task_uses_options_and_chat(tok):
    options = {"max_operand": 9, "ops": "+"}
    suite = GenerationSuite(task="arithmetic", num_prompts=5, task_options=options)
    records, chat = builtin_prompts("arithmetic", 5, **options)
    assert suite.records == records and suite.chat and chat
    assert all(0 <= int(r["answer"]) <= 18 for r in records)  # a sum of two operands in 0..9
    ids = suite.encode(tok)
    assert ids[0] == tok.apply_chat_template(
        [{"role": "user", "content": records[0]["prompt"]}],
        add_generation_prompt=True,
        tokenize=True,
    )
    stdlib = GenerationSuite(task="stdlib", num_prompts=3, metrics=[])
    assert len(stdlib.records) == 3 and not stdlib.chat
    with pytest.raises(ValueError, match="unknown built-in generation task 'nope'"):
        GenerationSuite(task="nope")


def test_seeds_follow_the_prompt_index_across_chunks(tok):
    engine = ScriptedEngine(tok, lambda prompt, seed: f"{seed}")
    suite = GenerationSuite(prompts=[f"p{i}" for i in range(5)], chunk_size=2, seed=10, metrics=[])
    result = suite.run(engine)
    assert [r["completion"] for r in result.samples] == ["10", "11", "12", "13", "14"]


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"prompt": ""}, "field 'prompt' must be a non-empty string"),
        ({"prompt": "   "}, "field 'prompt' must be a non-empty string"),
        ({"question": "hi"}, "missing field 'prompt'"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ("[1, 2", "not valid JSON"),
    ],
)
def test_bad_prompt_files_name_file_and_line(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": 1}, bad])
    with pytest.raises(DataError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(message)):
        GenerationSuite(path=str(path))


def test_unknown_metric_fails_at_construction():
    with pytest.raises(KeyError, match="unknown reward 'nope'"):
        GenerationSuite(prompts=["x"], metrics=["nope"])


@pytest.mark.parametrize(("option", "value"), [("top_p", 1.5), ("temperature", -1.0)])
def test_a_bad_sampling_setting_fails_at_construction(option, value):
    with pytest.raises(ValueError, match=f"^arith: {option} must be in"):
        GenerationSuite("arith", prompts=["x"], **{option: value})
