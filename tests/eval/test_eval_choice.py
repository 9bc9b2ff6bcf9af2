"""MultipleChoiceSuite: acc and acc_norm equal a hand computation from dense-forward
log-probs; a permutation keeps the answer; bad files name file, line and field."""

import re

import numpy as np
import pytest
from suite_helpers import dense_logprobs, engine_for, write_jsonl

from astrai.data.storage import DataError
from astrai.eval import MultipleChoiceSuite

QUESTIONS = [
    {"question": "What is 2 + 3?", "choices": ["4", "5", "six", "7"], "answer": 1},
    {"question": "Which keyword defines a function?", "choices": ["def", "class"], "answer": "def"},
    {"question": "Pick the module", "choices": ["os", "import sys", "print(x)"], "answer": 0},
    {"question": "What is returned?", "choices": ["None", "a + b", "0"], "answer": 1},
    {"question": "Café or thé?", "choices": ["café crème", "thé", "eau"], "answer": 2},
]


@pytest.fixture()
def task_file(tmp_path):
    return write_jsonl(tmp_path / "mc.jsonl", QUESTIONS)


def hand_scores(model, tok, context, choices):
    """Summed log-prob of each `" " + choice` after `context` (lm-eval's token split), and
    its UTF-8 byte length."""
    lls, lengths = [], []
    ctx = tok.encode(context)
    for choice in choices:
        whole = tok.encode(context + " " + choice)
        lp = dense_logprobs(model, whole)  # lp[t - 1] scores whole[t]
        lls.append(float(lp[len(ctx) - 1 :].sum()))
        lengths.append(len((" " + choice).encode("utf-8")))
    return np.array(lls), np.array(lengths)


def test_acc_and_acc_norm_equal_hand_computation(tok, model, task_file):
    suite = MultipleChoiceSuite(path=str(task_file))
    with engine_for(model, tok) as engine:
        result = suite.run(engine)
    acc, acc_norm = [], []
    for q, row in zip(QUESTIONS, result.samples):
        lls, lengths = hand_scores(model, tok, f"Question: {q['question']}\nAnswer:", q["choices"])
        np.testing.assert_allclose(row["loglikelihoods"], lls, rtol=1e-5, atol=1e-5)
        answer = q["answer"] if isinstance(q["answer"], int) else q["choices"].index(q["answer"])
        acc.append(float(np.argmax(lls) == answer))
        acc_norm.append(float(np.argmax(lls / lengths) == answer))
    assert result.metrics["acc"] == pytest.approx(np.mean(acc))
    assert result.metrics["acc_norm"] == pytest.approx(np.mean(acc_norm))
    assert [r["acc"] for r in result.samples] == acc
    # this model and file make the two metrics disagree somewhere: both are really tested
    assert acc != acc_norm or 0 < np.mean(acc) < 1


def test_permutation_keeps_the_answer(tok, model, task_file):
    plain = MultipleChoiceSuite(path=str(task_file))
    shuffled = MultipleChoiceSuite(path=str(task_file), permute=True, seed=3)
    with engine_for(model, tok) as engine:
        a, b = plain.run(engine), shuffled.run(engine)
    moved = 0
    for q, row_a, row_b in zip(QUESTIONS, a.samples, b.samples):
        correct = q["choices"][row_a["answer"]]
        assert row_b["choices"][row_b["answer"]] == correct
        assert sorted(row_b["choices"]) == sorted(q["choices"])
        assert row_b["choices"] == [q["choices"][j] for j in row_b["permutation"]]
        moved += row_b["permutation"] != sorted(row_b["permutation"])
        # the same texts get the same scores, wherever they stand
        assert row_b["loglikelihoods"][row_b["answer"]] == pytest.approx(
            row_a["loglikelihoods"][row_a["answer"]], abs=1e-5
        )
    assert moved > 0
    assert b.metrics == pytest.approx(a.metrics)
    again = MultipleChoiceSuite(path=str(task_file), permute=True, seed=3)
    assert again.items == shuffled.items  # seeded


def test_fewshot_uses_other_questions_with_their_answers(task_file):
    suite = MultipleChoiceSuite(path=str(task_file), num_fewshot=2)
    for i, context in enumerate(suite.contexts):
        blocks = context.split("\n\n")
        assert len(blocks) == 3 and blocks[-1] == f"Question: {QUESTIONS[i]['question']}\nAnswer:"
        for block in blocks[:2]:
            q = next(q for q in QUESTIONS if block.startswith(f"Question: {q['question']}\n"))
            assert q is not QUESTIONS[i]
            answer = q["answer"] if isinstance(q["answer"], str) else q["choices"][q["answer"]]
            assert block.endswith("Answer: " + answer)


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"question": "q", "choices": ["only"], "answer": 0}, "'choices' needs at least 2"),
        ({"question": "q", "choices": "ab", "answer": 0}, "'choices' must be a list"),
        ({"question": "", "choices": ["a", "b"], "answer": 0}, "'question' must be a non-empty"),
        ({"question": "q", "choices": ["a", "b"], "answer": 2}, "'answer' index 2"),
        ({"question": "q", "choices": ["a", "b"], "answer": "c"}, "'answer' must be"),
        ({"question": "q", "choices": ["a", "b"]}, "missing field 'answer'"),
        ('{"question": "q", "choices": [', "not valid JSON"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [QUESTIONS[0], QUESTIONS[1], bad])
    with pytest.raises(DataError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(message)):
        MultipleChoiceSuite(path=str(path))


def test_sample_file_ships_with_the_package(tok):
    suite = MultipleChoiceSuite()
    assert len(suite.items) >= 8 and suite.required_seq_len(tok) > 4
