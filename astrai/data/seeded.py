"""`SeededSamples`: randomness inside a dataset that survives an interrupted epoch.

A dataset's `__getitem__` may draw random numbers (augmentation, random crops, masking).
It runs in a worker process, or, with no workers, while Lightning prefetches the next batch:
either way outside the training step, so the RNG state a checkpoint captures does not cover
it, and a resumed epoch would draw other values. The training loader therefore fetches
every sample with Python's `random`, NumPy's global generator and torch's CPU generator
seeded from (seed, epoch, index), and puts the caller's states back afterwards: a sample
gets the same random numbers whether its epoch ran through or was resumed, with any number
of workers, and fetching never moves the main process's stream that dropout draws from.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["SeededSamples"]


class SeededSamples(Dataset):
    """`dataset` whose sample `index` of epoch `epoch` is fetched under seeded RNGs."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = int(seed)
        # shared memory: persistent workers see the epoch the main process sets
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(int(epoch))

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def sample_seed(self, index: int) -> int:
        """A 63-bit seed from (seed, epoch, index), the same in every process."""
        key = f"{self.seed}:{int(self.epoch)}:{int(index)}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1

    def __getitem__(self, index: int) -> Any:
        seed = self.sample_seed(index)
        python_state, numpy_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            try:
                return self.dataset[index]
            finally:
                random.setstate(python_state)
                np.random.set_state(numpy_state)
