"""Applying structured-output constraints in a step: token masks and matcher advances.

Each constrained sequence has its own llguidance `LLMatcher` (created at its first draw from
the compiled grammar, `astrai.inference.grammar`), kept as long as its task: a preempted
task keeps its matcher, which has consumed exactly the tokens in `output_ids`, and the
recompute samples the next token only, so nothing is consumed twice. A step

    faults = rows.mask(logits, tasks)               # -inf on the tokens each grammar forbids
    ... sample ...
    stopped = rows.advance(tasks, tokens, faults)   # feed each drawn token to its matcher

masks only the constrained rows, batched (one bitmask computed on llguidance's thread
pool, one copy to the device, one apply); unconstrained rows are untouched and a batch
without constraints costs one scan of its tasks. The mask comes before penalties, bias and
temperature (`sampling.py`), so the returned log-probs are under the masked logits, like
a logits processor's. A grammar that fails (an error state, no allowed token, a drawn
token it rejects) fails its own request only (`faults`, see `astrai.inference.isolation`).
A sequence whose matcher has stopped (complete output; the EOS it allows was drawn, or
nothing may follow) is reported in `stopped`: it ends with finish reason `stop`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence

import llguidance as llg
import torch
from llguidance.torch import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    fill_next_token_bitmask,
    fill_next_token_bitmask_par,
)

from astrai.inference.grammar import GrammarCompiler
from astrai.inference.processors import describe
from astrai.inference.task import Task

logger = logging.getLogger(__name__)


class GrammarRows:
    """The matchers of one runner's constrained sequences, and the masks of a step.

    `seconds`: wall time spent in `mask` and `advance` with constrained rows (the cost of
    structured outputs, which benchmarks report as a share of their wall time).
    """

    def __init__(self, compiler: GrammarCompiler | None, *, threads: int | None = None) -> None:
        self.compiler = compiler
        self.threads = threads
        self._matchers: weakref.WeakKeyDictionary[Task, llg.LLMatcher] = weakref.WeakKeyDictionary()
        self._executor: llg.LLExecutor | None = None
        self._bitmask: torch.Tensor | None = None
        self._eager_apply = False
        self.seconds = 0.0

    def matcher(self, task: Task) -> llg.LLMatcher:
        """The task's matcher, created (and fed its output so far) at its first draw."""
        m = self._matchers.get(task)
        if m is None:
            if self.compiler is None:
                raise RuntimeError("this engine has no grammar compiler")
            m = self.compiler.matcher(task.params.structured)
            if task.output_ids and not m.consume_tokens(list(task.output_ids)):
                raise ValueError(f"output so far does not match: {m.get_error()}")
            self._matchers[task] = m
        return m

    def mask(self, logits: torch.Tensor, tasks: Sequence[Task]) -> dict[int, str]:
        """Set to -inf, in place, each constrained row's tokens its grammar forbids (and the
        ids past the tokenizer's vocabulary). Returns `{row: error}` for failed grammars."""
        rows = [i for i, t in enumerate(tasks) if t.params.structured is not None]
        if not rows:
            return {}
        start = time.perf_counter()
        try:
            return self._mask(logits, tasks, rows)
        finally:
            self.seconds += time.perf_counter() - start

    def _mask(self, logits: torch.Tensor, tasks: Sequence[Task], rows: list[int]) -> dict[int, str]:
        faults: dict[int, str] = {}
        live: list[tuple[int, llg.LLMatcher]] = []
        for i in rows:
            try:
                m = self.matcher(tasks[i])
                if m.is_error():
                    raise RuntimeError(m.get_error())
                live.append((i, m))
            except Exception as err:
                faults[i] = f"grammar failed: {describe(err)}"
        if not live:
            return faults
        bitmask = self._fill(live, faults)
        ok = [k for k, (i, _) in enumerate(live) if i not in faults]
        if ok:
            try:  # the constrained rows are edited as a copy: others never see a failure
                self._mask_rows(logits, [live[k][0] for k in ok], bitmask[ok])
            except Exception as err:
                for k in ok:
                    faults[live[k][0]] = f"grammar mask failed: {describe(err)}"
        for i, error in faults.items():
            logger.warning("request %d: %s", tasks[i].id, error)
        return faults

    def _mask_rows(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """Apply `bitmask` (one row per entry of `rows`) to those rows of `logits`."""
        idx = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, idx)
        vocab = self.compiler.vocab_size
        if sub.shape[1] > vocab:  # model vocabulary padding: never a valid token
            sub[:, vocab:] = float("-inf")
        self._apply(sub, bitmask.to(logits.device, non_blocking=True))
        logits.index_copy_(0, idx, sub)

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """llguidance's (torch.compile'd) kernel; where compiling fails (no compiler on the
        machine), the same unpacking in eager torch, so masking never fails a step."""
        if not self._eager_apply:
            try:
                apply_token_bitmask_inplace(logits, bitmask)
                return
            except Exception as err:
                logger.warning("compiled token-mask kernel failed (%s); eager", describe(err))
                self._eager_apply = True
        apply_token_bitmask_eager(logits, bitmask)

    def _fill(self, live: list[tuple[int, llg.LLMatcher]], faults: dict[int, str]) -> torch.Tensor:
        """The bitmask rows of `live`, computed in parallel (row by row if that raises);
        rows that fail or allow no token go to `faults`."""
        vocab = self.compiler.vocab_size
        buf = self._bitmask
        if buf is None or buf.shape[0] < len(live):
            buf = self._bitmask = allocate_token_bitmask(max(len(live), 8), vocab)
        bitmask = buf[: len(live)]
        try:
            if self._executor is None:
                self._executor = llg.LLExecutor(self.threads)
            pairs = [(m, k) for k, (_, m) in enumerate(live)]
            fill_next_token_bitmask_par(self._executor, pairs, bitmask)
        except Exception as err:
            logger.warning("batched grammar masks failed (%s); row by row", describe(err))
            for k, (i, m) in enumerate(live):
                try:
                    fill_next_token_bitmask(m, bitmask, k)
                except Exception as row_err:
                    faults[i] = f"grammar failed: {describe(row_err)}"
        empty = (bitmask == 0).all(dim=1).tolist()
        for k, (i, m) in enumerate(live):
            if i not in faults and (empty[k] or m.is_error()):
                why = m.get_error() or "it allows no next token"
                faults[i] = f"grammar failed: {why}"
        return bitmask

    def advance(
        self, tasks: Sequence[Task], tokens: Sequence[int], faults: dict[int, str]
    ) -> set[int]:
        """Feed each constrained, non-faulted row its drawn token; a rejected token (e.g. a
        logits processor lifted the mask) adds to `faults`. Returns the rows whose matcher
        has stopped (their output is complete)."""
        stopped: set[int] = set()
        start = time.perf_counter()
        for i, task in enumerate(tasks):
            if task.params.structured is None or i in faults:
                continue
            m = self._matchers.get(task)
            if m is None:
                continue
            try:
                if not m.consume_token(tokens[i]):
                    raise ValueError(f"token {tokens[i]} rejected: {m.get_error()}")
            except Exception as err:
                faults[i] = f"grammar failed: {describe(err)}"
                logger.warning("request %d: %s", task.id, faults[i])
                continue
            if m.is_stopped():
                stopped.add(i)
        if self._matchers:
            self.seconds += time.perf_counter() - start
        return stopped


def apply_token_bitmask_eager(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """llguidance's `apply_token_bitmask_inplace` in eager torch: `-inf` on every token whose
    bit in the `[B, ceil(V / 32)]` int32 `bitmask` is 0, and on ids past the mask."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, : logits.shape[1]]
    logits[:, : allowed.shape[1]].masked_fill_(allowed == 0, float("-inf"))
    logits[:, allowed.shape[1] :] = float("-inf")
