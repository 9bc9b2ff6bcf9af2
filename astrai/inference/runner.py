"""`ModelRunner`: executes a `StepPlan` - everything of a step that touches tensors.

It owns the decode workspace and the captured decode graphs, builds the `KVCache` of an
eager forward through the pool, runs the model, keeps each seeded request's generator, and
samples. A plan that is pure decode and fits a captured batch size replays a graph on the
fixed-address workspace; when the decoding rows are the same as last step, their input
tokens are last step's samples, copied device-to-device instead of through the host.
A plan with prompt log-prob rows runs eagerly through `Transformer.hidden_packed` and
scores them in slices (`astrai.inference.logprobs`); the sampling rows keep the cheap path.
With `batch_invariant` every forward runs inside `astrai.extension.batch_invariant` on the
torch_native attention backend (the one whose per-request path is batch-invariant).
A plan with rows of LoRA adapters runs eagerly with each token's adapter slot set for the
adapted projections (`astrai.inference.adapters`); captured graphs serve base-only steps.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import torch

from astrai.extension import BackendUnavailable, attn_backend, batch_invariant
from astrai.inference.adapters import NO_ADAPTER_SLOTS, AdapterSlots, NoAdapterSlots
from astrai.inference.cache import PagePool
from astrai.inference.constrain import GrammarRows
from astrai.inference.grammar import GrammarCompiler
from astrai.inference.graph import (
    CUDAGraphRunner,
    DecodeGraphRunner,
    StandInGraphRunner,
    capture_sizes,
)
from astrai.inference.isolation import IsolatedSample, sample_isolated
from astrai.inference.logprobs import PromptScores
from astrai.inference.sampling import SamplingBatchCache
from astrai.inference.scheduler import StepPlan
from astrai.inference.scoring import PromptTargets
from astrai.inference.speculative import NO_PROPOSER, Proposer
from astrai.inference.step_output import StepOutput
from astrai.inference.task import Task
from astrai.inference.verify import sample_step, with_drafts
from astrai.inference.workspace import InferenceWorkspace
from astrai.model import Transformer
from astrai.model.layers import engine_forward, mark_cache_resident
from astrai.model.packed import refresh_packs

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs step plans of one model over one KV pool.

    `decode_graphs`: None = CUDA graphs for decode on a CUDA model, True = CUDA graphs
    (a CUDA model is required), `"stand-in"` = the CPU stand-in (tests), False = eager.
    `logprob_chunk`: at most this many prompt positions go through `lm_head` at once.
    `grammar`: compiles the structured-output constraints of requests (None: none allowed).
    `batch_invariant`: forwards in batch-invariant mode (`astrai.inference.batch_invariance`).
    """

    def __init__(
        self,
        model: Transformer,
        pool: PagePool,
        *,
        max_batch_size: int,
        decode_graphs: bool | str | None = None,
        logprob_chunk: int = 512,
        grammar: GrammarCompiler | None = None,
        adapters: AdapterSlots | NoAdapterSlots = NO_ADAPTER_SLOTS,
        proposer: Proposer = NO_PROPOSER,
        batch_invariant: bool = False,
    ) -> None:
        if (
            isinstance(logprob_chunk, bool)
            or not isinstance(logprob_chunk, int)
            or logprob_chunk < 1
        ):
            raise ValueError(f"logprob_chunk must be a positive int, got {logprob_chunk!r}")
        self.logprob_chunk = logprob_chunk
        self.model = model
        # Tiny products of a model that fits in the CPU's cache skip oneDNN's call cost.
        mark_cache_resident(model)
        self.pool = pool
        self.device = pool.device
        self.workspace: InferenceWorkspace | None = None
        self.graph_runner: DecodeGraphRunner | None = None
        self.graph_batch = min(max_batch_size, pool.max_batch_size)
        with engine_forward():  # captured with the engine's packs
            self._build_graphs(decode_graphs, self.graph_batch)
        # Last step's samples on the device, while the decoding rows may feed them next.
        self._last_sampled: torch.Tensor | None = None
        # Seeded requests' generators, alive as long as their task: a request's draws stay
        # reproducible whatever else is in the batch.
        self._generators: weakref.WeakKeyDictionary[Task, torch.Generator] = (
            weakref.WeakKeyDictionary()
        )
        self._sampling = SamplingBatchCache()
        self.grammar_rows = GrammarRows(grammar)
        self.adapters = adapters
        # speculative decoding (astrai.inference.speculative)
        self.proposer = proposer
        self.batch_invariant = batch_invariant

    def _build_graphs(self, mode: bool | str | None, batch: int) -> None:
        """CUDA graphs for decode by default on CUDA; `"stand-in"` for CPU tests; False: eager."""
        if mode is None:
            mode = self.device.type == "cuda"
        if not mode:
            return
        cfg = self.model.config
        if cfg.attention_type == "mla":  # the decode workspace is laid out for K/V heads
            logger.warning("decode graphs disabled: MLA decodes eagerly in the latent space")
            return
        if cfg.sliding_window is not None:  # the window's branch depends on the step's length
            logger.warning("decode graphs disabled: sliding-window attention decodes eagerly")
            return
        if cfg.attention_sinks:  # plain torch per request (astrai.extension.backend.sinks)
            logger.warning("decode graphs disabled: attention sinks decode eagerly")
            return
        if (cfg.rope_scaling or {}).get("rope_type") == "dynamic":
            logger.warning("decode graphs disabled: dynamic RoPE depends on the step's length")
            return
        workspace = InferenceWorkspace(
            self.pool,
            max_batch_size=batch,
            n_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            dtype=next(self.model.parameters()).dtype,
        )
        sizes = capture_sizes(batch)
        if mode == "stand-in":
            runner: DecodeGraphRunner = StandInGraphRunner(self.model, workspace, sizes)
        elif self.device.type != "cuda":
            raise ValueError(f"decode_graphs=True needs a CUDA model, got {self.device}")
        else:
            try:
                runner = CUDAGraphRunner(self.model, workspace, sizes)
            except Exception as err:  # fall back to eager decode, loudly
                logger.warning("CUDA graph capture failed, decoding eagerly: %s", err)
                return
        self.workspace, self.graph_runner = workspace, runner

    @property
    def cuda_graph_enabled(self) -> bool:
        return isinstance(self.graph_runner, CUDAGraphRunner)

    def release_graphs(self) -> bool:
        """Drop the captured CUDA graphs (and their memory pool) before the engine's sleep
        frees the KV buffers and packs whose addresses they hold; True if there were any
        (`capture_graphs` then captures them again). The CPU stand-in reads the buffers
        through the pool, so it stays."""
        self._last_sampled = None
        if not self.cuda_graph_enabled:
            return False
        self.graph_runner = self.workspace = None
        return True

    def capture_graphs(self) -> None:
        """Capture the decode graphs again, over the buffers at their current addresses."""
        self._build_graphs(True, self.graph_batch)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        """Forward `plan` under its attention backend and sample what its samplers emit.

        Per sampler (`plan.samplers`), the tokens it emits this step (one for plain decode;
        with proposals, the accepted ones and one more: `astrai.inference.verify`) and their
        log-probs (each request's `logprobs_mode`), with the prompt log-probs and top
        alternatives rows asked for. A request whose own sampling fails (a logits processor,
        its seed) is reported in `faults`, the others are sampled as usual; an exception
        raised here is the forward's.
        """
        previous, self._last_sampled = self._last_sampled, None
        drafts = self._proposals(plan)
        with attn_backend(self._backend(plan)), batch_invariant(self.batch_invariant):
            if drafts:
                return self._speculate(plan, drafts)
            logits, graphed, prompt = self._forward(plan, previous)
            if not plan.samplers:
                return StepOutput(prompt_logprobs=prompt)
            out, drawn = sample_step(logits, plan.samplers, self._sample, self.grammar_rows)
        if graphed and not out.faults:
            self._last_sampled = drawn.device_tokens
        out.prompt_logprobs = prompt
        return out

    def _backend(self, plan: StepPlan) -> str | None:
        """The plan's attention backend; in batch-invariant mode torch_native, whose
        per-request path is the invariant one (a request that chose another is refused)."""
        if not self.batch_invariant:
            return plan.backend
        if plan.backend not in (None, "torch_native"):
            raise BackendUnavailable(
                f"batch_invariant=true runs attention on torch_native only; these requests "
                f"selected {plan.backend!r}"
            )
        return "torch_native"

    def _sample(
        self, rows: torch.Tensor, tasks: Sequence[Task], generated: Sequence[Sequence[int]] | None
    ) -> IsolatedSample:
        return sample_isolated(rows, tasks, self._sampling, self._generator, generated)

    def _proposals(self, plan: StepPlan) -> dict[int, list[int]]:
        """Each speculating row's proposals (`{plan row: tokens}`; empty: a plain step).
        Plans that score prompts never speculate (their logits follow the plan's layout)."""
        if not any(plan.draft_budgets):  # speculation off (`NoProposer`) or backing off
            return {}
        if PromptTargets.of(plan) is not None:
            return {}
        rows = [i for i, k in enumerate(plan.draft_budgets) if k > 0]
        budgets = [plan.draft_budgets[i] for i in rows]
        proposals = self.proposer.propose([plan.tasks[i] for i in rows], budgets)
        return {i: p[:k] for i, k, p in zip(rows, budgets, proposals) if p}

    def _speculate(self, plan: StepPlan, drafts: dict[int, list[int]]) -> StepOutput:
        """Feed each speculating row's proposals after its newest token, then verify them."""
        spec = with_drafts(plan, drafts)
        ends = torch.tensor(spec.q_lens).cumsum(0).tolist()
        idx, first, rows_drafts = [], [], []
        for row in plan.sample_rows:
            d = drafts.get(row, [])
            first.append(len(idx))
            rows_drafts.append(d)
            idx.extend(range(ends[row] - 1 - len(d), ends[row]))
        logits, _, _ = self._forward(spec, None, torch.tensor(idx, device=self.device))
        out, _ = sample_step(
            logits, plan.samplers, self._sample, self.grammar_rows, rows_drafts, first
        )
        for s, task in enumerate(plan.samplers):
            if out.proposed[s]:
                self.proposer.verified(task, out.proposed[s], out.accepted(s))
        return out

    def _forward(
        self, plan: StepPlan, previous: torch.Tensor | None, logits_idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, bool, list[PromptScores] | None]:
        """Logits `[len(plan.samplers), vocab]`, whether a captured graph produced them, and
        the prompt log-probs of the plan (None when no row asks); the model runs with the
        engine's packs (`engine_forward`)."""
        with engine_forward():
            return self._model_forward(plan, previous, logits_idx)

    def _model_forward(
        self, plan: StepPlan, previous: torch.Tensor | None, logits_idx: torch.Tensor | None
    ) -> tuple[torch.Tensor, bool, list[PromptScores] | None]:
        graphs = self.graph_runner
        padded = None
        adapted = self.adapters.active(plan.tasks)
        if graphs is not None and plan.decode_only and not adapted and logits_idx is None:
            padded = graphs.padded_size(len(plan.rows))
        if padded is not None:  # pure decode: replay a captured graph on the workspace
            refresh_packs(self.model)  # a replay runs no Python to check them itself
            ws = self.workspace
            same = previous is not None and ws.last_rows == tuple(plan.rows)
            ws.prepare(
                plan.rows,
                plan.seq_lens,
                None if same else plan.token_ids,
                padded,
                device_tokens=previous if same else None,
            )
            return graphs.run(padded, len(plan.rows)), True, None
        if self.workspace is not None:
            self.workspace.last_rows = None
        if not adapted:
            return self._eager(plan, logits_idx)
        with self.adapters.applied(plan.tasks, plan.q_lens):
            return self._eager(plan, logits_idx)

    def _eager(
        self, plan: StepPlan, logits_idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, bool, list[PromptScores] | None]:
        """An eager forward of `plan`: logits of its sampling rows (or of `logits_idx`)."""
        kv_cache = self.pool.bind_tasks(plan.rows, plan.seq_lens, plan.q_lens)
        ends = torch.tensor(plan.q_lens).cumsum(0) - 1
        ids = torch.tensor(plan.token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(plan.positions, dtype=torch.int64, device=self.device)
        if logits_idx is None:
            logits_idx = ends[plan.sample_rows].to(self.device)
        model, max_position = self.model, max(plan.positions)
        targets = PromptTargets.of(plan)
        if targets is None:  # the cheap path: logits of the sampling rows only
            logits = model.forward_packed(ids, pos, kv_cache, logits_idx, max_position=max_position)
            return logits, False, None
        hidden = model.hidden_packed(ids, pos, kv_cache, max_position=max_position)
        prompt = targets.score(hidden, model.lm_head, self.logprob_chunk)
        return model.lm_head(hidden[logits_idx]), False, prompt

    def _generator(self, task: Task) -> torch.Generator | None:
        """The request's own generator (seeded requests), created at its first draw."""
        if task.params.seed is None:
            return None
        gen = self._generators.get(task)
        if gen is None:
            gen = task.params.make_generator(self.device)
            self._generators[task] = gen
        return gen
