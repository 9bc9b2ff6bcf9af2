"""Decode through captured graphs: CUDA graphs on a GPU, a faithful stand-in on the CPU.

A decode step's inputs all live in the `InferenceWorkspace` at fixed addresses, so the
forward can be captured once per batch size (1, 2, 4, 8, 16, ... up to the maximum) and
replayed. A batch is padded to the nearest captured size (padded rows write only the
scratch KV slot); larger batches run eagerly. Capture needs an attention backend that
reads every length from the device (Triton): it is selected strictly while capturing.
The stand-in runner "captures" by binding the same static buffers once and "replays" by
running the forward on them, which tests the padding and buffer logic without a GPU.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from astrai.extension import attn_backend
from astrai.inference.workspace import InferenceWorkspace
from astrai.model import Transformer

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, ... below `max_batch_size`, and `max_batch_size` itself."""
    sizes, n = [], 1
    while n < max_batch_size:
        sizes.append(n)
        n *= 2
    return [*sizes, max_batch_size]


class DecodeGraphRunner(ABC):
    """Runs the decode forward for a workspace already prepared for `padded` rows."""

    def __init__(
        self, model: Transformer, workspace: InferenceWorkspace, batch_sizes: list[int]
    ) -> None:
        self.model = model
        self.workspace = workspace
        self.batch_sizes = sorted(batch_sizes)
        self.max_position = workspace.pool.max_seq_len - 1

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def padded_size(self, batch: int) -> int | None:
        """The captured size a batch of `batch` rows runs at, or None (run eagerly)."""
        for size in self.batch_sizes:
            if size >= batch:
                return size
        return None

    def _forward(self, size: int) -> torch.Tensor:
        ws = self.workspace
        kv = ws.kv_cache(size, ws.pool.max_seq_len)
        return self.model.forward_packed(
            ws.input_ids[:size], ws.positions[:size], kv, max_position=self.max_position
        )

    def _dummy_prepare(self, size: int) -> None:
        ws = self.workspace
        ws.prepare([ws.pad_row], [1], [0], size)
        ws.last_rows = None

    @abstractmethod
    def run(self, padded: int, batch: int) -> torch.Tensor:
        """Logits `[batch, vocab]` of the first `batch` (real) rows."""


class CUDAGraphRunner(DecodeGraphRunner):
    """One CUDA graph per batch size, sharing one memory pool (largest captured first)."""

    def __init__(
        self, model: Transformer, workspace: InferenceWorkspace, batch_sizes: list[int]
    ) -> None:
        super().__init__(model, workspace, batch_sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        with torch.inference_mode(), attn_backend("triton"):
            for size in sorted(self.batch_sizes, reverse=True):
                self._dummy_prepare(size)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._forward(size)  # warm-up: compiles kernels outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def run(self, padded: int, batch: int) -> torch.Tensor:
        self.graphs[padded].replay()
        return self.outputs[padded][:batch]


class StandInGraphRunner(DecodeGraphRunner):
    """CPU stand-in: replays the decode forward on the workspace's static buffers.

    `backend` is the attention backend used while "replaying" (Triton under the interpreter
    for a faithful test; any backend that reads lengths from the device tensors works).
    """

    def __init__(
        self,
        model: Transformer,
        workspace: InferenceWorkspace,
        batch_sizes: list[int],
        backend: str | None = "triton",
    ) -> None:
        super().__init__(model, workspace, batch_sizes)
        self.backend = backend
        self.replays: dict[int, int] = dict.fromkeys(self.batch_sizes, 0)

    def run(self, padded: int, batch: int) -> torch.Tensor:
        if padded not in self.replays:
            raise ValueError(f"batch size {padded} was not captured ({self.batch_sizes})")
        self.replays[padded] += 1
        with attn_backend(self.backend):
            return self._forward(padded)[:batch]
