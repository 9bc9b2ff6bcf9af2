"""Multiple choice by log-likelihood: which answer does the model find most likely?

A task file holds ``{"question", "choices": [...], "answer": index | text}`` per line. Each
question becomes one context (optional few-shot examples from the same file, then the
question through ``template``) and one continuation per choice (``target_delimiter +
choice``), tokenised as lm-evaluation-harness does (the context's trailing whitespace moves
to the continuation; the continuation's tokens are those the full string adds to the
context's). All choices of a question go to ``engine.score`` together, so with a prefix
cache they share the context's KV.

``acc``: the choice with the highest summed log-prob is the answer. ``acc_norm``: the same
with each log-prob divided by the UTF-8 byte length of its continuation text, which removes
the bias towards short answers (lm-eval's ``acc_norm``; it counts characters, the same for
ASCII). ``permute`` shuffles each question's choices with a seeded permutation (the answer
index follows), which exposes a model that prefers a position rather than an answer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from astrai.eval.suite import Suite, SuiteResult, progress_bar
from astrai.eval.tasks import DataError, read_records, resolve_path, text_field

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine
    from astrai.tokenizer import AutoTokenizer

__all__ = ["MultipleChoiceSuite", "encode_pair"]

SAMPLE_FILE = "choice_sample.jsonl"


def encode_pair(tokenizer: AutoTokenizer, context: str, continuation: str) -> tuple[list, list]:
    """Context and continuation token ids, split as lm-eval's ``_encode_pair`` splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx) :]


def _check_item(record: dict[str, Any], where: str) -> dict[str, Any]:
    """`{question, choices, answer (index)}` of a valid record, else an error naming the field."""
    text_field(record, "question", where)
    choices = record.get("choices")
    if not isinstance(choices, list):
        raise DataError(f"{where}: field 'choices' must be a list of strings, got {choices!r}")
    if len(choices) < 2:
        raise DataError(f"{where}: field 'choices' needs at least 2 entries, has {len(choices)}")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice.strip():
            raise DataError(f"{where}: field 'choices' entry {i} must be a non-empty string")
    if "answer" not in record:
        raise DataError(f"{where}: missing field 'answer' (an index or one of the choices)")
    answer = record["answer"]
    if isinstance(answer, int) and not isinstance(answer, bool):
        if not 0 <= answer < len(choices):
            raise DataError(f"{where}: field 'answer' index {answer} outside 0..{len(choices) - 1}")
    elif isinstance(answer, str) and answer in choices:
        answer = choices.index(answer)
    else:
        raise DataError(f"{where}: field 'answer' must be an index or one of the choices")
    return {**record, "choices": list(choices), "answer": answer}


class MultipleChoiceSuite(Suite):
    """``acc`` and ``acc_norm`` of log-likelihood multiple choice from a local JSONL file.

    Args:
        name: metric namespace.
        path: JSONL of ``{question, choices, answer}`` (None: the sample shipped with astrai).
        limit: score only the first `limit` questions (few-shot examples still come from
            the whole file).
        num_fewshot: solved examples from the same file (never the question itself) put
            before each question, drawn with `fewshot_seed`.
        permute: shuffle every question's choices (seeded by `seed` and the question).
        template: the question's text; ``{question}`` and any other record field.
        target_delimiter: between the question's text and a choice.
        fewshot_delimiter: between examples.
        chunk_size: questions per ``engine.score`` call.
    """

    def __init__(
        self,
        name: str = "multiple_choice",
        *,
        path: str | None = None,
        limit: int | None = None,
        num_fewshot: int = 0,
        fewshot_seed: int = 1234,
        permute: bool = False,
        seed: int = 0,
        template: str = "Question: {question}\nAnswer:",
        target_delimiter: str = " ",
        fewshot_delimiter: str = "\n\n",
        chunk_size: int = 256,
    ) -> None:
        self.name = name
        rows = read_records(resolve_path(path, SAMPLE_FILE))
        self.wheres = [where for where, _ in rows]
        self.pool = [_check_item(rec, where) for where, rec in rows]
        count = len(self.pool) if limit is None else min(int(limit), len(self.pool))
        if not 0 <= num_fewshot < len(self.pool):
            raise ValueError(
                f"{name}: num_fewshot must be in 0..{len(self.pool) - 1} (the file has "
                f"{len(self.pool)} questions), got {num_fewshot}"
            )
        self.template = template
        self.target_delimiter = target_delimiter
        self.fewshot_delimiter = fewshot_delimiter
        self.contexts = [self._context(i, num_fewshot, fewshot_seed) for i in range(count)]
        self.items = []  # the questions as presented: choices in order, answer index
        for i in range(count):
            item = self.pool[i]
            order = list(range(len(item["choices"])))
            if permute:
                order = np.random.default_rng([seed, i]).permutation(len(order)).tolist()
            choices = [item["choices"][j] for j in order]
            self.items.append({"choices": choices, "answer": order.index(item["answer"])})
            if permute:
                self.items[-1]["permutation"] = order
        self.chunk_size = max(1, int(chunk_size))
        self._encoded: tuple[int, list[list[tuple[list, list]]]] | None = None

    def _question(self, i: int) -> str:
        try:
            return self.template.format_map(self.pool[i])
        except (KeyError, IndexError, ValueError) as err:
            raise DataError(f"{self.wheres[i]}: template {self.template!r}: {err!r}") from None

    def _context(self, i: int, num_fewshot: int, fewshot_seed: int) -> str:
        shots = []
        if num_fewshot:
            others = [j for j in range(len(self.pool)) if j != i]
            picked = np.random.default_rng([fewshot_seed, i]).choice(
                others, num_fewshot, replace=False
            )
            for j in picked.tolist():
                shot = self.pool[j]
                answer = shot["choices"][shot["answer"]]
                shots.append(self._question(j) + self.target_delimiter + answer)
        return self.fewshot_delimiter.join([*shots, self._question(i)])

    # ------------------------------------------------------------------ tokens
    def continuations(self, i: int) -> list[str]:
        return [self.target_delimiter + c for c in self.items[i]["choices"]]

    def encode(self, tokenizer: AutoTokenizer) -> list[list[tuple[list, list]]]:
        """`(context_ids, continuation_ids)` per choice, per question."""
        if self._encoded is not None and self._encoded[0] == id(tokenizer):
            return self._encoded[1]
        out = []
        for i, context in enumerate(self.contexts):
            pairs = [encode_pair(tokenizer, context, c) for c in self.continuations(i)]
            if any(not ctx or not cont for ctx, cont in pairs):
                raise DataError(f"{self.wheres[i]}: a context or choice encodes to no tokens")
            out.append(pairs)
        self._encoded = (id(tokenizer), out)
        return out

    def required_seq_len(self, tokenizer: AutoTokenizer) -> int:
        return max(len(c) + len(t) for pairs in self.encode(tokenizer) for c, t in pairs)

    # ------------------------------------------------------------------ run
    def run(self, engine: InferenceEngine, *, progress: bool = False) -> SuiteResult:
        started = time.perf_counter()
        encoded = self.encode(engine.tokenizer)
        scores: list[list[Any]] = []
        with progress_bar(len(encoded), f"eval {self.name}", progress, "question") as bar:
            for start in range(0, len(encoded), self.chunk_size):
                chunk = encoded[start : start + self.chunk_size]
                flat = engine.score(
                    [pair for pairs in chunk for pair in pairs], self.score_params()
                )
                for pairs in chunk:
                    scores.append(flat[: len(pairs)])
                    flat = flat[len(pairs) :]
                bar.update(len(chunk))
        rows = []
        for i, (item, results) in enumerate(zip(self.items, scores)):
            lls = np.array([r.logprob for r in results])
            lengths = np.array([len(c.encode("utf-8")) for c in self.continuations(i)])
            pred, pred_norm = int(np.argmax(lls)), int(np.argmax(lls / lengths))
            rows.append(
                {
                    "where": self.wheres[i],
                    "question": self.pool[i]["question"],
                    **item,
                    "loglikelihoods": lls.tolist(),
                    "pred": pred,
                    "pred_norm": pred_norm,
                    "greedy": bool(results[item["answer"]].greedy),
                    "acc": float(pred == item["answer"]),
                    "acc_norm": float(pred_norm == item["answer"]),
                }
            )
        metrics = {
            "acc": sum(r["acc"] for r in rows) / len(rows),
            "acc_norm": sum(r["acc_norm"] for r in rows) / len(rows),
        }
        return SuiteResult(self.name, metrics, rows, time.perf_counter() - started)
