"""LightningDataModule that prepares its own data and checkpoints the position in it.

Preparation follows litgpt's ``DataModule.connect``: the runner calls
``connect(tokenizer_dir, data_dir)`` once the tokenizer exists; every dataset spec with a
``prepare:`` block then points at its folder in the prepared-data cache
(:mod:`astrai.data.cache`), and Lightning's ``prepare_data`` hook (local rank 0; the other
ranks wait) tokenizes into it. ``setup`` on every rank opens the same, deterministic path.

Lightning saves ``datamodule.state_dict()`` in every checkpoint and calls ``load_state_dict``
when resuming (``trainer.fit(..., ckpt_path=...)``), before it builds the dataloaders. The state
is the :class:`ResumableSampler` position counted in samples the training loop actually
*received*: Lightning fetches one batch ahead and workers prefetch several, so counting drawn
indices would skip data on resume. Under a trainer the count is taken in
``on_before_batch_transfer`` (called once per batch handed to ``training_step``); without one,
the dataloader's iterator counts the batches it yields. The state also holds the content
fingerprint of every split's files (:mod:`astrai.data.fingerprint`): resuming on data that
changed is refused before the first step, naming the split and the files.

Lightning runs only one implementation of each batch-transfer hook: if the LightningModule
also overrides ``on_before_batch_transfer``, the datamodule's wins (Lightning warns). Put batch
transforms in ``on_after_batch_transfer`` or ``training_step`` instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset

from astrai.data.budget import DEFAULT_MAX_TOKENS, training_batches
from astrai.data.cache import PreparedSource, prepared_source
from astrai.data.datasets import PretrainDataset, SFTDataset
from astrai.data.fingerprint import DataChangedError, data_changes, dataset_fingerprint
from astrai.data.flatten import PaddingFree
from astrai.data.mixture import (
    MixtureDataset,
    MixtureSampler,
    build_mixture,
    mixture_fingerprint,
    prepare_sources,
)
from astrai.data.sampler import BatchConsumer, BatchReuse, ResumableSampler
from astrai.data.seeded import SeededSamples
from astrai.data.storage.h5 import DamagedDataError
from astrai.data.train_loader import TrainLoader, with_upcoming  # noqa: F401 (its old home)
from astrai.tokenizer import AutoTokenizer

log = logging.getLogger(__name__)


class AstraiDataModule(L.LightningDataModule):
    """Train / val / test datasets with a resumable, rank-sharded training order.

    Args:
        train, val, test: a ``Dataset``, or a config mapping with ``_target_`` (instantiated
            with Hydra in ``setup``; a ``prepare:`` block in it is run by ``prepare_data``,
            after ``connect``), or ``None``. ``train`` may list ``sources`` instead of one
            ``source``: a weighted mixture (:mod:`astrai.data.mixture`).
        batch_size: per-rank batch size; ``val_batch_size`` defaults to it.
        num_workers, pin_memory, persistent_workers, prefetch_factor: passed to DataLoader.
        seed, shuffle: the training order (see :class:`ResumableSampler`).
        drop_last: drop incomplete training batches (and the uneven tail across ranks).
        collate_fn: overrides the datasets' own ``collate``.
        allow_changed_data: resume even when a split's files differ from the ones the
            checkpoint was trained on (a warning instead of :class:`DataChangedError`); the
            saved position then indexes into the new data, which must have as many samples.
        padding_free: pretrain and SFT batches as one row of their samples' real tokens,
            position ids restarting per sample and document (TRL's name;
            :mod:`astrai.data.flatten`): no pad token is computed, same loss.
        use_dynamic_bsz, max_token_len_per_gpu: training batches of whole samples holding at
            most ``max_token_len_per_gpu`` tokens each (verl's names; needs ``padding_free``;
            :mod:`astrai.data.budget`) instead of ``batch_size`` samples.
    """

    def __init__(
        self,
        train: Dataset | Mapping[str, Any] | None = None,
        val: Dataset | Mapping[str, Any] | None = None,
        test: Dataset | Mapping[str, Any] | None = None,
        *,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        allow_changed_data: bool = False,
        padding_free: bool = False,
        use_dynamic_bsz: bool = False,
        max_token_len_per_gpu: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"AstraiDataModule: batch_size must be >= 1, got {batch_size}")
        if not isinstance(padding_free, bool):
            raise ValueError(f"data.padding_free must be true or false, got {padding_free!r}")
        self.padding_free = padding_free
        self.batching = training_batches(padding_free, use_dynamic_bsz, max_token_len_per_gpu)
        self.specs = {split: _own(spec) for split, spec in zip(SPLITS, (train, val, test))}
        self.prepared: dict[str, PreparedSource] = {}
        self.tokenizer_dir: Path | None = None
        self._data_prepared = False
        self.datasets: dict[str, Dataset | None] = {}
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.prefetch_factor = prefetch_factor
        self.collate_fn = collate_fn
        self.allow_changed_data = allow_changed_data
        self.data_dir: Path | None = None
        self._fingerprint: dict[str, Any] | None = None
        self._saved_fingerprint: dict[str, Any] | None = None
        self._warned_unchecked = False
        self.sampler: ResumableSampler | None = None
        self._pending_state: dict[str, Any] | None = None
        self._start_consumed = 0
        self._delivered_batches = 0
        self._iter_epoch = 0
        # Set from the LightningModule's `batch_reuse` when the training loader is built.
        self.reuse = BatchReuse()
        self._saved_reuse: BatchReuse | None = None  # the reuse a loaded position was saved with
        # Steps that had received the first batch of this iteration before it started (a run
        # resumed in the middle of a reused batch).
        self.repeats_done = 0

    # -- preparation --------------------------------------------------------------------------
    def connect(self, tokenizer_dir: str | os.PathLike, data_dir: str | os.PathLike) -> None:
        """Bind the run's tokenizer and prepared-data cache; call before ``trainer.fit``.

        Every dataset spec gets ``tokenizer_fingerprint`` (unless set), so opening a storage
        built with another tokenizer fails. A spec with ``prepare:`` gets as ``source`` its
        folder in ``data_dir``'s cache, a hash of the spec and the tokenizer: every rank
        computes the same path here, and only ``prepare_data`` writes it. The kind is the
        dataset class's ``kind`` unless ``prepare.kind`` says otherwise. A ``source`` with a
        ``_target_`` is a record source (:class:`astrai.data.OnPolicyPairs`): instantiated
        here, its records are made and tokenized by ``prepare_data``.
        """
        self.tokenizer_dir = Path(tokenizer_dir)
        self.data_dir = Path(data_dir)
        fingerprint = AutoTokenizer.from_pretrained(self.tokenizer_dir).fingerprint
        for split, spec in self.specs.items():
            if not isinstance(spec, dict):
                continue
            if "sources" in spec:  # a mixture (astrai.data.mixture): a job per source

                def job(kind: str, source: Any, options: dict, name: str) -> PreparedSource:
                    return prepared_source(
                        kind, source, options, fingerprint=fingerprint, data_dir=data_dir, name=name
                    )

                self.prepared.update(prepare_sources(split, spec, _dataset_kind(spec), job))
                spec.setdefault("tokenizer_fingerprint", fingerprint)
                continue
            options = spec.pop("prepare", None)
            if options is not None:
                options = dict(options)
                kind = options.pop("kind", None) or _dataset_kind(spec)
                if kind is None:
                    target = spec.get("_target_") or "the dataset"
                    raise ValueError(f"data.{split}.prepare.kind: required, {target} has no kind")
                source = spec["source"]
                if isinstance(source, Mapping) and "_target_" in source:
                    # records made in code (e.g. astrai.data.OnPolicyPairs), prepared like a file
                    source = instantiate(source, _convert_="all")
                job = prepared_source(
                    kind,
                    source,
                    options,
                    fingerprint=fingerprint,
                    data_dir=data_dir,
                    name=split,
                )
                self.prepared[split] = job
                spec["source"] = job.path
            spec.setdefault("tokenizer_fingerprint", fingerprint)

    def prepare_data(self) -> None:
        """Tokenize every ``prepare:`` split into the cache (Lightning calls this on local
        rank 0 while the other ranks wait; a file lock keeps concurrent runs apart)."""
        for split, job in self.prepared.items():
            result = job.run(self.tokenizer_dir)
            log.info("data.%s: %s", split, result.path)
        self._data_prepared = True

    # -- datasets -----------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.prepared and not self._data_prepared and self._trainer_or_none() is None:
            self.prepare_data()  # no Trainer to call the hook: a single process does it here
        for split, spec in self.specs.items():
            if split not in self.datasets:
                self.datasets[split] = self._build(split, spec)
        if stage == "fit":  # hash the files now, not at the first checkpoint mid-training
            self.data_fingerprint()
        self._check_data()
        self._check_padding_free()
        self.batching.check(self.datasets.get("train"))

    def _check_padding_free(self) -> None:
        if not self.padding_free:
            return
        for split, ds in self.datasets.items():
            if isinstance(ds, MixtureDataset):
                ds = ds.datasets[0]
            if ds is not None and not isinstance(ds, PretrainDataset | SFTDataset):
                raise ValueError(
                    f"data.padding_free flattens pretrain and SFT batches; data.{split} is a "
                    f"{type(ds).__name__} (preference strategies: strategy.padding_free)"
                )

    @staticmethod
    def _build(split: str, spec: Any) -> Dataset | None:
        if spec is None or isinstance(spec, Dataset):
            return spec
        if isinstance(spec, Mapping):
            if "sources" in spec:
                return build_mixture(split, spec)
            if "prepare" in spec:
                raise ValueError(
                    f"data.{split}: has a prepare: block; call "
                    f"connect(tokenizer_dir, data_dir) before the datasets are built"
                )
            return instantiate(spec, _convert_="all")
        if callable(spec):
            return spec()
        raise TypeError(f"AstraiDataModule: cannot build a dataset from {type(spec).__name__}")

    def _dataset(self, split: str) -> Dataset:
        if split not in self.datasets:
            self.setup()
        ds = self.datasets.get(split)
        if ds is None:
            raise ValueError(f"AstraiDataModule: no {split!r} dataset configured")
        return ds

    def _collate(self, ds: Dataset) -> Callable[[list[Any]], Any] | None:
        collate = self.collate_fn or getattr(ds, "collate", None)
        if self.padding_free and collate is not None:
            return PaddingFree(collate)
        return collate

    def _rank_world(self) -> tuple[int, int]:
        trainer = self._trainer_or_none()
        if trainer is None:
            return 0, 1
        # the data-parallel rank and size (tensor-parallel ranks read the same batches)
        shard = trainer.distributed_sampler_kwargs if isinstance(trainer, L.Trainer) else None
        if shard:
            return int(shard["rank"]), int(shard["num_replicas"])
        return int(trainer.global_rank), int(trainer.world_size)

    def _trainer_or_none(self) -> Any:
        return getattr(self, "trainer", None)

    def loader_seed(self, epoch: int) -> int:
        """The seed of a loader's own generator for `epoch` (-1: validation and test)."""
        return (self.seed * 1_000_003 + epoch + 1) % 2**63

    def _loader_kwargs(self, epoch: int) -> dict[str, Any]:
        # Every loader has a generator of its own: creating an iterator draws the workers'
        # base seed from it, where without one it would draw from the global torch RNG and
        # so shift the stream that dropout and sampling in the training step consume.
        kwargs: dict[str, Any] = {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers,
            "generator": torch.Generator().manual_seed(self.loader_seed(epoch)),
        }
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs

    # -- dataloaders --------------------------------------------------------------------------
    def train_sampler(self) -> ResumableSampler:
        """The training sampler for this rank, created once (re-created if ranks change)."""
        ds = self._dataset("train")
        rank, world = self._rank_world()
        s = self.sampler
        if s is None or s.rank != rank or s.world_size != world:
            state = self._position() if s is not None else None
            options = {"seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}
            if isinstance(ds, MixtureDataset):
                s = ds.sampler(rank=rank, world_size=world, **options)
            else:
                s = self.batching.sampler(ds, rank=rank, world_size=world, **options)
            if state is not None:
                s.load_state_dict(state)
            self.sampler = s
        if self._pending_state is not None:
            s.load_state_dict(self._pending_state)
            self._pending_state = None
        return s

    def train_dataloader(self) -> DataLoader:
        ds = self._dataset("train")
        consumer = self._consumer()
        self._set_reuse(consumer.batch_reuse)
        loader = TrainLoader(
            **self.batching.loader_options(
                SeededSamples(ds, self.seed), self.batch_size, self.drop_last, self.reuse
            ),
            sampler=self.train_sampler(),
            collate_fn=self._collate(ds),
            datamodule=self,
            repeat=self.reuse.repeat,
            lookahead=int(consumer.batch_lookahead),
            **self._loader_kwargs(self.train_sampler().epoch),
        )
        return loader

    def _consumer(self) -> BatchConsumer:
        """The trainer's module as a `BatchConsumer` (`LMModule` declares its batch reuse and
        lookahead; any other module, or none, reuses nothing)."""
        trainer = self._trainer_or_none()
        module = trainer.lightning_module if trainer is not None else None
        return module if isinstance(module, BatchConsumer) else BatchConsumer()

    def _set_reuse(self, reuse: BatchReuse) -> None:
        """Adopt the module's `BatchReuse`; a resumed position saved under another one would
        continue on the wrong samples, so it is refused."""
        saved = self._saved_reuse
        if saved is not None and saved != reuse:
            raise ValueError(
                f"the checkpoint's data position is for loader batches of {saved.group} x "
                f"batch_size samples, each used by {saved.repeat} steps, but this run uses "
                f"{reuse.group} x batch_size and {reuse.repeat} (GRPO: strategy."
                f"steps_per_generation and strategy.num_iterations); resume with the same "
                f"settings, or start a new run from the checkpoint's export (init_from)"
            )
        self.reuse = reuse

    def _eval_loader(self, split: str) -> DataLoader | list:
        if split not in self.datasets:
            self.setup()
        ds = self.datasets.get(split)
        if ds is None:  # Lightning skips the loop on an empty list
            log.info("no %s dataset configured; skipping %s", split, split)
            return []
        return DataLoader(
            ds,
            batch_size=self.val_batch_size,
            shuffle=False,
            collate_fn=self._collate(ds),
            **self._loader_kwargs(-1),
        )

    def val_dataloader(self) -> DataLoader | list:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader | list:
        return self._eval_loader("test")

    # -- position tracking --------------------------------------------------------------------
    def start_train_iteration(self) -> None:
        """The training loader starts iterating (an epoch, or the rest of one)."""
        assert self.sampler is not None
        s = self.sampler
        if self._iter_epoch == s.epoch:
            # a previous iteration of this epoch stopped early: continue after what it yielded,
            # not after what its workers had prefetched
            position = self._position()
            s.consumed = position["consumed"]
            repeats = position.get("repeats", 0)
        else:
            repeats = 0
        if s.consumed >= s.num_samples_total:  # the sampler will move to the next epoch
            s.start_epoch(s.epoch + 1)
            repeats = 0
        self.repeats_done = repeats
        self._iter_epoch = s.epoch
        self._start_consumed = s.consumed
        self._delivered_batches = 0
        counts = self.source_counts()
        if counts and self._rank_world()[0] == 0:
            shown = ", ".join(f"{name} {n}" for name, n in counts.items())
            log.info(
                "data.train.sources at epoch %d, sample %d: %s so far", s.epoch, s.consumed, shown
            )

    def loader_yielded_batch(self) -> None:
        """The training loader yielded a batch: counted here only without a trainer (under
        one, ``on_before_batch_transfer`` counts the batches ``training_step`` receives)."""
        if self._trainer_or_none() is None:
            self._delivered_batches += 1

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self._trainer_or_none()
        if trainer is not None and trainer.training:
            self._delivered_batches += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Position in the training data: ``{"epoch", "consumed", "seed", "world_size",
        "num_samples"}``, ``consumed`` in samples of the epoch received by all ranks; and,
        once the datasets exist, ``fingerprint``: :meth:`data_fingerprint`."""
        state = self._position()
        if self.datasets:
            state["fingerprint"] = self.data_fingerprint()
        return state

    def source_counts(self) -> dict[str, int]:
        """Samples of each ``data.train.sources`` entry the training loop received so far
        (all ranks, since the run's start); empty without a mixture."""
        s = self.sampler
        if not isinstance(s, MixtureSampler):
            return {}
        state = self._position()
        counts = s.source_counts(int(state["epoch"]), int(state["consumed"]))
        return dict(zip(s.mixture.names, counts))

    def data_fingerprint(self) -> dict[str, Any]:
        """``{split: [{"file", "bytes", "digest"}, ...] | None}``: the content of the files
        every split reads (``None`` for a dataset without files), computed once."""
        if self._fingerprint is None:
            if not self.datasets:
                self.setup()
            cache = self.data_dir / "fingerprints" if self.data_dir is not None else None
            fingerprint = {}
            for split, ds in self.datasets.items():
                try:
                    if isinstance(ds, MixtureDataset):  # each source by its entry
                        fingerprint.update(mixture_fingerprint(split, ds, cache))
                        continue
                    fingerprint[split] = dataset_fingerprint(ds, cache)
                except DamagedDataError as err:  # the file's stored checksum: name the split too
                    raise DamagedDataError(f"data.{split}: {err}") from None
            self._fingerprint = fingerprint
        return self._fingerprint

    def _check_data(self) -> None:
        """Compare the loaded checkpoint's fingerprint with the data (once both are known)."""
        saved = self._saved_fingerprint
        if saved is None or not self.datasets:
            return
        self._saved_fingerprint = None
        changes = data_changes(saved, self.data_fingerprint())
        if not changes:
            return
        lines = [f"data.{split}: {line}" for split, found in changes.items() for line in found]
        what = "\n  ".join(lines)
        if self.allow_changed_data:
            log.warning(
                "resuming on data that changed since the checkpoint (data.allow_changed_data=true):"
                "\n  %s",
                what,
            )
            return
        raise DataChangedError(
            f"the checkpoint was trained on other data than this run reads:\n  {what}\n"
            "Resumed, its data position would continue on different samples. Start a fresh "
            "run (no ckpt_path), put back the data the checkpoint was trained on, or resume on "
            "this data anyway with allow_changed_data=true (on the command line: "
            "+data.allow_changed_data=true)."
        )

    def _position(self) -> dict[str, Any]:
        if self.sampler is None:
            state = dict(self._pending_state or {})
            saved = self._saved_reuse
            if self.repeats_done or (saved is not None and saved != BatchReuse()):
                saved = saved or BatchReuse()
                state["reuse"] = [saved.group, saved.repeat]
                state["repeats"] = self.repeats_done
            return state
        s = self.sampler
        state = s.state_dict()
        reuse = self.reuse
        repeats = self.repeats_done
        if self._iter_epoch == s.epoch:
            steps = self.repeats_done + self._delivered_batches
            batches, repeats = divmod(steps, reuse.repeat)
            per_batch = self.batch_size * reuse.group
            state["consumed"] = s.consumed_after(self._start_consumed, batches, per_batch)
        if reuse != BatchReuse() or repeats:
            state["reuse"] = [reuse.group, reuse.repeat]
            state["repeats"] = repeats
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the first sample not yet received (applied when the sampler is built)."""
        if not state_dict:
            return
        state_dict = dict(state_dict)
        if "fingerprint" in state_dict:
            self._saved_fingerprint = state_dict.pop("fingerprint")
            self._check_data()
        elif not self._warned_unchecked:  # (Lightning loads the state twice: warn once)
            self._warned_unchecked = True
            log.warning(
                "the checkpoint's data state has no fingerprint (written by an older astrai): "
                "cannot check that this run reads the data it was trained on"
            )
        reuse = state_dict.pop("reuse", None)
        self._saved_reuse = BatchReuse(*reuse) if reuse is not None else BatchReuse()
        self.repeats_done = int(state_dict.pop("repeats", 0))
        self._pending_state = state_dict
        self._delivered_batches = 0
        self._start_consumed = int(state_dict.get("consumed", 0))
        self._iter_epoch = int(state_dict.get("epoch", 0))
        if self.sampler is not None:
            self.train_sampler()
        log.info(
            "data position restored: epoch %s, %s samples consumed",
            state_dict.get("epoch"),
            state_dict.get("consumed"),
        )


SPLITS = ("train", "val", "test")


def _own(spec: Any) -> Any:
    """A private copy of a config mapping (``connect`` sets its top-level keys and copies the
    ``prepare`` block before editing it); datasets and factories as given."""
    if OmegaConf.is_config(spec):
        return OmegaConf.to_container(spec, resolve=True)
    if isinstance(spec, Mapping):
        return dict(spec)
    return spec


def _dataset_kind(spec: Mapping[str, Any]) -> str | None:
    """The ``kind`` of the dataset class a spec instantiates (``PretrainDataset.kind``)."""
    target = spec.get("_target_")
    return getattr(get_class(target), "kind", None) if target else None
