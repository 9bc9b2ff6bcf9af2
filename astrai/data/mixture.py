"""Weighted mixtures of training sources: ``data.train.sources: [{source, weight, ...}, ...]``.

A mixture's dataset is the concatenation of its sources' datasets (:class:`MixtureDataset`);
its sampler (:class:`MixtureSampler`) makes each epoch's order of ``num_samples`` positions,
each position a source drawn by weight and the next sample of that source:

- ``replacement: true`` (the default; litgpt's mixes, litdata's ``CombinedStreamingDataset``,
  draw this way, where Megatron's ``BlendedDataset`` places each source deterministically
  where its share lags most): every position draws its source independently with probability
  ``weight`` (``torch.multinomial(weights, num_samples, replacement=True)``). Each source is
  read through shuffled passes of itself, a new pass once it is exhausted, so a small source
  is repeated (up-sampled) and a large one read in part, the next epoch continuing where this
  one stopped.
- ``replacement: false`` (``torch.utils.data.WeightedRandomSampler(replacement=False)`` over
  every sample, a sample of source ``s`` weighing ``weight_s / len(s)``): no sample twice in
  an epoch, so ``num_samples`` is at most all the sources' samples together; a source's share
  is its weight while it lasts and shrinks as it runs out. Drawn as torch does, by an
  exponential race (the ``num_samples`` smallest of ``Exp(1) * len(s) / weight_s`` keys),
  holding at most ``num_samples`` keys per source.

Weights need not sum to 1: they are normalized (as ``WeightedRandomSampler``, litgpt's
``random.choices`` and Megatron's ``normalize(weights)`` do). ``num_samples`` (torch's name;
Megatron's ``BlendedDataset`` calls it ``size``) is the epoch's length, by default all the
sources' samples together.

The order of an epoch is a function of ``(seed, epoch)`` and the sources' positions at the
epoch's start (``offsets``: samples drawn from each source before the epoch), themselves a
function of the seed. As for every :class:`~astrai.data.sampler.ResumableSampler`, ranks take
positions round-robin and the state is the draw position ``consumed``: with ``offsets`` it
is the mixture's whole state, and a resume at any number of ranks continues the same order.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from torch.utils.data import Dataset

from astrai.data.builtin import BUILTIN_PREFIX
from astrai.data.encode import KINDS
from astrai.data.fingerprint import dataset_fingerprint
from astrai.data.sampler import ResumableSampler

__all__ = [
    "ENTRY_KEYS",
    "MIXTURE_KEYS",
    "MixtureDataset",
    "MixtureSampler",
    "build_mixture",
    "check_entries",
    "mixture_fingerprint",
]

#: the keys of one ``data.train.sources`` entry
ENTRY_KEYS = ("source", "weight", "kind", "prepare", "name")
#: the split's keys that describe the mixture (not passed to the dataset class)
MIXTURE_KEYS = ("sources", "num_samples", "replacement")
#: the prepare kinds whose storages a dataset of each kind reads (a pretrain dataset reads the
#: token stream of chat-rendered SFT data too; the others their own kind only)
READABLE = {"pretrain": ("pretrain", "sft")}


def _seed(*parts: Any) -> int:
    """A 63-bit seed from ``parts``, the same in every process."""
    key = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _generator(*parts: Any) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*parts))


def _entry_name(source: Any, index: int) -> str:
    """A default name: a built-in's name (``arithmetic_sft_train``), a file's or folder's stem."""
    if isinstance(source, str) and source.startswith(BUILTIN_PREFIX):
        return source[len(BUILTIN_PREFIX) :].strip("/").replace("/", "_")
    if isinstance(source, str) and source.strip("/"):
        return os.path.splitext(os.path.basename(source.rstrip("/")))[0]
    return f"source{index}"


def check_entries(split: str, entries: Any, dataset_kind: str | None) -> list[dict[str, Any]]:
    """``data.<split>.sources`` as a list of checked entries (each with a ``name``); a bad one
    is refused naming ``data.<split>.sources[i]`` and the field."""
    where = f"data.{split}.sources"
    if split != "train":
        raise ValueError(f"{where}: a mixture of sources is for data.train only")
    if isinstance(entries, str | bytes | Mapping) or not isinstance(entries, Sequence):
        raise ValueError(
            f"{where}: must be a list of {{source, weight, kind?, prepare?, name?}}, got "
            f"{type(entries).__name__}"
        )
    if not entries:
        raise ValueError(f"{where}: empty; list at least one source")
    checked: list[dict[str, Any]] = []
    for i, entry in enumerate(entries):
        at = f"{where}[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(
                f"{at}: must be a mapping {{source, weight, kind?, prepare?, name?}}, got {entry!r}"
            )
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise ValueError(f"{at}: unknown key(s) {unknown}; an entry has {list(ENTRY_KEYS)}")
        for key in ("source", "weight"):
            if entry.get(key) is None:
                raise ValueError(f"{at}.{key}: required")
        weight = entry["weight"]
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"{at}.weight: must be a number, got {weight!r}")
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"{at}.weight: must be positive and finite, got {weight!r} (remove the entry "
                "to leave a source out)"
            )
        kind = entry.get("kind")
        if kind is not None and kind not in KINDS:
            raise ValueError(f"{at}.kind: must be one of {KINDS}, got {kind!r}")
        readable = READABLE.get(dataset_kind, (dataset_kind,))
        if kind is not None and dataset_kind is not None and kind not in readable:
            raise ValueError(
                f"{at}.kind: {kind!r}, but data.{split}'s dataset reads {list(readable)} "
                "storages (a mixture's sources share the split's dataset class)"
            )
        prepare = entry.get("prepare")
        if prepare is not None and not isinstance(prepare, Mapping):
            raise ValueError(f"{at}.prepare: must be a mapping of prepare options, got {prepare!r}")
        name = entry.get("name") or _entry_name(entry["source"], i)
        if not isinstance(name, str) or "/" in name or os.sep in name:
            raise ValueError(f"{at}.name: must be a string without '/', got {name!r}")
        checked.append({**entry, "name": name})
    names = [e["name"] for e in checked]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise ValueError(
                f"{where}[{i}]: name {name!r} is also sources[{names.index(name)}]'s; give "
                "each entry its own name"
            )
    return checked


def mixture_options(split: str, spec: Mapping[str, Any]) -> tuple[int | None, bool]:
    """The split's ``num_samples`` and ``replacement``, checked."""
    num = spec.get("num_samples")
    if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 1):
        raise ValueError(f"data.{split}.num_samples: must be a positive integer, got {num!r}")
    replacement = spec.get("replacement", True)
    if not isinstance(replacement, bool):
        raise ValueError(f"data.{split}.replacement: must be true or false, got {replacement!r}")
    return num, replacement


class MixtureDataset(Dataset):
    """The concatenation of the sources' datasets, with the mixture's settings.

    Index ``i`` is sample ``i - start[s]`` of source ``s`` (as ``ConcatDataset``); which
    indices an epoch takes, and in what order, is :class:`MixtureSampler`'s business.

    Args:
        datasets: one dataset per source (all of one class).
        weights: positive, normalized here.
        names: how logs and the ledger name the sources.
        num_samples: the epoch's length (default: all the sources' samples together).
        replacement: see the module's docstring.
        collate: the sources' collate (one class, one collate); the data loader's.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        weights: Sequence[float],
        names: Sequence[str] | None = None,
        *,
        num_samples: int | None = None,
        replacement: bool = True,
        collate: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ValueError(
                f"MixtureDataset: {len(datasets)} datasets and {len(weights)} weights; give one "
                "weight per dataset"
            )
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"MixtureDataset: weights must be positive, got {list(weights)}")
        self.datasets = list(datasets)
        self.weights = (w / w.sum()).tolist()
        self.names = list(names) if names is not None else [f"source{i}" for i in range(len(w))]
        self.sizes = [len(d) for d in self.datasets]  # type: ignore[arg-type]
        empty = [n for n, size in zip(self.names, self.sizes) if size == 0]
        if empty:
            raise ValueError(f"data.train.sources: {empty} hold no samples")
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        total = int(self.starts[-1])
        self.num_samples = total if num_samples is None else int(num_samples)
        self.replacement = bool(replacement)
        self.collate = collate
        if not self.replacement and self.num_samples > total:
            raise ValueError(
                f"data.train.num_samples={self.num_samples}: without replacement an epoch takes "
                f"each sample at most once, and the sources hold {total}; lower num_samples or "
                "set data.train.replacement=true"
            )

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> Any:
        source, local = self.locate([index])
        return self.datasets[int(source[0])][int(local[0])]

    def locate(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, index within the source)`` of each concatenated index."""
        idx = np.asarray(indices, dtype=np.int64)
        source = np.searchsorted(self.starts, idx, side="right") - 1
        return source, idx - self.starts[source]

    def sampler(self, **options: Any) -> MixtureSampler:
        """The mixture's training sampler (``options``: :class:`ResumableSampler`'s)."""
        return MixtureSampler(self, **options)


class MixtureSampler(ResumableSampler):
    """The epoch's order of a :class:`MixtureDataset` (see the module's docstring): a
    :class:`ResumableSampler` over ``num_samples`` positions whose ``epoch_order`` gives the
    concatenated index at each position. ``shuffle`` shuffles each source's passes (without
    it a source is read in its own order); the interleaving of sources is always drawn.

    ``state_dict()`` adds ``mixture``: ``{"offsets", "weights", "sizes", "replacement",
    "names"}``, ``offsets`` being the samples drawn from each source before the current epoch;
    a resume whose sources, weights or sizes differ is refused.
    """

    def __init__(self, mixture: MixtureDataset, **options: Any) -> None:
        super().__init__(mixture.num_samples, **options)
        self.mixture = mixture
        self._offsets: dict[int, np.ndarray] = {0: np.zeros(len(mixture.sizes), np.int64)}
        self._orders: dict[int, torch.Tensor] = {}
        self._sequences: dict[int, torch.Tensor] = {}

    # -- order ------------------------------------------------------------------------------
    def source_sequence(self, epoch: int) -> torch.Tensor:
        """The source of each position of ``epoch`` (a function of the seed and the epoch)."""
        if epoch not in self._sequences:
            self._sequences = {k: v for k, v in self._sequences.items() if k >= epoch - 1}
            self._sequences[epoch] = self._draw_sources(epoch)
        return self._sequences[epoch]

    def _draw_sources(self, epoch: int) -> torch.Tensor:
        m = self.mixture
        g = _generator(self.seed, "mixture", epoch)
        weights = torch.tensor(m.weights, dtype=torch.float64)
        if m.replacement:
            return torch.multinomial(weights, m.num_samples, replacement=True, generator=g)
        # The exponential race over every sample (key Exp(1) * len(s) / weight_s) decides
        # only which source each position takes, so each source needs just its smallest keys
        # in order: the k-th smallest of n Exp(rate) keys is a sum of k spacings
        # Exp(1) / ((n - i) * rate) (Renyi's representation), at most num_samples of them.
        keys, owner = [], []
        for s, (size, weight) in enumerate(zip(m.sizes, m.weights)):
            k = min(size, m.num_samples)
            spacings = torch.empty(k, dtype=torch.float64).exponential_(generator=g)
            rates = (size - torch.arange(k, dtype=torch.float64)) * (weight / size)
            keys.append(torch.cumsum(spacings / rates, 0))
            owner.append(torch.full((k,), s, dtype=torch.int64))
        first = torch.topk(torch.cat(keys), m.num_samples, largest=False, sorted=True).indices
        return torch.cat(owner)[first]

    def offsets(self, epoch: int) -> np.ndarray:
        """Samples drawn from each source before ``epoch``."""
        if epoch not in self._offsets:
            known = max(e for e in self._offsets if e <= epoch)
            counts = self._offsets[known].copy()
            for e in range(known, epoch):
                seq = self.source_sequence(e).numpy()
                counts += np.bincount(seq, minlength=len(counts))
            self._offsets[epoch] = counts
        return self._offsets[epoch]

    def _pass_order(self, source: int, number: int) -> torch.Tensor:
        size = self.mixture.sizes[source]
        if not self.shuffle:
            return torch.arange(size)
        return torch.randperm(size, generator=_generator(self.seed, "source", source, number))

    def epoch_order(self, epoch: int | None = None) -> torch.Tensor:
        """The concatenated index at each position of the epoch (same on every rank)."""
        epoch = self.epoch if epoch is None else epoch
        if epoch not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k >= epoch - 1}
            self._orders[epoch] = self._order(epoch)
        return self._orders[epoch]

    def _order(self, epoch: int) -> torch.Tensor:
        m = self.mixture
        seq = self.source_sequence(epoch)
        start = self.offsets(epoch) if m.replacement else np.zeros(len(m.sizes), np.int64)
        order = torch.empty(len(seq), dtype=torch.int64)
        for s, size in enumerate(m.sizes):
            where = torch.nonzero(seq == s).flatten()
            if not len(where):
                continue
            # the source's reading positions; a pass is one permutation of the source
            read = torch.arange(len(where), dtype=torch.int64) + int(start[s])
            passes = read // size if m.replacement else torch.full_like(read, epoch)
            local = torch.empty_like(read)
            for number in torch.unique(passes).tolist():
                hit = passes == number
                local[hit] = self._pass_order(s, number)[read[hit] % size]
            order[where] = local + int(m.starts[s])
        return order

    def source_counts(self, epoch: int, consumed: int) -> list[int]:
        """Samples drawn from each source before position ``consumed`` of ``epoch``."""
        seq = self.source_sequence(epoch)[:consumed].numpy()
        counts = self.offsets(epoch) + np.bincount(seq, minlength=len(self.mixture.sizes))
        return [int(c) for c in counts]

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        m = self.mixture
        state = super().state_dict()
        state["mixture"] = {
            "offsets": [int(c) for c in self.offsets(self.epoch)],
            "weights": list(m.weights),
            "sizes": list(m.sizes),
            "replacement": m.replacement,
            "names": list(m.names),
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("mixture")
        m = self.mixture
        if saved is None:
            raise ValueError(
                "the checkpoint's data position is for one training source, this run mixes "
                f"data.train.sources {m.names}; resume with the data it was trained on"
            )
        for key, now in (("sizes", m.sizes), ("replacement", m.replacement)):
            if saved[key] != now:
                raise ValueError(
                    f"data.train.sources: the checkpoint's mixture has {key} {saved[key]}, this "
                    f"run's {now}; the order would differ: resume with the same sources"
                )
        if not np.allclose(saved["weights"], m.weights, rtol=0, atol=1e-12):
            raise ValueError(
                f"data.train.sources: the checkpoint's mixture has weights {saved['weights']}, "
                f"this run's {m.weights}; the order would differ: resume with the same weights"
            )
        if state.get("num_samples", m.num_samples) != m.num_samples:
            raise ValueError(
                f"data.train.num_samples: the checkpoint's epoch is {state['num_samples']} "
                f"samples, this run's {m.num_samples}; resume with the same num_samples"
            )
        super().load_state_dict({k: v for k, v in state.items() if k != "mixture"})
        self._offsets = {0: np.zeros(len(m.sizes), np.int64)}
        self._offsets[self.epoch] = np.asarray(saved["offsets"], dtype=np.int64)
        self._orders = {}


def build_mixture(split: str, spec: Mapping[str, Any]) -> MixtureDataset:
    """The :class:`MixtureDataset` of a split config with ``sources`` (each entry's
    ``source`` already a dataset's source: a prepared storage, see ``connect``)."""
    entries = check_entries(split, spec["sources"], None)
    if "prepare" in spec or any(e.get("prepare") is not None for e in entries):
        raise ValueError(
            f"data.{split}: its sources have prepare: blocks; call "
            "connect(tokenizer_dir, data_dir) before the datasets are built"
        )
    num_samples, replacement = mixture_options(split, spec)
    base = {k: v for k, v in spec.items() if k not in MIXTURE_KEYS and k != "source"}
    datasets = [instantiate({**base, "source": e["source"]}, _convert_="all") for e in entries]
    return MixtureDataset(
        datasets,
        [float(e["weight"]) for e in entries],
        [e["name"] for e in entries],
        num_samples=num_samples,
        replacement=replacement,
        collate=datasets[0].collate,
    )


def prepare_sources(
    split: str,
    spec: dict[str, Any],
    dataset_kind: str | None,
    job: Callable[[str, Any, dict[str, Any], str], Any],
) -> dict[str, Any]:
    """Check ``spec["sources"]`` and bind each entry to its prepared storage.

    Each entry is prepared with the split's ``prepare:`` block updated by its own (``kind``
    defaults to the split's); ``job(kind, source, options, name)`` makes the cache entry
    (:func:`astrai.data.cache.prepared_source`) and each entry's ``source`` becomes its path.
    An entry with neither block is a storage already. Returns ``{"<split>.sources[i]": job}``.
    """
    if "source" in spec:
        raise ValueError(f"data.{split}: give either source or sources, not both")
    entries = check_entries(split, spec["sources"], dataset_kind)
    mixture_options(split, spec)
    shared = spec.pop("prepare", None)
    split_kind = (shared or {}).get("kind") or dataset_kind
    jobs: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        options = {**(shared or {}), **(entry.pop("prepare", None) or {})}
        if shared is None and "prepare" not in spec["sources"][i]:
            continue  # a prepared storage
        kind = entry.get("kind") or options.pop("kind", None) or split_kind
        options.pop("kind", None)
        if kind is None:
            raise ValueError(f"data.{split}.sources[{i}].kind: required, the dataset has no kind")
        source = entry["source"]
        if isinstance(source, Mapping) and "_target_" in source:
            source = instantiate(source, _convert_="all")  # records made in code
        name = f"{options.pop('name', split)}_{entry['name']}"
        jobs[f"{split}.sources[{i}]"] = prepared = job(kind, source, options, name)
        entry["source"] = prepared.path
    spec["sources"] = entries
    return jobs


def mixture_fingerprint(
    split: str, dataset: MixtureDataset, cache_dir: str | os.PathLike | None
) -> dict[str, Any]:
    """``{"<split>.sources[i]": fingerprint}``: each source's files, so a changed one is
    named by its entry."""
    return {
        f"{split}.sources[{i}]": dataset_fingerprint(part, cache_dir)
        for i, part in enumerate(dataset.datasets)
    }
