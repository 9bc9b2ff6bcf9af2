"""The tensor work behind log-probs: prompt scoring during prefill, top-k alternatives, and
the request checks, ordering and results of `InferenceEngine.score` (types: `logprobs.py`).

The vocabulary projection runs over at most `chunk` positions at a time, in fp32 for the
softmax, so no full-vocabulary logits tensor for a whole batch ever exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from astrai.inference.batch import single
from astrai.inference.logprobs import PromptScores, ScoreResult, TokenLogprob, TopLogprobs
from astrai.inference.params import MAX_LOGPROBS, SamplingParams, check_count, is_int, params_from
from astrai.inference.task import Task

if TYPE_CHECKING:
    from astrai.inference.scheduler import StepPlan


def _log_softmax_(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log_softmax, in place when the input already is a fresh fp32 tensor."""
    logits = logits.float()
    return logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))


def _top(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return ids, vals


@dataclass(slots=True)
class PromptTargets:
    """The prompt tokens one plan's forward scores: plan rows, scoring positions, targets."""

    spans: list[tuple[int, int, int]]  # (plan row, first target position, count)
    index: list[int]  # packed position whose logits score each target
    targets: list[int]
    ks: list[int]  # top alternatives asked for each target

    @classmethod
    def of(cls, plan: StepPlan) -> PromptTargets | None:
        """What `plan` scores (None: nothing; the runner then takes the cheap path)."""
        out, offset = None, 0
        for i, (task, n, end) in enumerate(zip(plan.tasks, plan.q_lens, plan.seq_lens)):
            k, start = task.params.prompt_logprobs, end - n
            first = max(start + 1, task.params.prompt_logprobs_start)
            last = min(end, len(task.prompt_ids) - 1)
            if k is not None and first <= last:
                out = out or cls([], [], [], [])
                out.spans.append((i, first, last - first + 1))
                out.index.extend(range(offset + first - 1 - start, offset + last - start))
                out.targets.extend(task.prompt_ids[first : last + 1])
                out.ks.extend([k] * (last - first + 1))
            offset += n
        return out

    def score(
        self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], chunk: int
    ) -> list[PromptScores]:
        """Score the targets from `hidden`, the final-normed hidden states of every packed
        token of the plan, applying `lm_head` to at most `chunk` positions at a time."""
        device, ks = hidden.device, self.ks
        index_t = torch.tensor(self.index, dtype=torch.int64, device=device)
        target_t = torch.tensor(self.targets, dtype=torch.int64, device=device)
        k_max = max(ks)
        lps, greedy, top_ids, top_vals = [], [], [], []
        for s in range(0, len(self.index), chunk):
            logp = _log_softmax_(lm_head(hidden[index_t[s : s + chunk]]))
            tgt = target_t[s : s + chunk]
            lps.append(logp.gather(1, tgt[:, None])[:, 0])
            greedy.append(logp.argmax(-1) == tgt)
            if k_max:
                ids, vals = _top(logp, k_max)
                top_ids.append(ids)
                top_vals.append(vals)
        lp_host = torch.cat(lps).tolist()
        greedy_host = torch.cat(greedy).tolist()
        ids_host = torch.cat(top_ids).tolist() if k_max else []
        vals_host = torch.cat(top_vals).tolist() if k_max else []
        out, j = [], 0
        for row, first, count in self.spans:
            tokens = []
            for _ in range(count):
                k = ks[j]
                top = tuple(zip(ids_host[j][:k], vals_host[j][:k])) if k else ()
                tokens.append(TokenLogprob(self.targets[j], lp_host[j], greedy_host[j], top))
                j += 1
            out.append(PromptScores(row, first, tokens))
        return out


def top_alternatives(logits: torch.Tensor, ks: Sequence[int]) -> list[TopLogprobs] | None:
    """Each row's `ks[i]` most likely `(token_id, logprob)` under log_softmax(`logits`),
    descending; computed only for rows with `ks[i] > 0` (None when no row asks)."""
    rows = [i for i, k in enumerate(ks) if k > 0]
    if not rows:
        return None
    sel = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    ids, vals = _top(_log_softmax_(logits.index_select(0, sel)), max(ks[i] for i in rows))
    ids_host, vals_host = ids.tolist(), vals.tolist()
    out: list[TopLogprobs] = [()] * len(ks)
    for j, i in enumerate(rows):
        out[i] = tuple(zip(ids_host[j][: ks[i]], vals_host[j][: ks[i]]))
    return out


# ---------------------------------------------------------------------- scoring requests
def check_score_requests(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]], *, max_seq_len: int, vocab_size: int
) -> list[tuple[list[int], list[int]]]:
    """`(context, continuation)` pairs as lists of ints; ValueError naming the first bad
    request's index (empty part, too long, id outside the vocabulary)."""
    out = []
    for i, request in enumerate(requests):
        try:
            context, continuation = request
        except (TypeError, ValueError):
            raise ValueError(
                f"request {i}: expected a (context_ids, continuation_ids) pair, got {request!r}"
            ) from None
        pair = []
        for name, ids in (("context", context), ("continuation", continuation)):
            if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
                raise ValueError(f"request {i}: {name} must be a list of token ids, got {ids!r}")
            if not ids:
                raise ValueError(f"request {i}: {name} is empty")
            bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"request {i}: {name} token id(s) outside the vocabulary [0, {vocab_size}): "
                    f"{bad[:5]}"
                )
            pair.append([int(t) for t in ids])
        total = len(pair[0]) + len(pair[1])
        if total > max_seq_len:
            raise ValueError(
                f"request {i}: too long: {total} tokens, the engine's context holds {max_seq_len}"
            )
        out.append((pair[0], pair[1]))
    return out


def score_params(params: SamplingParams | None, top_logprobs: int | None) -> SamplingParams:
    """`score`'s settings: one sequence, `top_logprobs` (when given) alternatives per token,
    else `params.prompt_logprobs` (None: 0)."""
    if top_logprobs is not None:
        check_count("top_logprobs", top_logprobs, MAX_LOGPROBS)
    extra = {} if top_logprobs is None else {"prompt_logprobs": top_logprobs}
    base = single(params_from(params, extra), "score")
    if base.prompt_logprobs is None:
        base = dataclasses.replace(base, prompt_logprobs=0)
    return base


def score_tasks(
    pairs: Sequence[tuple[list[int], list[int]]],
    base: SamplingParams,
    check: Callable[[list[int], SamplingParams], None],
    backend: str | None,
) -> list[Task]:
    """One task per checked `(context, continuation)` pair: nothing sampled, the prompt
    scored from the continuation on; `check` (the engine's request check) raising names
    the request's index."""
    tasks = []
    for i, (context, continuation) in enumerate(pairs):
        p = dataclasses.replace(base, max_tokens=0, prompt_logprobs_start=len(context))
        task = Task(prompt_ids=context + continuation, params=p, backend=backend)
        try:
            check(task.prompt_ids, p)
        except ValueError as err:
            raise ValueError(f"request {i}: {err}") from None
        tasks.append(task)
    return tasks


def score_phases(contexts: Sequence[Sequence[int]], shared: bool) -> list[list[int]]:
    """Request indices in the order to run them: with a prefix cache (`shared`), the first
    request of every context runs first, then the rest, which find that context cached."""
    if not shared:
        return [list(range(len(contexts)))]
    first, rest, seen = [], [], set()
    for i, context in enumerate(contexts):
        key = tuple(context)
        (rest if key in seen else first).append(i)
        seen.add(key)
    return [first, rest] if rest else [first]


@contextmanager
def score_progress(tasks: Sequence[Task], progress: bool) -> Iterator[None]:
    """A progress bar (`progress`; off: none) that counts the score tasks as they finish."""
    with tqdm(
        total=len(tasks), desc="score", unit="req", disable=None if progress else True
    ) as bar:
        for t in tasks:
            t.on_finish = lambda _, bar=bar: bar.update(1)
        yield


def score_result(index: int, task: Task, context_len: int) -> ScoreResult:
    """The continuation part of finished scoring task `index`'s prompt log-probs;
    RuntimeError when it did not run to the end."""
    if task.finish_reason != "length":
        raise RuntimeError(f"request {index} {task.finish_reason}: {task.error}")
    tokens = [t for t in (task.prompt_logprobs or [])[context_len:] if t is not None]
    if len(tokens) != len(task.prompt_ids) - context_len:
        raise RuntimeError(f"task {task.id}: prompt log-probs are incomplete")
    return ScoreResult(
        logprob=sum(t.logprob for t in tokens),
        greedy=all(t.greedy for t in tokens),
        tokens=tokens,
    )
