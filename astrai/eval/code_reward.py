"""The ``code_tests`` reward: 1.0 when a completion passes its record's tests in the sandbox.

Two record shapes are understood:

- HumanEval: ``prompt`` (signature and docstring), ``test`` (defines ``check(candidate)``) and
  ``entry_point``. The program is the code suite's: the completion cut at the first of
  :data:`~astrai.eval.code.HUMANEVAL_STOP`, then :func:`~astrai.eval.code.program_of`, so a
  reward and the pass@1 that :class:`~astrai.eval.code.CodeSuite` reports agree.
- MBPP: ``test_list`` (assert statements) and optionally ``test_setup_code``. The program is
  the completion's code (its first fenced block tagged ``python`` or ``py``, else its first
  untagged fenced block, else the whole completion), then the setup, then the asserts.

It is registered in :mod:`astrai.data.rewards` by import path, because ``astrai.data`` does
not import ``astrai.eval``. What the program does (a syntax error, a wrong answer, a crash, an
endless loop) scores 0.0, never an exception; a record of neither shape raises.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from astrai.eval.code import HUMANEVAL_STOP, program_of, truncate
from astrai.eval.sandbox import run_programs

__all__ = ["CodeTests", "code_of"]

_HUMANEVAL_FIELDS = ("prompt", "test", "entry_point")
_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.S | re.M)


def code_of(completion: str) -> str:
    """The code in a completion: its first fenced block tagged ``python``/``py`` (an unclosed
    one runs to the end), else its first untagged fenced block, else the whole text."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE_RE.finditer(completion)]
    for wanted in (("python", "py", "python3"), ("",)):
        for lang, body in blocks:
            if lang in wanted:
                return body
    return completion


def _text(record: Mapping[str, Any], key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"code_tests: {where}: field {key!r} must be a string")
    return value


class CodeTests:
    """Reward 1.0 when the program built from a record and a completion exits 0 within its
    limits, else 0.0.

    Args:
        timeout: wall-clock seconds per program (the CPU limit is this rounded up, plus one).
        memory_mb: address space per program.
        workers: programs run at once by :meth:`batch`.
    """

    def __init__(self, timeout: float = 10.0, memory_mb: int = 1024, workers: int = 4) -> None:
        if not timeout > 0 or not memory_mb > 0 or not int(workers) >= 1:
            raise ValueError(
                f"code_tests: timeout and memory_mb must be > 0 and workers >= 1, got "
                f"timeout={timeout}, memory_mb={memory_mb}, workers={workers}"
            )
        self.timeout = float(timeout)
        self.memory_mb = int(memory_mb)
        self.workers = int(workers)

    def __repr__(self) -> str:
        return (
            f"CodeTests(timeout={self.timeout}, memory_mb={self.memory_mb}, workers={self.workers})"
        )

    def program(self, record: Mapping[str, Any], completion: str, where: str = "record") -> str:
        """The program that checks `completion` against `record`'s tests; a ``KeyError``
        naming the fields it needs when `record` is of neither shape."""
        if "test" in record or "entry_point" in record or "test_list" not in record:
            missing = [k for k in _HUMANEVAL_FIELDS if k not in record]
            if missing:
                raise KeyError(
                    f"code_tests: {where} needs HumanEval's {list(_HUMANEVAL_FIELDS)} (missing "
                    f"{missing}) or MBPP's 'test_list' (+ optional 'test_setup_code'); it has "
                    f"{sorted(record)}"
                )
            task = {k: _text(record, k, where) for k in _HUMANEVAL_FIELDS}
            return program_of(task, truncate(completion, HUMANEVAL_STOP))
        tests = record["test_list"]
        if isinstance(tests, str) or not isinstance(tests, Sequence):
            raise ValueError(f"code_tests: {where}: field 'test_list' must be a list of strings")
        if not all(isinstance(t, str) for t in tests):
            raise ValueError(f"code_tests: {where}: field 'test_list' must be a list of strings")
        setup = _text(record, "test_setup_code", where) if "test_setup_code" in record else ""
        return f"{code_of(completion)}\n\n{setup}\n\n" + "\n".join(tests) + "\n"

    def batch(
        self, records: Sequence[Mapping[str, Any]], completions: Sequence[str]
    ) -> list[float]:
        """Scores of many completions, their programs run ``workers`` at a time. Every record
        is checked before any program runs."""
        if len(records) != len(completions):
            raise ValueError(
                f"code_tests: {len(records)} records but {len(completions)} completions"
            )
        programs = [
            self.program(rec, text, f"record {i}")
            for i, (rec, text) in enumerate(zip(records, completions))
        ]
        results = run_programs(
            programs, workers=self.workers, timeout=self.timeout, memory_mb=self.memory_mb
        )
        return [1.0 if r.passed else 0.0 for r in results]

    def __call__(self, record: Mapping[str, Any], completion: str) -> float:
        return self.batch([record], [completion])[0]
