"""Batched next-token sampling with per-request parameters (`params.SamplingParams`).

One step samples a `[B, V]` block of logits whose rows belong to different requests, each
with its own temperature, top-k/top-p/min-p, penalties, logit bias and seed. Order of work
(OpenAI semantics; the specification fixes penalties and bias before temperature):

    raw logits -> presence/frequency penalties -> logit_bias
               -> Temperature -> Top-K -> Top-P -> Min-P -> softmax -> draw

The draw is a multinomial draw done as an exponential race, `argmax(p / E)` with
`E ~ Exp(1)` i.i.d. per token: the same distribution as `torch.multinomial`, without its
device sync, and with noise that can come per row from that request's own generator. A
seeded row therefore picks the same tokens for the same logits whatever else is in the batch.
Temperature 0 is greedy: the row keeps only its argmax, so no noise can change its choice.

Each row reports the log-prob of its token under the distribution its `logprobs_mode` names
(vLLM's names where they exist): `raw` = the model's own distribution (default; scoring),
`scaled` = after penalties, bias and temperature but before any truncation (what a trainer's
forward at that temperature computes: GRPO's ratio), `processed` = the distribution actually
sampled from (after top-k/top-p/min-p too). Greedy rows count as temperature 1 in `scaled` and
`processed` (vLLM's convention; their sampled distribution is a point mass).
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from numbers import Real
from typing import NamedTuple

import torch

from astrai.inference.params import LOGPROBS_MODES, SamplingParams

logger = logging.getLogger(__name__)

RowValues = float | Sequence[float] | torch.Tensor


# ---------------------------------------------------------------------- layout
@dataclass(eq=False)
class SamplingBatch:
    """The parameters of one step's rows as device tensors, built once per batch.

    Host-side flags let the pipeline skip stages no row uses (the top-p sort is the costly
    one), without reading anything back from the device.
    """

    params: tuple[SamplingParams, ...]
    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    bias_rows: torch.Tensor | None  # [N] int64: logit_bias entries, flattened over rows
    bias_tokens: torch.Tensor | None  # [N] int64
    bias_values: torch.Tensor | None  # [N] float32
    max_top_k: int
    max_bias_token: int
    penalized_rows: tuple[int, ...]
    all_greedy: bool
    any_greedy: bool
    any_top_p: bool
    any_min_p: bool
    # [B] int64 index into LOGPROBS_MODES; None when every row wants raw log-probs
    logprobs_mode: torch.Tensor | None = None
    any_scaled: bool = False
    any_processed: bool = False

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
    ) -> SamplingBatch:
        """Lay out validated params as tensors (one host->device copy per dtype)."""
        params = tuple(params)
        if not params:
            raise ValueError("params: need at least one row")
        floats = torch.tensor(
            [
                [p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty]
                for p in params
            ],
            dtype=torch.float32,
        ).to(device)
        top_k = [max(p.top_k, 0) for p in params]
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        if bias:
            rows, tokens, values = zip(*bias)
            bias_rows = torch.tensor(rows, dtype=torch.int64).to(device)
            bias_tokens = torch.tensor(tokens, dtype=torch.int64).to(device)
            bias_values = torch.tensor(values, dtype=torch.float32).to(device)
        else:
            bias_rows = bias_tokens = bias_values = None
        greedy = [p.greedy for p in params]
        modes = [LOGPROBS_MODES.index(p.logprobs_mode) for p in params]
        return cls(
            params=params,
            temperature=floats[:, 0],
            top_k=torch.tensor(top_k, dtype=torch.int64).to(device),
            top_p=floats[:, 1],
            min_p=floats[:, 2],
            presence_penalty=floats[:, 3],
            frequency_penalty=floats[:, 4],
            bias_rows=bias_rows,
            bias_tokens=bias_tokens,
            bias_values=bias_values,
            max_top_k=max(top_k),
            max_bias_token=max((t for _, t, _ in bias), default=-1),
            penalized_rows=tuple(
                i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty
            ),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_p=any(p.top_p < 1.0 and not p.greedy for p in params),
            any_min_p=any(p.min_p > 0.0 and not p.greedy for p in params),
            logprobs_mode=torch.tensor(modes, dtype=torch.int64).to(device) if any(modes) else None,
            any_scaled=any(p.logprobs_mode == "scaled" for p in params),
            any_processed=any(p.logprobs_mode == "processed" for p in params),
        )

    @property
    def size(self) -> int:
        return len(self.params)

    @cached_property
    def pipeline(self) -> SamplingPipeline:
        """The stages this batch needs, in the canonical order."""
        stages: list[BaseSamplingStrategy] = [
            TemperatureStrategy(self.temperature, any_greedy=self.any_greedy)
        ]
        if self.max_top_k > 0:
            stages.append(TopKStrategy(self.top_k, max_k=self.max_top_k))
        if self.any_top_p:
            stages.append(TopPStrategy(self.top_p))
        if self.any_min_p:
            stages.append(MinPStrategy(self.min_p))
        return SamplingPipeline(stages)


class SamplingBatchCache:
    """Reuses the last `SamplingBatch` while the step's rows are the same params objects.

    Decode steps usually repeat the previous batch, so this makes the layout free. Identity
    is a sound key because `SamplingParams` is frozen and the cache holds the objects alive.
    """

    def __init__(self) -> None:
        self._batch: SamplingBatch | None = None
        self._device: torch.device | None = None

    def get(
        self, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
    ) -> SamplingBatch:
        device = torch.device(device)
        cached = self._batch
        if (
            cached is not None
            and self._device == device
            and len(cached.params) == len(params)
            and all(a is b for a, b in zip(cached.params, params))
        ):
            return cached
        self._batch, self._device = SamplingBatch.from_params(params, device), device
        return self._batch


# ---------------------------------------------------------------------- strategies
def _per_row(values: RowValues, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` (scalar, list or tensor) as a `[B, 1]` column on the logits' device."""
    batch = logits.shape[0]
    if isinstance(values, torch.Tensor):
        col = values.to(device=logits.device, dtype=dtype)
    elif isinstance(values, Real):
        col = torch.full((batch,), values, dtype=dtype, device=logits.device)
    else:
        col = torch.tensor(list(values), dtype=dtype, device=logits.device)
    if col.shape != (batch,):
        raise ValueError(
            f"per-row parameter has shape {tuple(col.shape)}, logits have {batch} rows"
        )
    return col[:, None]


class BaseSamplingStrategy(ABC):
    """One logits transform of the pipeline: `[B, V]` logits in, `[B, V]` logits out, with
    filtered tokens set to -inf."""

    @abstractmethod
    def __call__(self, logits: torch.Tensor) -> torch.Tensor: ...


class TemperatureStrategy(BaseSamplingStrategy):
    """logits / T per row. A T = 0 row keeps only its argmax (greedy: a point mass, so the
    later stages and the draw cannot change its choice)."""

    def __init__(self, temperature: RowValues, *, any_greedy: bool | None = None) -> None:
        self.temperature = temperature
        # Without the hint, a tensor may hold zeros; handled with torch.where (no sync).
        if any_greedy is None:
            any_greedy = isinstance(temperature, torch.Tensor) or (
                temperature == 0 if isinstance(temperature, Real) else 0 in list(temperature)
            )
        self.any_greedy = any_greedy

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        t = _per_row(self.temperature, logits, logits.dtype)
        if not self.any_greedy:
            return logits / t
        greedy = t == 0
        scaled = logits / torch.where(greedy, 1.0, t)
        top = torch.zeros_like(logits, dtype=torch.bool)
        top.scatter_(1, logits.argmax(-1, keepdim=True), True)
        return scaled.masked_fill(greedy & ~top, float("-inf"))


class TopKStrategy(BaseSamplingStrategy):
    """Keep each row's k highest logits (k <= 0: keep all). Ties at the k-th value are kept."""

    def __init__(
        self, top_k: int | Sequence[int] | torch.Tensor, *, max_k: int | None = None
    ) -> None:
        self.top_k = top_k
        if max_k is None:  # a tensor without the hint costs one device read here
            if isinstance(top_k, torch.Tensor):
                max_k = int(top_k.max())
            else:
                max_k = top_k if isinstance(top_k, int) else max(top_k, default=0)
        self.max_k = max(int(max_k), 0)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.max_k == 0:
            return logits
        k_max = min(self.max_k, logits.shape[-1])
        k = _per_row(self.top_k, logits, torch.int64)
        top = logits.topk(k_max, dim=-1).values  # [B, k_max], descending
        kth = top.gather(1, (k.clamp(1, k_max) - 1))
        kth = kth.masked_fill(k <= 0, float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))


class TopPStrategy(BaseSamplingStrategy):
    """Keep each row's minimal nucleus: the most likely tokens whose mass first reaches p
    (a token is kept while the mass strictly before it is below p). p >= 1 keeps all."""

    def __init__(self, top_p: RowValues) -> None:
        self.top_p = top_p

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        p = _per_row(self.top_p, logits, torch.float32)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.float().softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = (mass_before >= p) & (p < 1.0)
        drop_sorted[:, 0] = False
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
        return logits.masked_fill(drop, float("-inf"))


class MinPStrategy(BaseSamplingStrategy):
    """Drop tokens whose probability is below min_p times the row's top probability."""

    def __init__(self, min_p: RowValues) -> None:
        self.min_p = min_p

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        m = _per_row(self.min_p, logits, torch.float32)
        probs = logits.float().softmax(-1)
        floor = probs.amax(-1, keepdim=True) * m
        return logits.masked_fill(probs < floor, float("-inf"))


class SamplingPipeline(BaseSamplingStrategy):
    """Composition of strategies (canonically Temperature -> Top-K -> Top-P -> Min-P);
    `__call__` gives the processed logits, `draw` the softmax + multinomial draw."""

    def __init__(self, strategies: Sequence[BaseSamplingStrategy]) -> None:
        self.strategies = tuple(strategies)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        for strategy in self.strategies:
            logits = strategy(logits)
        return logits

    def draw(
        self,
        logits: torch.Tensor,
        *,
        generator: torch.Generator | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, log-prob of each under the processed distribution) for raw `logits`.

        `generators[i]`, where given, supplies row i's noise (advanced by one row of draws);
        other rows use `generator` (None: torch's default generator of the device).
        """
        probs = self(logits.float()).softmax(-1)
        noise = _exponential_noise(probs, generator, generators)
        ids = (probs / noise).argmax(-1)
        return ids, probs.gather(1, ids[:, None]).squeeze(1).log()


def _exponential_noise(
    probs: torch.Tensor,
    generator: torch.Generator | None,
    generators: Sequence[torch.Generator | None] | None,
) -> torch.Tensor:
    own = list(generators or ())
    if not any(gen is not None for gen in own):
        return (
            torch.empty_like(probs)
            .exponential_(generator=generator)
            .clamp_min_(torch.finfo(probs.dtype).tiny)
        )
    noise = torch.empty_like(probs)
    shared = [i for i in range(probs.shape[0]) if i >= len(own) or own[i] is None]
    if shared:  # only the rows without a stream of their own draw from `generator`: a
        # seeded batch leaves torch's default generator (the trainer's dropout) untouched
        rows = torch.empty(len(shared), probs.shape[1], dtype=probs.dtype, device=probs.device)
        noise[shared] = rows.exponential_(generator=generator)
    seeded = [i for i, gen in enumerate(own) if gen is not None]
    if seeded and _cpu_rows_from_uniform(probs, [own[i] for i in seeded]):
        noise[seeded] = _exponential_rows([own[i] for i in seeded], probs.shape[1])
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    for i in seeded:  # drawn alone so the row's stream ignores its batch companions
        gen = own[i]
        row = torch.empty(probs.shape[1], dtype=probs.dtype, device=gen.device)
        noise[i] = row.exponential_(generator=gen).to(probs.device)
    # Exp(1) can round to 0; p / 0 would be inf (or nan for a filtered token).
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _exponential_rows(generators: Sequence[torch.Generator], width: int) -> torch.Tensor:
    """``[len(generators), width]`` fp32 Exp(1) draws, row ``i`` from ``generators[i]``: the
    very values ``exponential_`` gives (torch's CPU kernel draws a uniform double ``u`` and
    returns ``-log1p(-u)`` rounded to fp32), with each row's uniforms drawn alone and the
    logarithm taken once for the whole block: the logarithm, a scalar loop inside
    ``exponential_``, was most of a seeded sampling step (6 of 7 ms for 128 x 2048 rows)."""
    u = torch.empty(len(generators), width, dtype=torch.float64)
    for row, gen in zip(u, generators):
        row.uniform_(generator=gen)
    return u.neg_().log1p_().neg_().to(torch.float32)


_UNIFORM_EXPONENTIAL: bool | None = None


def _cpu_rows_from_uniform(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> bool:
    """Whether :func:`_exponential_rows` serves these rows: fp32 on the CPU, and this torch's
    ``exponential_`` found (once, on a sample) to be that transform of its uniforms, bit for
    bit; otherwise each row keeps its own ``exponential_``."""
    global _UNIFORM_EXPONENTIAL
    if probs.dtype != torch.float32 or probs.device.type != "cpu":
        return False
    if any(gen.device.type != "cpu" for gen in generators):
        return False
    if _UNIFORM_EXPONENTIAL is None:
        seeds = (0, 1, 12345)
        expected = [
            torch.empty(4099).exponential_(generator=torch.Generator().manual_seed(seed))
            for seed in seeds
        ]
        got = _exponential_rows([torch.Generator().manual_seed(seed) for seed in seeds], 4099)
        _UNIFORM_EXPONENTIAL = all(torch.equal(e, g) for e, g in zip(expected, got))
    return _UNIFORM_EXPONENTIAL


# ---------------------------------------------------------------------- penalties and bias
def token_counts_from(
    generated: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str = "cpu",
    rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """`[B, V]` float32 counts of each row's generated tokens (only `rows`, if given)."""
    counts = torch.zeros(len(generated), vocab_size, dtype=torch.float32, device=device)
    rows = range(len(generated)) if rows is None else rows
    lengths = [len(generated[i]) for i in rows]
    if sum(lengths):
        row_idx = torch.repeat_interleave(torch.tensor(list(rows)), torch.tensor(lengths))
        tokens = torch.tensor(list(itertools.chain.from_iterable(generated[i] for i in rows)))
        index = (row_idx.to(device), tokens.to(device=device, dtype=torch.int64))
        counts.index_put_(index, torch.ones((), device=device), accumulate=True)
    return counts


def apply_penalties(
    logits: torch.Tensor,
    batch: SamplingBatch,
    *,
    generated: Sequence[Sequence[int]] | None = None,
    token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """OpenAI penalties in place: logit -= presence * (count > 0) + frequency * count, where
    count is how often the row's request has generated the token so far."""
    if not batch.penalized_rows:
        return logits
    if token_counts is None:
        if generated is None:
            raise ValueError("penalties need the generated tokens: pass generated or token_counts")
        if len(generated) != batch.size:
            raise ValueError(f"generated has {len(generated)} rows, the batch {batch.size}")
        token_counts = token_counts_from(
            generated, logits.shape[-1], logits.device, rows=batch.penalized_rows
        )
    counts = token_counts.to(device=logits.device, dtype=logits.dtype)
    logits -= (
        batch.presence_penalty[:, None] * (counts > 0) + batch.frequency_penalty[:, None] * counts
    )
    return logits


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Add each row's logit_bias in place."""
    if batch.bias_rows is None:
        return logits
    if batch.max_bias_token >= logits.shape[-1]:
        raise ValueError(
            f"logit_bias token id {batch.max_bias_token} is outside the vocabulary "
            f"(size {logits.shape[-1]})"
        )
    logits.index_put_((batch.bias_rows, batch.bias_tokens), batch.bias_values, accumulate=True)
    return logits


# ---------------------------------------------------------------------- entry points
class SampleOutput(NamedTuple):
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: log_softmax(raw logits)[token]
    processed_logprobs: torch.Tensor  # [B] float32: log-prob under the sampled distribution
    # [B] float32: log_softmax(adjusted logits / temperature)[token]; None unless a row asks
    scaled_logprobs: torch.Tensor | None = None

    def selected(self, batch: SamplingBatch) -> torch.Tensor:
        """Each row's log-prob in the mode its params ask for (`logprobs_mode`)."""
        if batch.logprobs_mode is None:
            return self.logprobs
        out = self.logprobs
        if batch.any_processed:
            mode = LOGPROBS_MODES.index("processed")
            out = torch.where(batch.logprobs_mode == mode, self.processed_logprobs, out)
        if batch.any_scaled and self.scaled_logprobs is not None:
            mode = LOGPROBS_MODES.index("scaled")
            out = torch.where(batch.logprobs_mode == mode, self.scaled_logprobs, out)
        return out


def _logprob_at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _as_batch(
    params: SamplingParams | Sequence[SamplingParams] | SamplingBatch, logits: torch.Tensor
) -> SamplingBatch:
    if isinstance(params, SamplingBatch):
        batch = params
    elif isinstance(params, SamplingParams):
        batch = SamplingBatch.from_params([params] * logits.shape[0], logits.device)
    else:
        batch = SamplingBatch.from_params(params, logits.device)
    if batch.size != logits.shape[0]:
        raise ValueError(f"{batch.size} sampling params for {logits.shape[0]} logits rows")
    return batch


def sample(
    logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams] | SamplingBatch,
    *,
    generated: Sequence[Sequence[int]] | None = None,
    token_counts: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    generator: torch.Generator | None = None,
) -> SampleOutput:
    """Sample one token per row of `logits` `[B, V]`.

    params: one SamplingParams for all rows, one per row, or a prebuilt SamplingBatch.
    generated / token_counts: tokens each row's request generated so far (for penalties).
    generators: per-row generators of seeded requests, kept across steps (see
    `SamplingParams.make_generator`); a seeded row without one gets a fresh generator from
    its seed, reproducible for this call only. generator: noise for the unseeded rows.

    Returns the token ids, `logprobs` = log_softmax of the *raw* logits (before penalties,
    bias and temperature: the model's own distribution, which scoring needs) at those ids,
    `processed_logprobs` = log-prob under the distribution actually sampled from, and, when a
    row's `logprobs_mode` is `scaled`, `scaled_logprobs` = log_softmax of the logits after
    penalties, bias and temperature, without truncation (an RL trainer's forward at that
    temperature). Greedy rows count as temperature 1 in both (vLLM's convention).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch = _as_batch(params, logits)
    if generators is not None and len(generators) != batch.size:
        raise ValueError(f"generators has {len(generators)} entries, the batch {batch.size}")
    x = logits.to(torch.float32, copy=True)
    raw_logsumexp = torch.logsumexp(x, dim=-1)
    apply_penalties(x, batch, generated=generated, token_counts=token_counts)
    apply_logit_bias(x, batch)
    if batch.all_greedy:
        ids = x.argmax(-1)
    else:
        row_gens = list(generators) if generators is not None else [None] * batch.size
        for i, p in enumerate(batch.params):
            if p.seed is not None and row_gens[i] is None and not p.greedy:
                row_gens[i] = p.make_generator(x.device)
        ids, drawn = batch.pipeline.draw(x, generator=generator, generators=row_gens)
    raw = logits.gather(1, ids[:, None]).squeeze(1).float() - raw_logsumexp
    adjusted = bool(batch.penalized_rows) or batch.bias_rows is not None
    if batch.any_greedy:  # greedy rows: the temperature-1 distribution after penalties and bias
        at_t1 = _logprob_at(x, ids) if adjusted else raw
        processed = at_t1 if batch.all_greedy else torch.where(batch.temperature == 0, at_t1, drawn)
    else:
        processed = drawn
    scaled = None
    if batch.any_scaled:
        t = torch.where(batch.temperature == 0, 1.0, batch.temperature)[:, None]
        scaled = _logprob_at(x / t, ids)
    return SampleOutput(ids, raw, processed, scaled)


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams] | SamplingBatch,
    *,
    generated: Sequence[Sequence[int]] | None = None,
    token_counts: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample(...)` for the scheduler's step: (token ids, each row's log-probs in the mode
    its `logprobs_mode` asks for)."""
    batch = _as_batch(params, logits)
    out = sample(
        logits,
        batch,
        generated=generated,
        token_counts=token_counts,
        generators=generators,
        generator=generator,
    )
    return out.token_ids, out.selected(batch)
