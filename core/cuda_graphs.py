"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with the step's inputs copied
into static buffers (padded rows: slot -1, context length 0, so they write no KV and read none).

A decode step of n sequences runs the graph of the smallest bucket >= n; the LM head runs eagerly on
the n real rows. Captured once, after the KV pool exists (graphs bake in its address). Only the Triton
kernels are captured: they take their work sizes from device tensors, never from the host.

On CPU (tests, under TRITON_INTERPRET=1) `capture=False` keeps the same static buffers and padding but
runs the model eagerly on them, so the padding logic is tested without a GPU.
"""

from __future__ import annotations

import logging

import torch

from kvforge.core.context import KernelBatch, StepContext, set_context
from kvforge.core.kv.quant import KVFormat

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def bucket_sizes(max_batch: int) -> list[int]:
    """The captured batch sizes: BUCKETS up to max_batch, and max_batch itself."""
    sizes = [b for b in BUCKETS if b < max_batch]
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, max_model_len: int,
                 max_batch: int, capture: bool = True, kv_format: KVFormat | None = None) -> None:
        self.model, self.kv_cache, self.kv_format = model, kv_cache, kv_format
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        device = kv_cache.device
        width = -(-max_model_len // block_size)  # block-table columns: the longest context allowed
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.slots = torch.full((self.max_batch,), -1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(self.max_batch, width, dtype=torch.int32, device=device)
        self.no_prefill = torch.zeros(1, dtype=torch.int32, device=device)  # query_start_loc [0]: no chunks
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _context(self, size: int) -> StepContext:
        none = self.no_prefill
        batch = KernelBatch(self.slots[:size], size, self.block_tables[:size], self.context_lens[:size],
                            none[:0].view(0, 0), none, none[:0], 0)
        return StepContext(self.positions[:size], self.kv_cache, kernel=batch, kv_format=self.kv_format)

    def _run(self, size: int) -> torch.Tensor:
        set_context(self._context(size))
        try:
            return self.model(self.input_ids[:size], self.positions[:size])
        finally:
            set_context(None)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            self._run(size)  # warm up (Triton compiles, cuBLAS picks its kernels) outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._run(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.max_batch

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step of n = len(input_ids) sequences."""
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        width = max(map(len, tables))
        host = torch.zeros(4 + width, size, dtype=torch.long)  # one host buffer: ids, positions, slots, lens, tables
        host[0, :n] = torch.tensor(input_ids)
        host[1, :n] = torch.tensor(positions)
        host[2].fill_(-1)
        host[2, :n] = torch.tensor(slots)
        host[3, :n] = torch.tensor(context_lens)
        host[4:, :n] = torch.tensor([t + [0] * (width - len(t)) for t in tables]).T
        host = host.to(self.kv_cache.device)
        self.input_ids[:size].copy_(host[0])
        self.positions[:size].copy_(host[1])
        self.slots[:size].copy_(host[2])
        self.context_lens[:size].copy_(host[3])
        self.block_tables[:size, :width].copy_(host[4:].T)
        if self.capture:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._run(size)[:n]
