"""On-policy data: completions sampled from a checkpoint, judged by a reward.

DPO learns most from pairs its own policy could have produced (Tajwar et al. 2024; the
"on-policy" recipes of Llama 3 and Tulu 3): for each prompt the inference engine samples
``num_samples`` completions from the starting checkpoint, a reward (e.g. ``exact_match``)
scores them, and one rewarded completion becomes ``chosen`` and one unrewarded ``rejected``.
Prompts whose samples are all right or all wrong give no pair (or, with
``fallback="reference"``, the record's reference ``solution`` as ``chosen``).

A source like this is a dataset spec's ``source`` with a ``_target_``: the datamodule
instantiates it, names its cache folder after :meth:`OnPolicyPairs.identity` (the
checkpoint's weights digest and every sampling option), and ``prepare_data`` tokenizes
:meth:`OnPolicyPairs.records` once. A new checkpoint or option gives a new folder::

    train:
      _target_: astrai.data.PreferenceDataset
      source:
        _target_: astrai.data.OnPolicyPairs
        policy: outputs/tiny_sft_start/latest/export
        prompts: builtin:arithmetic/prompt/train
        builtin: {n: 2000, seed: 0}
      prepare: {name: onpolicy_train}
"""

from __future__ import annotations

import hashlib
import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from astrai.data.rewards import get_reward
from astrai.data.storage import DataError
from astrai.inference.params import SamplingParams

log = logging.getLogger(__name__)

__all__ = [
    "FALLBACKS",
    "OnPolicyPairs",
    "OnPolicySamples",
    "OnPolicySource",
    "RecordSource",
    "policy_digest",
]

FALLBACKS = ("none", "reference")


class RecordSource(ABC):
    """Records produced by code rather than read from a file: ``prepare`` reads
    :meth:`records`; the cache keys on :meth:`identity` (what determines the records)."""

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """Everything the records depend on (JSON-able): the cache folder's key."""

    @abstractmethod
    def records(self) -> Iterator[dict[str, Any]]:
        """The records, in a reproducible order."""


def policy_digest(path: str | Path) -> str:
    """A content digest of a checkpoint directory's config and weight files."""
    root = Path(path)
    files = sorted(
        p for p in root.iterdir() if p.suffix in (".json", ".safetensors", ".bin") and p.is_file()
    )
    if not any(p.suffix in (".safetensors", ".bin") for p in files):
        raise FileNotFoundError(f"{root}: no model weights (*.safetensors) in this directory")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


class OnPolicySource(RecordSource):
    """Completions sampled from ``policy`` (an export directory with its tokenizer) for every
    prompt, and their rewards: what :class:`OnPolicyPairs` and :class:`OnPolicySamples` turn
    into records.

    Args:
        policy: the checkpoint to sample from (e.g. the SFT stage's export).
        prompts: prompt records with the fields ``reward`` reads (``builtin:...`` or a JSONL
            file of ``{"prompt", "answer", ...}``).
        builtin: options of a ``builtin:`` prompt source (``n``, ``seed``, task difficulty).
        num_samples: completions sampled per prompt.
        temperature, top_p, max_tokens, seed: sampling (seeded: the same samples every time).
        reward: a reward name from :mod:`astrai.data.rewards`; a completion is good when its
            reward is above ``threshold``.
        engine: the engine factory (``conf/engine`` as a partial); None: ``InferenceEngine``.
        batch_size: prompts per ``run_batch`` call (progress is shown per call).
    """

    #: the fewest ``num_samples`` a subclass can use
    min_samples = 1

    def __init__(
        self,
        policy: str,
        prompts: str,
        *,
        builtin: Mapping[str, Any] | None = None,
        num_samples: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 32,
        seed: int = 0,
        reward: str = "exact_match",
        threshold: float = 0.5,
        engine: Callable[..., Any] | None = None,
        batch_size: int = 256,
    ) -> None:
        name = type(self).__name__
        if num_samples < self.min_samples:
            raise ValueError(
                f"{name}: num_samples must be >= {self.min_samples}, got {num_samples}"
            )
        if temperature <= 0:
            raise ValueError(f"{name}: temperature must be > 0 to sample, got {temperature}")
        get_reward(reward)  # unknown names fail here
        self.policy = str(policy)
        if not Path(self.policy).is_dir():
            raise FileNotFoundError(
                f"{name}.policy: checkpoint directory {self.policy} does not exist "
                "(train the starting policy first, e.g. +experiment=tiny_sft_start)"
            )
        self.prompts = str(prompts)
        self.builtin = dict(builtin or {})
        self.num_samples = int(num_samples)
        self.sampling = SamplingParams(
            temperature=float(temperature), top_p=float(top_p), max_tokens=int(max_tokens)
        )
        try:  # a bad option fails here, before the checkpoint is loaded
            self.sampling.validate()
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        self.seed = int(seed)
        self.reward = reward
        self.threshold = float(threshold)
        self.engine_factory = engine
        self.batch_size = int(batch_size)
        self.stats: dict[str, float] = {}
        self._policy_digest: str | None = None

    def identity(self) -> dict[str, Any]:
        # the cache key and the prepared file's signature both ask: hash the weights once
        if self._policy_digest is None:
            self._policy_digest = policy_digest(self.policy)
        return {
            "on_policy": type(self).__name__,
            "policy": self._policy_digest,
            "prompts": self.prompts,
            "builtin": self.builtin,
            "num_samples": self.num_samples,
            "sampling": {  # plain values: the cache folder is named after them
                "temperature": self.sampling.temperature,
                "top_p": self.sampling.top_p,
                "max_tokens": self.sampling.max_tokens,
            },
            "seed": self.seed,
            "reward": self.reward,
            "threshold": self.threshold,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(policy={self.policy!r}, prompts={self.prompts!r})"

    # ------------------------------------------------------------------ sampling
    def _prompt_records(self) -> list[dict[str, Any]]:
        from astrai.data.inputs import iter_input

        out = []
        for where, rec in iter_input(self.prompts, "prompt", self.builtin):
            if isinstance(rec, Exception):
                raise rec
            if not isinstance(rec, Mapping) or "prompt" not in rec:
                raise DataError(f"{where}: an on-policy prompt record needs a 'prompt' field")
            out.append(dict(rec))
        if not out:
            raise DataError(f"{type(self).__name__}: no prompts in {self.prompts}")
        return out

    def _engine(self, model: Any, tokenizer: Any, longest: int) -> Any:
        from astrai.inference import InferenceEngine

        factory = self.engine_factory or InferenceEngine
        return factory(
            model,
            tokenizer,
            start=False,
            max_batch_size=min(self.batch_size * self.num_samples, 256),
            max_seq_len=min(
                longest + self.sampling.max_tokens, model.config.max_position_embeddings
            ),
        )

    def sample(self) -> list[tuple[dict[str, Any], list[str], list[float]]]:
        """``(record, completions, rewards)`` per prompt, sampled from the policy."""
        from astrai.model import load_pretrained
        from astrai.tokenizer import AutoTokenizer

        records = self._prompt_records()
        tokenizer = AutoTokenizer.from_pretrained(self.policy)
        model = load_pretrained(self.policy, dtype=torch.float32).eval()
        prompt_ids = [
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": r["prompt"]}],
                    add_generation_prompt=True,
                    tokenize=True,
                )
            )
            for r in records
        ]
        engine = self._engine(model, tokenizer, max(len(p) for p in prompt_ids))
        reward_fn = get_reward(self.reward)
        out = []
        try:
            bar = tqdm(total=len(records), desc="on-policy samples", unit="prompt", leave=False)
            for start in range(0, len(records), self.batch_size):
                chunk = range(start, min(start + self.batch_size, len(records)))
                batch = [prompt_ids[i] for i in chunk for _ in range(self.num_samples)]
                results = engine.run_batch(
                    batch,
                    self.sampling,
                    seed=self.seed + start * self.num_samples,
                    return_details=True,
                )
                for j, i in enumerate(chunk):
                    group = results[j * self.num_samples : (j + 1) * self.num_samples]
                    texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in group]
                    rewards = [float(reward_fn(records[i], t)) for t in texts]
                    out.append((records[i], texts, rewards))
                bar.update(len(chunk))
            bar.close()
        finally:
            engine.shutdown()
        return out


class OnPolicyPairs(OnPolicySource):
    """Preference pairs sampled from ``policy``: a completion with a reward above
    ``threshold`` is ``chosen``, one at or below it ``rejected``.

    Args:
        pairs_per_prompt: up to this many (chosen, rejected) pairs per prompt, each sample
            used once.
        fallback: ``none`` skips prompts with no rewarded sample; ``reference`` uses the
            record's ``solution`` field as ``chosen`` there (off-policy chosen).

    The other arguments are :class:`OnPolicySource`'s (``num_samples`` >= 2).
    """

    min_samples = 2

    def __init__(
        self,
        policy: str,
        prompts: str,
        *,
        pairs_per_prompt: int = 1,
        fallback: str = "none",
        **kwargs: Any,
    ) -> None:
        if fallback not in FALLBACKS:
            raise ValueError(
                f"OnPolicyPairs: fallback must be one of {FALLBACKS}, got {fallback!r}"
            )
        if pairs_per_prompt < 1:
            raise ValueError(
                f"OnPolicyPairs: pairs_per_prompt must be >= 1, got {pairs_per_prompt}"
            )
        super().__init__(policy, prompts, **kwargs)
        self.pairs_per_prompt = int(pairs_per_prompt)
        self.fallback = fallback

    def identity(self) -> dict[str, Any]:
        return {
            **super().identity(),
            "pairs_per_prompt": self.pairs_per_prompt,
            "fallback": self.fallback,
        }

    # ------------------------------------------------------------------ pairing
    def records(self) -> Iterator[dict[str, Any]]:
        sampled = self.sample()
        rng = random.Random(self.seed)
        n_pairs = n_fallback = n_all_right = n_all_wrong = 0
        correct = total = 0
        for record, texts, rewards in sampled:
            good = [t for t, r in zip(texts, rewards) if r > self.threshold]
            bad = [t for t, r in zip(texts, rewards) if r <= self.threshold]
            correct += len(good)
            total += len(texts)
            if not bad:
                n_all_right += 1
                continue
            if not good:
                n_all_wrong += 1
                if self.fallback != "reference" or not record.get("solution"):
                    continue
                good = [str(record["solution"])]
                n_fallback += 1
            rng.shuffle(good)
            rng.shuffle(bad)
            for k in range(min(self.pairs_per_prompt, len(good), len(bad))):
                n_pairs += 1
                yield {
                    "id": f"{record.get('id', 'prompt')}-pair{k}",
                    "prompt": record["prompt"],
                    "chosen": good[k],
                    "rejected": bad[k],
                    **{f: record[f] for f in ("answer",) if f in record},
                }
        self.stats = {
            "prompts": len(sampled),
            "pairs": n_pairs,
            "sample_accuracy": correct / max(total, 1),
            "all_right": n_all_right,
            "all_wrong": n_all_wrong,
            "reference_chosen": n_fallback,
        }
        log.info(
            "on-policy pairs from %s: %d pairs from %d prompts (sample accuracy %.3f; %d prompts "
            "all right, %d all wrong, %d with the reference as chosen)",
            self.policy,
            n_pairs,
            len(sampled),
            self.stats["sample_accuracy"],
            n_all_right,
            n_all_wrong,
            n_fallback,
        )
        if n_pairs == 0:
            raise DataError(
                f"OnPolicyPairs: no preference pairs from {self.policy} ({total} samples, "
                f"{correct} rewarded): the policy is always or never right on these prompts; "
                "use more samples, a higher temperature, or fallback=reference"
            )


class OnPolicySamples(OnPolicySource):
    """Every sampled completion as an unpaired record for KTO: ``{"prompt", "completion",
    "label"}`` with ``label`` = reward above ``threshold`` (default 0: any reward is a thumbs
    up), plus the record's ``id`` and ``answer`` and the ``reward`` itself.

    Args:
        max_per_prompt: keep at most this many completions of one prompt (None: all), as
            evenly split between desirable and undesirable as the samples allow (4 of 6 right
            and 2 wrong keeps 2 and 2); which ones is seeded.

    The other arguments are :class:`OnPolicySource`'s.
    """

    def __init__(
        self,
        policy: str,
        prompts: str,
        *,
        threshold: float = 0.0,
        max_per_prompt: int | None = None,
        **kwargs: Any,
    ) -> None:
        if max_per_prompt is not None and max_per_prompt < 1:
            raise ValueError(
                f"OnPolicySamples: max_per_prompt must be >= 1 or null, got {max_per_prompt}"
            )
        super().__init__(policy, prompts, threshold=threshold, **kwargs)
        self.max_per_prompt = None if max_per_prompt is None else int(max_per_prompt)

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "max_per_prompt": self.max_per_prompt}

    def _keep(self, good: int, bad: int) -> tuple[int, int]:
        """How many desirable and undesirable samples of one prompt to keep."""
        cap = self.max_per_prompt
        if cap is None or good + bad <= cap:
            return good, bad
        keep_good = min(good, cap // 2)
        keep_bad = min(bad, cap - keep_good)
        return min(good, cap - keep_bad), keep_bad

    def records(self) -> Iterator[dict[str, Any]]:
        sampled = self.sample()
        rng = random.Random(self.seed)
        n_good = n_bad = 0
        correct = total = 0
        for record, texts, rewards in sampled:
            scored = list(zip(texts, rewards))
            good = [(t, r) for t, r in scored if r > self.threshold]
            bad = [(t, r) for t, r in scored if r <= self.threshold]
            correct += len(good)
            total += len(scored)
            keep_good, keep_bad = self._keep(len(good), len(bad))
            if keep_good < len(good):
                good = rng.sample(good, keep_good)
            if keep_bad < len(bad):
                bad = rng.sample(bad, keep_bad)
            kept = [(t, r, True) for t, r in good] + [(t, r, False) for t, r in bad]
            rng.shuffle(kept)
            for k, (text, reward, label) in enumerate(kept):
                n_good += label
                n_bad += not label
                yield {
                    "id": f"{record.get('id', 'prompt')}-sample{k}",
                    "prompt": record["prompt"],
                    "completion": text,
                    "label": label,
                    "reward": reward,
                    **{f: record[f] for f in ("answer",) if f in record},
                }
        self.stats = {
            "prompts": len(sampled),
            "records": n_good + n_bad,
            "desirable": n_good,
            "undesirable": n_bad,
            "sample_accuracy": correct / max(total, 1),
        }
        log.info(
            "on-policy samples from %s: %d records from %d prompts (%d desirable, %d "
            "undesirable; sample accuracy %.3f)",
            self.policy,
            n_good + n_bad,
            len(sampled),
            n_good,
            n_bad,
            self.stats["sample_accuracy"],
        )
        if not n_good or not n_bad:
            log.warning(
                "on-policy samples from %s are all %s: KTO learns from both kinds; use more "
                "samples, another temperature or another threshold",
                self.policy,
                "desirable" if n_good else "undesirable",
            )
