"""What `astrai.train.bisect` measures on rebuilt weights, and the condition it looks for.

A probe maps a module (and its tokenizer) to named numbers:
- ``eval=[arithmetic,...]``: evaluation suites (conf/eval/) on the weights in memory, through
  a fresh engine; each suite as the run's evaluation callback configured it
  (``callbacks.eval.suites.<name>``), else as ``python -m astrai.eval`` composes it. Requests
  carry per-request seeds, so two probes of the same weights give the same numbers and two
  probes of different weights share their sampling noise (common random numbers).
- ``logprob=SOURCE``: the mean log-prob per token the policy gives the assistant turns of SFT
  records (``builtin:arithmetic/sft/val``, a JSONL / parquet file: the reference answers),
  teacher-forced: a continuous measure of "how likely is the right answer", which moves with
  every update where exact match moves in steps of one item. Built-in records take the run's
  task options (``arithmetic:``), ``n=256`` held-out records, seed 1.
- ``pkg.module:function``: ``function(module, tokenizer) -> {name: value}``, any measure.

A condition is ``metric op number`` (``exact_match < 0.5``; op one of < <= > >= == !=). A
metric is named in full (``arithmetic/exact_match``) or by its last part when that is unique.
"""

from __future__ import annotations

import logging
import math
import operator
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

__all__ = [
    "CallableProbe",
    "Condition",
    "EvalProbe",
    "LogprobProbe",
    "Probe",
    "ProbeError",
    "parse_probe",
]

OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
}


class ProbeError(ValueError):
    """A probe or condition that cannot be used (named in the message)."""


class Probe(ABC):
    """Measures a module: ``probe(module, tokenizer) -> {metric: value}``."""

    @abstractmethod
    def __call__(self, module: Any, tokenizer: Any) -> dict[str, float]: ...


class CallableProbe(Probe):
    """A user's function ``fn(module, tokenizer) -> Mapping[str, float]``."""

    def __init__(self, fn: Callable[[Any, Any], Mapping[str, float]], name: str = "") -> None:
        self.fn = fn
        self.name = name or repr(fn)

    def __call__(self, module: Any, tokenizer: Any) -> dict[str, float]:
        out = self.fn(module, tokenizer)
        if not isinstance(out, Mapping):
            raise ProbeError(f"probe {self.name}: returned {type(out).__name__}, not a mapping")
        return {str(k): float(v) for k, v in out.items()}

    def __repr__(self) -> str:
        return self.name


class EvalProbe(Probe):
    """Evaluation suites on the module's live model through a fresh engine."""

    def __init__(
        self, suites: Mapping[str, Any], engine: Callable[..., Any] | None, max_batch_size: int
    ) -> None:
        from astrai.eval.runner import build_suites

        self.names = list(suites)
        self.suites = build_suites(suites)
        self.engine = engine
        self.max_batch_size = int(max_batch_size)

    def __call__(self, module: Any, tokenizer: Any) -> dict[str, float]:
        import torch

        from astrai.eval.runner import evaluate
        from astrai.inference import InferenceEngine

        model, tokenizer = module.live_policy()
        model.eval()
        context = model.config.max_position_embeddings
        need = max(suite.required_seq_len(tokenizer) for suite in self.suites.values())
        factory = self.engine or InferenceEngine
        engine = factory(
            model,
            tokenizer,
            start=False,
            max_batch_size=self.max_batch_size,
            max_seq_len=min(max(need, 64), context),
        )
        out: dict[str, float] = {}
        try:
            with torch.random.fork_rng(), torch.no_grad():
                for result in evaluate(engine, self.suites):
                    for key, value in result.metrics.items():
                        out[f"{result.name}/{key}"] = float(value)
        finally:
            engine.shutdown()
        return out

    def __repr__(self) -> str:
        return f"eval=[{','.join(self.names)}]"


class LogprobProbe(Probe):
    """Mean per-token log-prob of the assistant turns of SFT records (``logprob``) and their
    mean per-record sum (``logprob_sum``), teacher-forced on the policy."""

    def __init__(self, source: str, builtin: Mapping[str, Any], limit: int = 256) -> None:
        self.source, self.builtin, self.limit = source, dict(builtin), int(limit)
        self.encoded: list[tuple[list[int], list[int]]] | None = None

    def _records(self, tokenizer: Any) -> list[tuple[list[int], list[int]]]:
        from astrai.data.encode import PrepareOptions, encode_record
        from astrai.data.inputs import iter_input

        opts = PrepareOptions(
            kind="sft",
            max_length=None,
            pack=False,
            window_size=None,
            truncate=False,
            skip_bad_lines=False,
            text_field="text",
            add_bos=False,
            add_eos=False,
            required_fields=[],
        )
        out = []
        for where, record in iter_input(self.source, "sft", self.builtin):
            if isinstance(record, Exception):
                raise ProbeError(f"probe logprob={self.source}: {record}")
            row = encode_record(tokenizer, record, where, opts)
            out.append((row["input_ids"], row["loss_mask"]))
            if len(out) >= self.limit:
                break
        if not out:
            raise ProbeError(f"probe logprob={self.source}: no records")
        return out

    def __call__(self, module: Any, tokenizer: Any) -> dict[str, float]:
        import torch

        model, tokenizer = module.live_policy()
        if self.encoded is None:
            self.encoded = self._records(tokenizer)
        was_training = model.training
        model.eval()
        tokens, total, sums = 0, 0.0, []
        try:
            with torch.no_grad():
                for ids, mask in self.encoded:
                    x = torch.tensor([ids], device=next(model.parameters()).device)
                    logp = torch.log_softmax(model(x)[0, :-1].double(), dim=-1)
                    target = torch.tensor(ids[1:], device=logp.device)
                    keep = torch.tensor(mask[1:], device=logp.device).bool()
                    picked = logp.gather(1, target[:, None])[:, 0][keep]
                    sums.append(float(picked.sum()))
                    total += float(picked.sum())
                    tokens += int(keep.sum())
        finally:
            model.train(was_training)
        return {"logprob": total / max(tokens, 1), "logprob_sum": sum(sums) / len(sums)}

    def __repr__(self) -> str:
        return f"logprob={self.source}"


def _suite_nodes(cfg: DictConfig, names: list[str]) -> dict[str, Any]:
    """Each named suite's config: the run's evaluation callback's, else conf/eval/<name>."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from astrai.eval.runner import CONF_DIR

    run_suites = OmegaConf.select(cfg, "callbacks.eval.suites", default=None) or {}
    nodes: dict[str, Any] = {}
    missing = [n for n in names if n not in run_suites]
    if missing:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            try:
                composed = compose("eval", overrides=[f"eval=[{','.join(missing)}]"])
            except Exception as err:  # Hydra's own messages name the option
                raise ProbeError(f"probe eval=[{','.join(names)}]: {err}") from None
        GlobalHydra.instance().clear()
        composed_suites = OmegaConf.to_container(composed.suites, resolve=True)
    for name in names:
        node = run_suites[name] if name in run_suites else composed_suites[name]
        nodes[name] = OmegaConf.create(
            OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
        )
    return nodes


def parse_probe(spec: str | Callable[..., Any] | Probe, cfg: DictConfig) -> Probe:
    """``eval=[a,b]``, ``pkg.module:function`` or a callable, for the run ``cfg``."""
    if isinstance(spec, Probe):
        return spec
    if callable(spec):
        return CallableProbe(spec)
    text = str(spec).strip()
    match = re.fullmatch(r"eval=\[?([\w,\s-]+)\]?", text)
    if match:
        names = [n.strip() for n in match.group(1).split(",") if n.strip()]
        if not names:
            raise ProbeError(f"probe={text}: name at least one suite (eval=[arithmetic])")
        engine = None
        if OmegaConf.select(cfg, "callbacks.eval.engine", default=None) is not None:
            from hydra.utils import instantiate

            engine = instantiate(cfg.callbacks.eval.engine)
        size = OmegaConf.select(cfg, "callbacks.eval.max_batch_size", default=32)
        return EvalProbe(_suite_nodes(cfg, names), engine, int(size))
    if text.startswith("logprob="):
        source = text.removeprefix("logprob=")
        task = OmegaConf.select(cfg, "arithmetic", default=None)
        builtin = {"n": 256, "seed": 1}
        if task is not None and source.startswith("builtin:arithmetic"):
            builtin.update(OmegaConf.to_container(task, resolve=True))
        return LogprobProbe(source, builtin)
    if re.fullmatch(r"[\w.]+[:.]\w+", text):
        from hydra.utils import get_method

        try:
            fn = get_method(text.replace(":", "."))
        except (ImportError, ValueError) as err:
            raise ProbeError(f"probe={text}: {err}") from None
        return CallableProbe(fn, text)
    raise ProbeError(
        f"probe={text}: give eval=[suite,...] (conf/eval/), logprob=SOURCE or a function as "
        "pkg.module:function"
    )


@dataclass(frozen=True)
class Condition:
    """``metric op value``: the behaviour bisect looks for."""

    metric: str
    op: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Condition:
        match = re.fullmatch(r"\s*([\w./-]+)\s*(<=|>=|==|!=|<|>)\s*(\S+)\s*", str(text))
        if not match:
            raise ProbeError(
                f"when={text!r}: write it as 'metric op number', op one of "
                + " ".join(OPS)
                + " (e.g. when='exact_match < 0.5')"
            )
        metric, op, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            raise ProbeError(f"when={text!r}: {raw!r} is not a number") from None
        return cls(metric, op, value)

    def key(self, metrics: Mapping[str, float]) -> str:
        """The full name of this condition's metric among ``metrics``."""
        if self.metric in metrics:
            return self.metric
        found = [
            k for k in metrics if k.split("/")[-1] == self.metric or k.endswith("/" + self.metric)
        ]
        if len(found) == 1:
            return found[0]
        known = ", ".join(sorted(metrics)) or "none"
        what = "is ambiguous" if found else "is not among the probe's metrics"
        raise ProbeError(f"when: metric {self.metric!r} {what} ({known})")

    def holds(self, metrics: Mapping[str, float]) -> bool:
        value = metrics[self.key(metrics)]
        return not math.isnan(value) and OPS[self.op](value, self.value)

    @property
    def sign(self) -> int:
        """The direction of the behaviour: +1 when it is the metric going up, -1 down, 0
        when the condition has none (== and !=)."""
        return {"<": -1, "<=": -1, ">": 1, ">=": 1}.get(self.op, 0)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}"
