"""The per-device memory plan of a training run: bytes for weights, gradients, optimizer
state, the frozen reference, the rollout engine (its weights, packed copies and KV pool),
peak activations, and a second model where the strategy has one (PPO's trained critic,
distillation's frozen teacher), computed from the shapes alone before anything loads.

`python -m astrai.train` logs it as one table before the tokenizer, the data or the model
(`runner.train`); `plan_only=true` logs it and stops, on any machine, before the run folder
exists (`preflight.PreflightCallback`); `python -m astrai.train.plan_table` prints the
docs/scaling.md table of which size fits where. A plan over the device's memory
(`device_memory_gib`, else CUDA's own) is a warning with the numbers, never a refusal: it is
an estimate (docs/scaling.md, "Which size fits where", says what each row counts).

Three phases, each a sum of what is alive then; the peak is the largest. PPO's critic (a
value head on its own trained backbone, a parameter group of the one optimizer) is counted as
the policy is: its weights and optimizer state always, its gradients in update and step, its
forward's activations (and autocast's casts of its weights) in update. Distillation's teacher
(frozen, loaded whole on every rank: no optimizer, never sharded) is alive always.
- rollout: weights, optimizer state, reference, the engine's weights, packs and KV pool, and
  its decode workspace (gradients are freed after each step: `zero_grad(set_to_none=True)`);
- update (forward and backward of one micro-batch): weights, gradients, optimizer state,
  reference, the engine (its KV pool and packs released while it sleeps: with
  `engine.enable_sleep_mode` GRPO puts it to sleep after each rollout, TRL's
  `vllm_enable_sleep_mode` window), compute copies of the weights, activations of one forward (the
  micro-batch, or one packed row of `ppo_max_token_len_per_gpu` tokens with GRPO's
  `use_dynamic_bsz`) and the LM head's logits (dense `[tokens, vocab]`, or one chunk of
  `strategy.logits_chunk_size` tokens);
- step (the optimizer): weights, gradients, optimizer state and its temporaries, reference,
  the engine (asleep likewise: `LMModule.on_before_optimizer_step` puts it to sleep until
  its next use).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from astrai.model.config import ModelConfig
from astrai.model.mla_config import mla_latent_dim

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_LOGITS_CHUNK",
    "GIB",
    "EngineShape",
    "Layout",
    "MemoryPlan",
    "Workload",
    "plan_memory",
    "value_model_params",
]

GIB = 2**30
#: `strategy.logits_chunk_size` when the config does not name it (the chunked path's default)
DEFAULT_LOGITS_CHUNK = 1024
#: fp32 `[tokens, vocab]` tensors the LM head's loss holds at once: the logits, their
#: log-softmax (saved for backward) and its gradient. A lower bound: the dense path measured
#: 2.9x (SFT) and 4.6x (GRPO, its entropy metric included) before #46 (docs/scaling.md).
LOGITS_COPIES = 3
#: a GPU's CUDA context, NCCL buffers and allocator slack: a round allowance, not measured here
GPU_RUNTIME = 2 * GIB


@dataclass(frozen=True)
class Layout:
    """How the weights are laid out over the devices, and in which dtypes (bytes per value).

    `fully_sharded`: FSDP2 (weights, gradients, optimizer state and the reference split over
    `world_size` ranks, data-parallel x tensor-parallel); False: each rank holds a whole
    replica (one process, DDP). `master_bytes`: the parameters (and gradients, AdamW's moments:
    torch keeps them in the parameter's dtype; under `*-mixed` precision the fp32 parameters
    are the master weights, there is no second copy). `compute_bytes`: the matmuls' dtype.
    `shard_bytes`: FSDP2's `param_dtype` (what it all-gathers and computes in; None: the
    master dtype). `mixed`: autocast (`bf16-mixed`, `16-mixed`)."""

    world_size: int = 1
    tensor_parallel: int = 1
    fully_sharded: bool = False
    reshard_after_forward: bool = True
    master_bytes: int = 4
    compute_bytes: int = 4
    shard_bytes: int | None = None
    mixed: bool = False
    gpu: bool = False

    @property
    def shards(self) -> int:
        """Ranks that split each weight (1: a whole replica per rank)."""
        return self.world_size if self.fully_sharded else self.tensor_parallel

    @property
    def residual_bytes(self) -> int:
        """The residual stream's dtype: the weights' as computed with (embedding output)."""
        return self.shard_bytes if self.fully_sharded and self.shard_bytes else self.master_bytes

    @property
    def engine_bytes(self) -> int:
        """The rollout engine's dtype (its weights, packs and KV pool): the live parameters' it
        shares (one replica), or, under FSDP2, that of the full copy gathered for it, which is
        allocated in the shards' dtype (`astrai.train.engine_weights.plain_copy`): the master
        dtype, whatever `param_dtype` computes in."""
        return self.master_bytes


@dataclass(frozen=True)
class EngineShape:
    """The rollout engine's sizes (conf/engine): KV slots in tokens, decode rows, prefill chunk."""

    kv_tokens: int
    max_batch_size: int = 32
    max_prefill_tokens: int = 2048
    logprob_chunk: int = 512
    packed_projections: bool = True
    sleep: bool = False


@dataclass(frozen=True)
class Workload:
    """What one optimizer step runs: tokens of one micro-batch (rows x padded length) and of
    one forward (`forward_tokens`, None: the micro-batch at once), the LM head's chunk (None:
    dense), checkpointing, the optimizer's state per parameter (AdamW 2,
    SGD with momentum 1; Muon: `optimizer_states` on the hidden matrices, 2 on the rest), its
    fused kernel (no temporaries), the reference's bytes per value (None: no reference), the
    engine (None: no rollouts), PPO's critic (the backbone it copies or loads; None: no
    critic) and distillation's teacher with its bytes per value (None: no teacher model)."""

    micro_batch_tokens: int
    forward_tokens: int | None = None
    logits_chunk_size: int | None = DEFAULT_LOGITS_CHUNK
    gradient_checkpointing: bool = False
    optimizer: str = "AdamW"
    optimizer_states: float = 2.0
    hidden_optimizer_states: float | None = None
    fused_optimizer: bool = False
    reference_bytes: int | None = None
    engine: EngineShape | None = None
    critic: ModelConfig | None = None
    teacher: ModelConfig | None = None
    teacher_bytes: int = 4


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device, one field per row of the table (see the module docstring)."""

    weights: int
    gradients: int
    optimizer: int
    optimizer_temporaries: int
    reference: int
    engine_weights: int
    engine_packs: int
    kv_pool: int
    rollout_workspace: int
    compute_weights: int
    activations: int
    logits: int
    runtime: int
    critic_weights: int = 0
    critic_gradients: int = 0
    critic_optimizer: int = 0
    critic_activations: int = 0
    teacher: int = 0
    # what the table's header says
    model: str = ""
    layout: Layout = Layout()
    workload: Workload | None = None
    sleep: bool = False

    @property
    def sleeping(self) -> int:
        """What the engine releases while it sleeps (KV pool and packed copies)."""
        return self.kv_pool + self.engine_packs

    def _awake(self) -> int:
        return 0 if self.sleep else self.sleeping

    @property
    def critic(self) -> int:
        """PPO's critic as trained: its weights, gradients and optimizer state."""
        return self.critic_weights + self.critic_gradients + self.critic_optimizer

    def _held(self) -> int:
        """What every phase holds apart from the engine: the weights, the optimizer state,
        the frozen reference and teacher, the critic's weights and state, the runtime."""
        return (
            self.weights
            + self.optimizer
            + self.reference
            + self.teacher
            + self.critic_weights
            + self.critic_optimizer
            + self.runtime
        )

    @property
    def rollout(self) -> int:
        return self._held() + self.engine_weights + self.sleeping + self.rollout_workspace

    @property
    def update(self) -> int:
        return (
            self._held()
            + self.gradients
            + self.critic_gradients
            + self.engine_weights
            + self._awake()
            + self.compute_weights
            + self.activations
            + self.critic_activations
            + self.logits
        )

    @property
    def step(self) -> int:
        return (
            self._held()
            + self.gradients
            + self.critic_gradients
            + self.optimizer_temporaries
            + self.engine_weights
            + self._awake()
        )

    @property
    def peak(self) -> int:
        return max(self.rollout, self.update, self.step)

    def fits(self, capacity: int) -> bool:
        return self.peak <= capacity

    def rows(self) -> list[tuple[str, int, str]]:
        """(what, bytes, when) for each non-zero row, in the table's order."""
        lay, work = self.layout, self.workload
        split = f", 1/{lay.shards}" if lay.shards > 1 else ""
        engine_when = "rollout" if self.sleep else "always"
        states = work.optimizer if work else "optimizer"
        out = [
            (f"weights ({_dtype(lay.master_bytes)}{split})", self.weights, "always"),
            (f"gradients ({_dtype(lay.master_bytes)}{split})", self.gradients, "update, step"),
            (f"optimizer state ({states}{split})", self.optimizer, "always"),
            ("optimizer temporaries (foreach)", self.optimizer_temporaries, "step"),
            (f"reference{split}", self.reference, "always"),
            (
                f"critic: weights, gradients, optimizer state ({_dtype(lay.master_bytes)}{split})",
                self.critic,
                "always (its gradients: update, step)",
            ),
            ("critic activations (one forward)", self.critic_activations, "update"),
            (
                f"teacher ({_dtype(work.teacher_bytes if work else 4)}, frozen)",
                self.teacher,
                "always",
            ),
            ("engine weights (full copy)", self.engine_weights, "always"),
            ("engine packed projections", self.engine_packs, engine_when),
            ("engine KV pool", self.kv_pool, engine_when),
            ("engine decode workspace", self.rollout_workspace, "rollout"),
            ("compute copies of the weights", self.compute_weights, "update"),
            ("activations (one forward)", self.activations, "update"),
            ("LM head logits", self.logits, "update"),
            ("GPU runtime allowance", self.runtime, "always"),
        ]
        return [row for row in out if row[1]]

    def table(self, capacity: int | None = None) -> str:
        """The plan as one text table (GiB per device), with the phases' totals and, when the
        device's memory is known, whether the peak fits."""
        width = max(len(r[0]) for r in self.rows())
        lines = [f"memory plan per device: {self.header()}"]
        lines += [f"  {what:<{width}}  {gib(n):>8}  {when}" for what, n, when in self.rows()]
        phases = f"rollout {gib(self.rollout)}, update {gib(self.update)}, step {gib(self.step)}"
        lines.append(f"  peak {gib(self.peak)} GiB ({phases})")
        if capacity is not None:
            verdict = "fits" if self.fits(capacity) else "does NOT fit"
            lines.append(
                f"  device memory {gib(capacity)} GiB: {verdict} "
                f"(headroom {gib(capacity - self.peak)} GiB)"
            )
        return "\n".join(lines)

    def header(self) -> str:
        lay, work = self.layout, self.workload
        if lay.fully_sharded:
            where = f"FSDP2 over {lay.world_size} rank(s)"
            if lay.shard_bytes is not None:
                where += f" (param_dtype {_dtype(lay.shard_bytes)})"
        else:
            where = f"a whole replica on each of {lay.world_size} rank(s)"
        if lay.tensor_parallel > 1:
            where += f", tensor parallel {lay.tensor_parallel}"
        parts = [self.model, where]
        if work is not None:
            parts.append(f"micro-batch {work.micro_batch_tokens:,} tokens")
            if work.forward_tokens and work.forward_tokens < work.micro_batch_tokens:
                parts.append(f"forwards of {work.forward_tokens:,} tokens")
            chunk = work.logits_chunk_size
            parts.append(f"LM head in chunks of {chunk:,} tokens" if chunk else "dense LM head")
            if work.gradient_checkpointing:
                parts.append("gradient checkpointing")
            if work.engine is not None:
                parts.append(
                    "engine asleep from each rollout to the next" if self.sleep else "engine awake"
                )
        return "; ".join(p for p in parts if p)

    def as_dict(self) -> dict[str, int]:
        """Every byte count and the phases' totals."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.type in ("int", int)}
        out.update(rollout=self.rollout, update=self.update, step=self.step, peak=self.peak)
        return out


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _dtype(nbytes: int) -> str:
    return {2: "bf16", 4: "fp32", 8: "fp64", 1: "int8"}.get(nbytes, f"{nbytes} B")


# ---------------------------------------------------------------------- shapes
def _attention_widths(cfg: ModelConfig) -> tuple[int, int]:
    """Output widths of q and of k (= v) per token (GQA shapes; MLA approximated alike)."""
    return cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim


def _mlp_width(cfg: ModelConfig, layer: int) -> int:
    """Intermediate width a token runs through in `layer`: the dense MLP's, or a MoE layer's
    routed experts (top-k) and shared experts."""
    if not cfg.is_moe_layer(layer):
        return cfg.intermediate_size
    width = (cfg.moe_intermediate_size or cfg.intermediate_size) * cfg.num_experts_per_tok
    shared = cfg.shared_expert_intermediate_size or cfg.moe_intermediate_size or 0
    return width + cfg.num_shared_experts * shared


def _root_params(cfg: ModelConfig) -> int:
    """Embedding, untied head and final norm: FSDP2's root unit."""
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.vocab_size * cfg.hidden_size + head + cfg.hidden_size


def _block_params(cfg: ModelConfig) -> int:
    """The largest decoder block's parameters (an even share of the blocks' total)."""
    blocks = cfg.num_parameters() - _root_params(cfg)
    return -(-blocks // cfg.num_hidden_layers)


def value_model_params(cfg: ModelConfig) -> int:
    """Parameters of a critic on `cfg`'s backbone (`astrai.model.value.ValueModel`): the
    model without its untied LM head, plus the value head (hidden -> 1, with a bias)."""
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.num_parameters() - head + cfg.hidden_size + 1


def _pack_params(cfg: ModelConfig) -> int:
    """Values the engine's packed projections copy: q/k/v and gate/up concatenations (GQA
    attention, dense and shared-expert MLPs), as on a GPU (`astrai.model.packed`)."""
    q, kv = _attention_widths(cfg)
    attn = 0 if cfg.attention_type == "mla" else cfg.hidden_size * (q + 2 * kv)
    total = 0
    for layer in range(cfg.num_hidden_layers):
        moe = cfg.is_moe_layer(layer)
        width = (
            cfg.num_shared_experts * (cfg.shared_expert_intermediate_size or 0)
            if moe
            else cfg.intermediate_size
        )
        total += attn + 2 * cfg.hidden_size * width
    return total


def kv_bytes_per_token(cfg: ModelConfig, nbytes: int) -> int:
    """KV cache bytes per token (all layers): K and V per KV head, or MLA's latent."""
    if cfg.attention_type == "mla":
        return cfg.num_hidden_layers * mla_latent_dim(cfg) * nbytes
    return cfg.num_hidden_layers * cfg.num_key_value_heads * 2 * cfg.head_dim * nbytes


def layer_activation_bytes(cfg: ModelConfig, layout: Layout) -> int:
    """Bytes one token leaves saved for backward in one decoder block (mean over blocks), as
    autograd keeps them (counted with `saved_tensors_hooks` in tests/train/test_memory_plan.py):
    the residual stream's (both norms' inputs and outputs: 4 x hidden, in the residual's
    dtype; under autocast also the norms' outputs cast for the projections), the attention's
    (q and k as projected, normed with qk-norm, and rotated; v; the attention output and its
    copy into o_proj: compute dtype) and the MLP's (gate, up, the activation and the product).
    Tensor parallelism splits the head- and intermediate-wide ones."""
    res, comp = layout.residual_bytes, layout.compute_bytes
    tp, h = layout.tensor_parallel, cfg.hidden_size
    q, kv = _attention_widths(cfg)
    mlp = sum(_mlp_width(cfg, i) for i in range(cfg.num_hidden_layers)) / cfg.num_hidden_layers
    norm = int(cfg.qk_norm)
    wide = ((4 + norm) * q + (3 + norm) * kv + 4 * mlp) / tp
    casts = 2 * h if res != comp else 0
    return int(res * 4 * h + comp * (casts + wide))


# ---------------------------------------------------------------------- the plan
def plan_memory(
    cfg: ModelConfig,
    layout: Layout,
    work: Workload,
    *,
    name: str = "",
) -> MemoryPlan:
    """The per-device plan of training `cfg` with `layout` and `work` (`name`: the model, for
    the table's header)."""
    n = cfg.num_parameters()
    shards = layout.shards
    weights, optimizer = _trained(cfg, n, layout, work)
    critic_weights = critic_optimizer = critic_activations = 0
    if work.critic is not None:  # a parameter group of the same optimizer, the same layout
        critic_n = value_model_params(work.critic)
        critic_weights, critic_optimizer = _trained(work.critic, critic_n, layout, work)
    # the foreach step runs one parameter group at a time: the larger group's temporary
    temporaries = 0 if work.fused_optimizer or not optimizer else max(weights, critic_weights)
    reference = n * work.reference_bytes // shards if work.reference_bytes else 0
    teacher = work.teacher.num_parameters() * work.teacher_bytes if work.teacher else 0

    engine_weights = engine_packs = kv_pool = workspace = 0
    eng = work.engine
    sleep = bool(eng is not None and eng.sleep)
    if eng is not None:
        nbytes = layout.engine_bytes
        engine_weights = n * nbytes if layout.fully_sharded else 0
        engine_packs = _pack_params(cfg) * nbytes if eng.packed_projections else 0
        kv_pool = eng.kv_tokens * kv_bytes_per_token(cfg, nbytes)
        logits_rows = max(eng.max_batch_size, eng.logprob_chunk)
        prefill = eng.max_prefill_tokens * layer_activation_bytes(cfg, layout)
        workspace = prefill + logits_rows * cfg.vocab_size * 4 * 2  # fp32 logits + softmax
        if layout.fully_sharded:  # the copy's refresh gathers one whole tensor at a time
            workspace += (
                cfg.vocab_size * cfg.hidden_size * layout.master_bytes // layout.tensor_parallel
            )

    compute = _compute_copies(cfg, layout)
    tokens = min(work.forward_tokens or work.micro_batch_tokens, work.micro_batch_tokens)
    activations = tokens * _forward_bytes(cfg, layout, work.gradient_checkpointing)
    if work.critic is not None:  # its forward runs on the same tokens, in the same backward
        critic_activations = tokens * _forward_bytes(
            work.critic, layout, work.gradient_checkpointing
        )
        if layout.mixed:  # autocast's casts of its matmul weights (not the embedding)
            embedding = work.critic.vocab_size * work.critic.hidden_size
            compute += (critic_n - embedding) * layout.compute_bytes // layout.tensor_parallel
    chunk = min(work.logits_chunk_size or tokens, tokens)
    logits = chunk * (cfg.vocab_size // layout.tensor_parallel) * 4 * LOGITS_COPIES
    return MemoryPlan(
        weights=weights,
        gradients=weights,
        optimizer=optimizer,
        optimizer_temporaries=temporaries,
        reference=reference,
        engine_weights=engine_weights,
        engine_packs=engine_packs,
        kv_pool=kv_pool,
        rollout_workspace=workspace,
        compute_weights=compute,
        activations=activations,
        logits=logits,
        runtime=GPU_RUNTIME if layout.gpu else 0,
        critic_weights=critic_weights,
        critic_gradients=critic_weights,
        critic_optimizer=critic_optimizer,
        critic_activations=critic_activations,
        teacher=teacher,
        model=name or f"{n / 1e9:.2f}B parameters",
        layout=layout,
        workload=work,
        sleep=sleep,
    )


def _trained(cfg: ModelConfig, n: int, layout: Layout, work: Workload) -> tuple[int, int]:
    """Bytes per device of a trained model's `n` parameters on `cfg`'s shape: its weights
    (as its gradients) and its optimizer state, in the master dtype, split over the shards."""
    master, shards = layout.master_bytes, layout.shards
    hidden_states = work.hidden_optimizer_states
    if hidden_states is None:
        states = work.optimizer_states * n
    else:  # Muon: its momentum on the hidden matrices, AdamW's two moments on the rest
        rest = _root_params(cfg) + cfg.num_hidden_layers * 4 * cfg.hidden_size
        states = hidden_states * (n - rest) + work.optimizer_states * rest
    return n * master // shards, int(states * master) // shards


def _forward_bytes(cfg: ModelConfig, layout: Layout, checkpointing: bool) -> int:
    """Bytes one token leaves saved for backward through `cfg`'s blocks and final norm."""
    res = layout.residual_bytes
    per_layer = layer_activation_bytes(cfg, layout)
    final_norm = 2 * res * cfg.hidden_size  # its input and output, for the head
    if checkpointing:  # block inputs kept, one block recomputed at a time
        return cfg.num_hidden_layers * res * cfg.hidden_size + per_layer + final_norm
    return cfg.num_hidden_layers * per_layer + final_norm


def _compute_copies(cfg: ModelConfig, layout: Layout) -> int:
    """Weights in the compute dtype while a micro-batch runs. A whole replica under autocast:
    autocast's cache keeps the cast of every matmul weight until the forward ends. FSDP2: the
    root unit and two blocks gathered (the running one, the prefetched one; every block with
    `reshard_after_forward=false`) plus one block's unsharded gradient, in `param_dtype`; with
    autocast on fp32 shards, also the casts of what was gathered (the whole model)."""
    n, tp = cfg.num_parameters(), layout.tensor_parallel
    head_free = n - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    autocast = head_free * layout.compute_bytes // tp if layout.mixed else 0
    if not layout.fully_sharded:
        return autocast
    gathered_bytes = layout.shard_bytes or layout.master_bytes
    blocks = 2 if layout.reshard_after_forward else cfg.num_hidden_layers
    gathered = (_root_params(cfg) + (blocks + 1) * _block_params(cfg)) * gathered_bytes // tp
    return gathered + (autocast if layout.shard_bytes is None else 0)


def describe(plan: MemoryPlan, capacity: int | None) -> tuple[int, str]:
    """The logging level and message for `plan` on a device of `capacity` bytes: a warning
    naming the settings that would lower it (those not in use yet) when it does not fit."""
    text = plan.table(capacity)
    if capacity is None or plan.fits(capacity):
        return logging.INFO, text
    return logging.WARNING, (
        f"{text}\n  the plan's peak ({gib(plan.peak)} GiB) is over the device's memory "
        f"({gib(capacity)} GiB): expect an out-of-memory error. Ways down: "
        + ", ".join(_ways_down(plan))
    )


def _ways_down(plan: MemoryPlan) -> list[str]:
    work = plan.workload or Workload(micro_batch_tokens=0)
    if plan.layout.fully_sharded:
        ways = ["more ranks (trainer.devices, trainer.num_nodes)"]
    else:  # (PPO refuses trainer=fsdp2: its critic is not sharded)
        ways = [] if plan.critic else ["sharding over the ranks (trainer=fsdp2)"]
    if not work.gradient_checkpointing:
        ways.append("strategy.gradient_checkpointing=true")
    if work.logits_chunk_size is None:
        ways.append("strategy.logits_chunk_size=1024")
    if work.engine is not None and work.forward_tokens is None:
        ways.append(
            "packed forwards by token budget (strategy.padding_free=true "
            "strategy.use_dynamic_bsz=true strategy.ppo_max_token_len_per_gpu=8192)"
        )
    if work.engine is not None and not plan.sleep and plan.step == plan.peak:
        ways.append("strategy.engine.enable_sleep_mode=true")
    if plan.engine_packs:
        ways.append("strategy.engine.packed_projections=false")
    ways.append("a smaller data.batch_size")
    if work.engine is not None:
        ways.append("a smaller strategy.engine.kv_tokens")
    return ways
