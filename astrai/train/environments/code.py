"""`CodeRepair`: write a program that passes a record's tests, with a second try on failure.

The records are HumanEval's (``prompt`` a signature and docstring, ``test`` defining
``check(candidate)``, ``entry_point``) or MBPP's (``text`` or ``prompt``, ``test_list`` of
asserts, optional ``test_setup_code``). The model answers in chat, with the whole program
(a fenced block or plain code); it runs in the evaluation sandbox against the tests, built
as :class:`~astrai.eval.code_reward.CodeTests` builds an MBPP program (a HumanEval record is
its ``test`` and ``check(entry_point)`` as the asserts: in chat the model writes the whole
function, not the continuation of its signature). Passing ends the episode with reward 1.0;
a failure with attempts left shows the model the tail of the program's error output and
asks for a corrected program; the last failure ends it with 0.0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from astrai.eval.code_reward import CodeTests
from astrai.eval.sandbox import ExecutionResult, run_program
from astrai.serve.tool_parsers import ToolParserChoice
from astrai.train.environments.base import Environment, StepResult

__all__ = ["CodeRepair"]

# The sandbox runs each program from a fresh temporary directory: tracebacks name it, which
# would make the feedback (and the tokens the model is shown) differ from run to run.
_SANDBOX_DIR = re.compile(r"[^\s\"']*/astrai-sandbox-[^/\s\"']*/")


class CodeRepair(Environment):
    """Programs checked by their record's tests; failures get `max_attempts - 1` retries.

    Args:
        max_attempts: programs the model may submit per episode (1: no feedback turn).
        timeout, memory_mb: per-program sandbox limits (wall-clock seconds, address space).
        feedback_chars: at most this many trailing characters of the program's error
            output are shown to the model.
        tool_parser: how tool calls in the model's turns are read (`Environment`).
    """

    tools = None

    def __init__(
        self,
        *,
        max_attempts: int = 2,
        timeout: float = 10.0,
        memory_mb: int = 1024,
        feedback_chars: int = 1000,
        tool_parser: str | ToolParserChoice = "auto",
    ) -> None:
        super().__init__(tool_parser=tool_parser)
        for name, value, low in (
            ("max_attempts", max_attempts, 1),
            ("feedback_chars", feedback_chars, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"CodeRepair {name} must be an int >= {low}, got {value!r}")
        self.tests = CodeTests(timeout=timeout, memory_mb=memory_mb, workers=1)
        self.max_attempts = max_attempts
        self.feedback_chars = feedback_chars
        self.attempts = 0
        self.checks: dict[str, Any] = {}

    def reset(self, record: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.attempts = 0
        if "test_list" in record and "test" not in record and "entry_point" not in record:
            task = record.get("text", record.get("prompt"))
            if not isinstance(task, str):
                raise ValueError(
                    "CodeRepair: an MBPP record needs a string field 'text' or 'prompt'"
                )
            self.checks = {k: record[k] for k in ("test_list", "test_setup_code") if k in record}
            asserts = record["test_list"]
            shown = "\n".join(asserts) if _strings(asserts) else ""
            content = (
                f"{task}\nYour code should pass these tests:\n\n{shown}\n\n"
                "Reply with the whole program in a ```python code block."
            )
        else:
            missing = [k for k in ("prompt", "test", "entry_point") if k not in record]
            if missing:
                raise KeyError(
                    f"CodeRepair: a record needs HumanEval's 'prompt', 'test', 'entry_point' "
                    f"(missing {missing}) or MBPP's 'text' and 'test_list'"
                )
            if not all(isinstance(record[k], str) for k in ("prompt", "test", "entry_point")):
                raise ValueError("CodeRepair: 'prompt', 'test' and 'entry_point' must be strings")
            if not record["entry_point"].isidentifier():
                raise ValueError(
                    f"CodeRepair: 'entry_point' must be a Python name, got {record['entry_point']!r}"
                )
            self.checks = {"test_list": [record["test"], f"check({record['entry_point']})"]}
            content = (
                "Complete the following Python function. Reply with the whole function (and "
                f"its imports) in a ```python code block.\n\n```python\n{record['prompt']}```"
            )
        self.tests.program(self.checks, "", "the record")  # a malformed record fails here
        return [{"role": "user", "content": content}]

    def step(self, messages: list[dict[str, Any]]) -> StepResult:
        self.attempts += 1
        reply = messages[-1].get("content") or ""
        result = run_program(
            self.tests.program(self.checks, reply),
            timeout=self.tests.timeout,
            memory_mb=self.tests.memory_mb,
        )
        if result.passed:
            return StepResult(None, 1.0, True)
        if self.attempts >= self.max_attempts:
            return StepResult(None, 0.0, True)
        return StepResult([{"role": "user", "content": self.feedback(result)}], 0.0, False)

    def feedback(self, result: ExecutionResult) -> str:
        """The user message after a failed program: how it ended and its output's tail."""
        if result.status == "timeout":
            what = f"did not finish within {self.tests.timeout:g} s"
        elif result.status == "memory":
            what = f"ran out of memory ({self.tests.memory_mb} MB)"
        else:
            what = f"failed (exit status {result.returncode})"
        output = _SANDBOX_DIR.sub("", result.stderr.strip() or result.stdout.strip())
        if len(output) > self.feedback_chars:  # the end of a traceback says the most
            kept = output[len(output) - self.feedback_chars :] if self.feedback_chars else ""
            output = "..." + kept
        shown = f"\n\n```\n{output}\n```" if output else ""
        return (
            f"Your program {what}.{shown}\n\n"
            "Fix it and reply with the whole corrected program in a ```python code block."
        )


def _strings(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(v, str) for v in value)
    )
