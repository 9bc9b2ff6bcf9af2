"""Speculative decoding's ``draft_model`` proposer: a smaller model sharing the tokenizer.

The draft model (`engine.speculative.model`, an astrai or HF directory) is loaded onto the
target's device and dtype and proposes greedily (argmax), so its proposals are a
deterministic function of the request's tokens, which verification by "sample and compare"
needs (`astrai.inference.speculative`).

KV cache. The issue asks for the draft's KV "in the same page pool"; the engine's pool is
laid out for the target's layers and KV heads, so the draft gets a second `PagePool` of its
own, laid out for its own layers, in contiguous mode: one row per request of `max_seq_len`
slots, `max_batch_size` rows (what the engine's pool has). It is the honest equivalent: the
same storage, request table and `bind_tasks`, sized by the same limits. A request takes a
row at its first proposal and gives it back once it has finished (checked at each
`propose`) or when the engine closes (`close`); a preempted request keeps its row (it comes
back with the same tokens, so its draft KV is still valid). Should the rows run out (more
preempted requests waiting than rows to spare), a row of a request outside the step is
reclaimed; that request starts its draft KV over if it comes back.

One `propose` step, for the sequences `seq = prompt + output` of the speculating requests
(the last token is the one the target feeds this step) with budgets `k`:

1. one ragged forward over each request's tokens whose draft KV is missing, `seq[cached:]`
   (the whole prompt at first, then usually the one or two tokens the target emitted since;
   at least the newest token), whose last logits give the first proposal;
2. `max(k) - 1` single-token decode forwards, each feeding every still-going row's previous
   proposal (a row drops out once it has its `k`).

The proposals' KV is written at positions `len(seq) .. len(seq) + k - 2`. When the target
keeps `accepted` of them (`verified`), the KV is valid for `len(seq) + min(accepted, k - 1)`
tokens (a rejected proposal's KV is overwritten by the next forward: contiguous KV is
positional). Without a `verified` call (the step did not verify that row), only `len(seq)`
tokens are known valid; the next `propose` starts from there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from astrai.inference.cache import PagePool
from astrai.inference.speculative import Proposer, SpeculativeConfig
from astrai.model.layers import engine_forward, mark_cache_resident
from astrai.model.mla_config import kv_geometry

if TYPE_CHECKING:
    from astrai.inference.task import Task
    from astrai.model import Transformer

logger = logging.getLogger(__name__)


@dataclass
class DraftState:
    """One request's draft KV: its pool `row`, the leading tokens of its sequence whose KV
    is valid (`cached`), and the last proposal's sequence length and size (`at`, `proposed`)."""

    row: int
    cached: int = 0
    at: int = 0
    proposed: int = 0


def load_draft(path: str | Path, target: Transformer) -> Transformer:
    """The draft model of directory `path` on the target's device and dtype, in eval mode;
    ValueError (naming `engine.speculative.model`) when it cannot serve as the draft."""
    from astrai.model import AutoModel

    param = next(target.parameters())
    try:
        draft = AutoModel.from_pretrained(path, device=param.device, dtype=param.dtype)
    except (OSError, ValueError) as err:  # no dir / config.json / weights; a bad config
        raise ValueError(
            f"engine.speculative.model: cannot load the draft model {path}: {err}"
        ) from err
    draft_vocab, target_vocab = draft.config.vocab_size, target.config.vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(
            f"engine.speculative.model: the draft model {path} has vocab_size {draft_vocab}, "
            f"the target {target_vocab}; the draft must share the target's tokenizer"
        )
    return draft.eval()


class DraftModelProposer(Proposer):
    """Greedy proposals of a draft model (vLLM's ``draft_model``): see the module docstring.

    `max_seq_len` None: the engine's default, `min(max_position_embeddings, 4096)` of the
    target."""

    def __init__(
        self,
        config: SpeculativeConfig,
        model: Transformer,
        max_batch_size: int,
        max_seq_len: int | None,
    ) -> None:
        if not config.model:
            raise ValueError("engine.speculative.model: method draft_model needs a model dir")
        self.model = load_draft(config.model, model)
        mark_cache_resident(self.model)
        param = next(self.model.parameters())
        cfg = self.model.config
        self.max_seq_len = max_seq_len or min(model.config.max_position_embeddings, 4096)
        self.pool = PagePool(
            num_layers=cfg.num_hidden_layers,
            **kv_geometry(cfg),
            dtype=param.dtype,
            device=param.device,
            max_batch_size=max_batch_size,
            max_seq_len=self.max_seq_len,
            mode="contiguous",
        )
        self.device = self.pool.device
        self.num_speculative_tokens = config.num_speculative_tokens
        self._states: dict[Task, DraftState] = {}
        logger.info(
            "speculative decoding: draft model %s (%d layers, hidden %d), K=%d",
            config.model,
            cfg.num_hidden_layers,
            cfg.hidden_size,
            config.num_speculative_tokens,
        )

    # ------------------------------------------------------------------ rows
    def _release_finished(self) -> None:
        for task in [t for t in self._states if t.finished]:
            self._drop(task)

    def _drop(self, task: Task) -> None:
        state = self._states.pop(task)
        self.pool.free_task(state.row)

    def _state(self, task: Task, busy: set[int]) -> DraftState | None:
        """`task`'s draft state, taking a pool row at its first proposal; when no row is
        free, one of a request outside this step (`busy`: the step's task ids) is reclaimed
        (it starts over, should it come back). None: every row serves this step."""
        state = self._states.get(task)
        if state is not None:
            return state
        got = self.pool.alloc_task([])
        if got is None:
            idle = next((t for t in self._states if t.id not in busy), None)
            if idle is None:
                return None
            self._drop(idle)
            got = self.pool.alloc_task([])
            if got is None:
                return None
        state = self._states[task] = DraftState(row=got[0])
        return state

    # ------------------------------------------------------------------ proposing
    def propose(self, tasks: Sequence[Task], budgets: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in tasks]
        with torch.inference_mode():
            self._release_finished()
            busy = {t.id for t in tasks}
            # (output index, state, sequence length, budget) of each row that proposes
            rows: list[tuple[int, DraftState, int, int]] = []
            token_ids: list[int] = []
            positions: list[int] = []
            q_lens: list[int] = []
            for i, (task, k) in enumerate(zip(tasks, budgets)):
                seq = task.prompt_ids + task.output_ids
                n = len(seq)
                k = min(k, self.max_seq_len + 1 - n)  # proposals' KV ends at n + k - 2
                if k <= 0 or n == 0:
                    continue
                state = self._state(task, busy)
                if state is None:
                    continue
                start = min(state.cached, n - 1)  # the newest token is always fed
                token_ids.extend(seq[start:])
                positions.extend(range(start, n))
                q_lens.append(n - start)
                state.cached, state.at, state.proposed = n, n, k
                rows.append((i, state, n, k))
            if not rows:
                return out
            tokens = self._forward(
                [s.row for _, s, _, _ in rows],
                [n for _, _, n, _ in rows],
                q_lens,
                token_ids,
                positions,
            )
            for (i, _, _, _), tok in zip(rows, tokens):
                out[i].append(tok)
            for j in range(1, max(k for _, _, _, k in rows)):
                going = [r for r in rows if r[3] > j]
                last = [out[i][-1] for i, _, _, _ in going]
                tokens = self._forward(
                    [s.row for _, s, _, _ in going],
                    [n + j for _, _, n, _ in going],
                    [1] * len(going),
                    last,
                    [n + j - 1 for _, _, n, _ in going],
                )
                for (i, _, _, _), tok in zip(going, tokens):
                    out[i].append(tok)
        return out

    def _forward(
        self,
        rows: list[int],
        seq_lens: list[int],
        q_lens: list[int],
        token_ids: list[int],
        positions: list[int],
    ) -> list[int]:
        """One ragged forward of the draft; the argmax at each row's last position."""
        kv_cache = self.pool.bind_tasks(rows, seq_lens, q_lens)
        ends = torch.tensor(q_lens).cumsum(0) - 1
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        with engine_forward():
            logits = self.model.forward_packed(
                ids, pos, kv_cache, ends.to(self.device), max_position=max(positions)
            )
        return logits.argmax(-1).tolist()

    def verified(self, task: Task, proposed: int, accepted: int) -> None:
        """The target kept `accepted` of `proposed`: the proposals' KV up to the first
        rejected one (at most `proposed - 1` were fed) is valid."""
        state = self._states.get(task)
        if state is None or state.cached != state.at:
            return
        state.cached = state.at + max(0, min(accepted, proposed - 1, state.proposed - 1))

    def close(self) -> None:
        """Free every request's row (the engine stops)."""
        for task in list(self._states):
            self._drop(task)

    @property
    def kv_pools(self) -> tuple[PagePool, ...]:
        return (self.pool,)

    @property
    def rows_in_use(self) -> int:
        """Pool rows held by requests (0 once every request has finished, after `close`)."""
        return len(self._states)


__all__ = ["DraftModelProposer", "DraftState", "load_draft"]
