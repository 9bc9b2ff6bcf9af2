"""Generation suites: sample a completion per prompt, extract the answer, score it.

Records come from a JSONL file (``{"prompt": str | "messages": [...], "answer": ...}``), from
a list given in code or config, or from a built-in task (``arithmetic``: held-out problems
with their answers; ``countdown``: held-out Countdown problems with their numbers and target;
``stdlib``: the first lines of held-out standard-library files).
Metrics are rewards from :mod:`astrai.data.rewards` by name (``exact_match``: the
completion's final number against ``answer``), averaged over the records that have the
fields they need, plus ``completion_len`` (generated tokens per prompt). ``answer_regex``
replaces the number extraction of ``exact_match`` with a regular expression whose last
match (its first group, if it has one) must equal the answer as text.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from astrai.data.builtin import arithmetic_problems, stdlib_records
from astrai.data.countdown import countdown_problems, countdown_prompt_records
from astrai.data.rewards import RewardFn, get_reward
from astrai.eval.suite import Suite, SuiteResult, progress_bar
from astrai.eval.tasks import DataError, read_records, text_field

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine
    from astrai.tokenizer import AutoTokenizer

log = logging.getLogger(__name__)

__all__ = ["TASKS", "GenerationSuite", "builtin_prompts", "extract_answer", "regex_match"]

TASKS = ("arithmetic", "countdown", "stdlib")


def builtin_prompts(
    task: str, n: int, seed: int = 0, **options: Any
) -> tuple[list[dict[str, Any]], bool]:
    """Fixed evaluation records of a built-in task and whether they are chat-shaped.

    ``arithmetic``: held-out (val split) problems with their ``answer`` (``options`` go to
    ``arithmetic_problems``, e.g. ``max_operand``, ``ops``); ``countdown``: distinct held-out
    Countdown problems with their ``numbers`` and ``target`` (``options`` go to
    ``countdown_problems``); ``stdlib``: the first lines of held-out standard-library files,
    as raw-text prompts for pretrained models.
    """
    if task == "arithmetic":
        options.setdefault("unique", True)  # n distinct held-out problems
        problems = arithmetic_problems(n, seed=seed, split="val", **options)
        return [{"prompt": p["prompt"], "answer": p["answer"]} for p in problems], True
    if task == "countdown":
        options.setdefault("unique", True)
        problems = countdown_problems(n, seed=seed, split="val", **options)
        return countdown_prompt_records(problems), True
    if task == "stdlib":
        out = []
        for rec in stdlib_records("val"):
            lines = [ln for ln in rec["text"].splitlines() if ln.strip()][:3]
            if lines:
                out.append({"prompt": "\n".join(lines) + "\n", "path": rec["path"]})
            if len(out) >= n:
                break
        return out, False
    raise ValueError(f"unknown built-in generation task {task!r}; choose one of {TASKS}")


def extract_answer(pattern: re.Pattern[str], completion: str) -> str | None:
    """The last non-empty match of `pattern` in `completion` (its first group if it has
    groups); None when nothing matches."""
    matches = [m for m in pattern.finditer(completion) if m.group(0)]
    if not matches:
        return None
    last = matches[-1]
    return (last.group(1) if pattern.groups else last.group(0)).strip()


def regex_match(pattern: str) -> RewardFn:
    """An ``exact_match`` that extracts the answer with `pattern` and compares it as text."""
    compiled = re.compile(pattern)

    def score(record: Mapping[str, Any], completion: str) -> float:
        if "answer" not in record:
            raise KeyError("regex exact_match needs an 'answer' field")
        got = extract_answer(compiled, completion)
        return 1.0 if got is not None and got == str(record["answer"]).strip() else 0.0

    return score


def _check_record(record: Any, where: str) -> dict[str, Any]:
    """A prompt record with a non-empty `prompt` string or `messages` list."""
    if isinstance(record, str):
        record = {"prompt": record}
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a string or an object, got {type(record).__name__}")
    record = dict(record)
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: field 'messages' must be a non-empty list of messages")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise DataError(f"{where}: field 'messages' item {i} needs a 'role'")
    else:
        text_field(record, "prompt", where)
    return record


class GenerationSuite(Suite):
    """Generate for fixed prompts and score the completions with reward functions.

    Args:
        name: metric namespace.
        path: JSONL (or JSON array) of records ``{"prompt" | "messages", "answer", ...}``.
        prompts: instead, records (or plain prompt strings) given directly.
        task: instead, a built-in task: ``arithmetic``, ``countdown`` or ``stdlib``.
        num_prompts: how many built-in prompts.
        task_options: options of the built-in task (arithmetic: ``max_operand``, ``ops``, ...;
            countdown: ``max_number``, ``max_target``, ...).
        limit: read at most this many records of `path`.
        chat: render prompts with the chat template (None: for the built-in tasks but
            ``stdlib``, and for
            ``messages`` records; raw text otherwise).
        max_tokens, temperature, top_p, top_k, seed: sampling (temperature 0 = greedy;
            prompt ``i`` draws with seed ``seed + i``).
        metrics: reward names from :mod:`astrai.data.rewards`.
        answer_regex: extract the answer of ``exact_match`` with this regular expression.
        chunk_size: prompts per ``run_batch`` call (the progress bar's steps).
    """

    def __init__(
        self,
        name: str = "generation",
        *,
        path: str | None = None,
        prompts: Sequence[Any] | None = None,
        task: str | None = None,
        num_prompts: int = 64,
        task_options: Mapping[str, Any] | None = None,
        limit: int | None = None,
        chat: bool | None = None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        metrics: str | Sequence[str] | None = ("exact_match",),
        answer_regex: str | None = None,
        chunk_size: int = 256,
    ) -> None:
        self.name = name
        if sum(x is not None for x in (path, prompts, task)) != 1:
            raise ValueError(f"{name}: give exactly one of `path`, `prompts` or `task`")
        if task is not None:
            self.records, default_chat = builtin_prompts(
                str(task), int(num_prompts), int(seed), **dict(task_options or {})
            )
            self.wheres = [f"{task}[{i}]" for i in range(len(self.records))]
        else:
            if path is not None:
                rows = read_records(path, limit)
            else:
                rows = [(f"{name}: prompts[{i}]", p) for i, p in enumerate(prompts or [])]
            self.wheres = [where for where, _ in rows]
            self.records = [_check_record(rec, where) for where, rec in rows]
            default_chat = any("messages" in r for r in self.records)
        if not self.records:
            raise ValueError(f"{name}: no prompts")
        self.chat = default_chat if chat is None else bool(chat)
        if not self.chat:
            for where, rec in zip(self.wheres, self.records):
                if "messages" in rec:
                    raise DataError(f"{where}: chat=false needs 'prompt' strings, not 'messages'")
        if int(max_tokens) < 1:
            raise ValueError(f"{name}: max_tokens must be >= 1, got {max_tokens}")
        self.sampling = self.sampling_params(max_tokens, temperature, top_p, top_k)
        self.seed = int(seed)
        names = [metrics] if isinstance(metrics, str) else list(metrics or [])
        self.metrics: dict[str, RewardFn] = {n: get_reward(n) for n in names}  # unknown: fail now
        self.answer_regex = answer_regex
        if answer_regex is not None:
            try:
                self.metrics["exact_match"] = regex_match(answer_regex)
            except re.error as err:
                raise ValueError(f"{name}: answer_regex {answer_regex!r}: {err}") from None
        self.chunk_size = max(1, int(chunk_size))
        self._encoded: tuple[int, list[list[int]]] | None = None

    # ------------------------------------------------------------------ prompts
    def encode(self, tokenizer: AutoTokenizer) -> list[list[int]]:
        """Prompt token ids (chat-rendered or raw), computed once per tokenizer."""
        if self._encoded is not None and self._encoded[0] == id(tokenizer):
            return self._encoded[1]
        ids = []
        for where, rec in zip(self.wheres, self.records):
            prompt = rec.get("messages", rec.get("prompt"))
            if self.chat:
                msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                encoded = tokenizer.apply_chat_template(
                    msgs, add_generation_prompt=True, tokenize=True
                )
            else:
                encoded = tokenizer.encode(prompt)
            if not encoded:
                raise DataError(f"{where}: the prompt encodes to no tokens")
            ids.append(list(encoded))
        self._encoded = (id(tokenizer), ids)
        return ids

    def required_seq_len(self, tokenizer: AutoTokenizer) -> int:
        return max(len(p) for p in self.encode(tokenizer)) + self.sampling.max_tokens

    # ------------------------------------------------------------------ run
    def generate(self, engine: InferenceEngine, progress: bool = False) -> list[Any]:
        """`BatchResult`s for every prompt, in order, `chunk_size` prompts per call."""
        ids = self.encode(engine.tokenizer)
        results: list[Any] = []
        with progress_bar(len(ids), f"eval {self.name}", progress, "prompt") as bar:
            for start in range(0, len(ids), self.chunk_size):
                chunk = ids[start : start + self.chunk_size]
                results += engine.run_batch(
                    chunk, self.request(self.sampling), seed=self.seed + start, return_details=True
                )
                bar.update(len(chunk))
        return results

    def run(self, engine: InferenceEngine, *, progress: bool = False) -> SuiteResult:
        started = time.perf_counter()
        results = self.generate(engine, progress)
        tokenizer = engine.tokenizer
        rows, scores = [], {name: [] for name in self.metrics}
        for where, rec, res in zip(self.wheres, self.records, results):
            text = tokenizer.decode(res.token_ids, skip_special_tokens=True)
            row: dict[str, Any] = {
                "where": where,
                "prompt": rec.get("prompt", rec.get("messages")),
                "completion": text,
                "finish_reason": res.finish_reason,
                "completion_tokens": len(res.token_ids),
            }
            if res.error:
                row["error"] = res.error
                log.warning("%s: %s: %s", self.name, where, res.error)
            if "answer" in rec:
                row["answer"] = rec["answer"]
            if self.answer_regex is not None:
                row["extracted"] = extract_answer(re.compile(self.answer_regex), text)
            for name, fn in self.metrics.items():
                value = _score(fn, rec, text)
                if value is not None:
                    row[name] = value
                    scores[name].append(value)
            rows.append(row)
        metrics = {k: sum(v) / len(v) for k, v in scores.items() if v}
        metrics["completion_len"] = sum(r["completion_tokens"] for r in rows) / len(rows)
        return SuiteResult(self.name, metrics, rows, time.perf_counter() - started)


def _score(
    fn: Callable[[Mapping[str, Any], str], float], record: Mapping, text: str
) -> float | None:
    """`fn(record, text)`, or None when the record lacks a field the metric needs."""
    try:
        return float(fn(record, text))
    except KeyError:
        return None
