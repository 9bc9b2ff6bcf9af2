"""CodeSuite: pass@k against a brute-force count over all k-subsets; scripted completions
scored by execution, bad ones contained; the shipped sample's reference solutions pass."""

import dataclasses
import itertools
import json
import re

import pytest
from suite_helpers import ScriptedEngine, engine_for, write_jsonl

from astrai.data.storage import DataError
from astrai.eval import CodeSuite, pass_at_k
from astrai.eval.code import program_of, truncate
from astrai.eval.sandbox import run_programs
from astrai.eval.tasks import DATA_DIR


def brute_pass_at_k(n, c, k):
    """Fraction of the k-subsets of n samples (the first c passing) holding a passing one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


TASKS = [
    {
        "task_id": "t/add",
        "prompt": "def add(a, b):\n",
        "test": "def check(f):\n    assert f(2, 3) == 5\n",
        "entry_point": "add",
    },
    {
        "task_id": "t/neg",
        "prompt": "def neg(x):\n",
        "test": "def check(f):\n    assert f(4) == -4\n",
        "entry_point": "neg",
    },
]


class GroupScriptedEngine(ScriptedEngine):
    """`ScriptedEngine` answering `params.n` samples per prompt as `run_batch` does:
    prompt-major, sample j of prompt i seeded `seed + i * n + j`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group_calls: list[tuple[int, int, int]] = []  # (prompts, n, seed) per call

    def run_batch(self, prompt_ids_list, params=None, *, seed=0, **options):
        n = params.n
        self.group_calls.append((len(prompt_ids_list), n, seed))
        expanded = [ids for ids in prompt_ids_list for _ in range(n)]
        return super().run_batch(expanded, dataclasses.replace(params, n=1), seed=seed, **options)


def test_scripted_samples_are_executed_and_counted(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRAI_TEST_FAKE_SECRET", "hunter2")
    # each task's 3 samples are one group (task i, sample j: seed i * 3 + j): add passes
    # twice in three, neg never (an infinite loop, an allocation without end, a read of the
    # environment secret)
    replies = {
        "def add(a, b):\n": [
            "    return a + b\n\ndef unused():\n    pass",
            "    return a - b",
            "    return b + a\n",
        ],
        "def neg(x):\n": [
            "    while True:\n        pass",
            "    b = []\n    while True:\n        b.append(bytearray(1 << 24))",
            "    import os\n    return -x if os.environ['ASTRAI_TEST_FAKE_SECRET'] else x",
        ],
    }
    engine = GroupScriptedEngine(tok, lambda prompt, seed: replies[prompt][seed % 3])
    path = write_jsonl(tmp_path / "code.jsonl", TASKS)
    suite = CodeSuite(path=str(path), num_samples=3, k=[1, 2, 3], timeout=2.0, memory_mb=256)
    result = suite.run(engine)
    assert engine.group_calls == [(2, 3, 0)]  # one call: both tasks, 3 samples each
    add, neg = result.samples
    assert add["status"] == ["passed", "failed", "passed"] and add["passed"] == 2
    assert add["completions"][0] == "    return a + b\n"  # cut at the stop sequence "\ndef"
    assert neg["status"] == ["timeout", "memory", "failed"] and neg["passed"] == 0
    for k in (1, 2, 3):
        assert result.metrics[f"pass@{k}"] == pytest.approx(brute_pass_at_k(3, 2, k) / 2)


def test_samples_beyond_max_n_come_in_blocks_with_distinct_seeds(tok, tmp_path):
    """num_samples 20 > MAX_N (16): a block of 16 and one of 4, each a group per task, in
    chunks of `chunk_size` tasks; every sample of every task has its own seed."""
    tasks = [{**TASKS[0], "task_id": f"t{i}", "prompt": f"def f{i}():\n"} for i in range(3)]
    seen = []

    def reply(prompt, seed):
        seen.append((prompt, seed))
        return "    return 1\n"

    engine = GroupScriptedEngine(tok, reply)
    path = write_jsonl(tmp_path / "code.jsonl", tasks)
    suite = CodeSuite(path=str(path), num_samples=20, k=[1, 10], chunk_size=2)
    completions = suite.complete(engine)
    assert [len(c) for c in completions] == [20, 20, 20]
    assert [(p, n) for p, n, _ in engine.group_calls] == [(2, 16), (1, 16), (2, 4), (1, 4)]
    assert sorted(seed for _, seed in seen) == list(range(60))
    for i in range(3):  # up to MAX_N: task i, sample j draws with seed i * 16 + j
        assert [s for p, s in seen if p == f"def f{i}():\n"][:16] == list(
            range(16 * i, 16 * i + 16)
        )


def test_pass_at_k_samples_share_their_prompt_prefill(tok, model):
    """On a paged engine each task's samples are one group: all but one find the prompt's
    complete pages in the prefix cache."""
    engine = engine_for(model, tok)
    suite = CodeSuite(num_samples=4, k=[1, 4], max_tokens=4, temperature=1.0, limit=2)
    suite.complete(engine)
    prompts = [tok.encode(t["prompt"]) for t in suite.tasks]
    shared = sum((len(p) - 1) // 4 * 4 for p in prompts)  # engine_for: pages of 4 tokens
    stats = engine.get_stats()
    assert stats["cached_prompt_tokens"] == 3 * shared > 0
    assert stats["total_tasks"] == 8 and engine.pool.all_free()


def test_shipped_sample_reference_solutions_pass():
    tasks = [json.loads(line) for line in (DATA_DIR / "code_sample.jsonl").read_text().splitlines()]
    assert len(tasks) >= 5
    good = run_programs([program_of(t, t["canonical_solution"]) for t in tasks])
    bad = run_programs([program_of(t, "    pass\n") for t in tasks])
    assert all(r.passed for r in good) and not any(r.passed for r in bad)
    assert len(CodeSuite().tasks) == len(tasks)  # the default task file


def test_truncate_at_the_first_stop_sequence():
    assert truncate("    return 1\nprint(2)\ndef f(): pass", ("\ndef", "\nprint")) == "    return 1"
    assert truncate("    return 1", ("\ndef",)) == "    return 1"


def test_bad_settings_and_files(tmp_path):
    with pytest.raises(ValueError, match=re.escape("every k must be in 1..num_samples=2")):
        CodeSuite(num_samples=2, k=[1, 5])
    bad = write_jsonl(tmp_path / "bad.jsonl", [TASKS[0], {**TASKS[1], "entry_point": "not ok"}])
    with pytest.raises(DataError, match=re.escape(f"{bad}:2: field 'entry_point'")):
        CodeSuite(path=str(bad))
    empty = write_jsonl(tmp_path / "empty.jsonl", [{**TASKS[0], "prompt": ""}])
    with pytest.raises(DataError, match=re.escape(f"{empty}:1: field 'prompt'")):
        CodeSuite(path=str(empty))
