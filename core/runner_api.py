"""The runner interface the engine drives: one rank's `ModelRunner`, the tensor-parallel `ParallelRunner` and the
pipeline-parallel `PipelineRunner` implement it, so the engine never knows which one it holds.

A step is launched with `submit` and its output read with `collect`; up to `max_in_flight` steps may be launched
before the oldest is collected (1: `submit` runs the step whole; a pipeline: one per stage)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch import nn

    from kvforge.core.kv.quant import KVFormat
    from kvforge.core.runner import StagePlacement, StepInputs, StepOutput
    from kvforge.core.step import ScheduledSeq


class Runner(Protocol):
    device: torch.device
    kernels: str  # the attention / norm kernels: "triton" | "torch"
    block_size: int
    kv_bytes_per_block: int  # one KV block of every layer, on this process's rank
    kv_block_shape: tuple[int, ...]  # one block of every layer with all KV heads (the persisted tier's unit)
    kv_dtype: torch.dtype  # the pool's elements: the model's dtype, or uint8 for a quantized format's rows
    kv_format: KVFormat | None  # the quantized format the pool stores (core/kv/quant.py), None: full precision
    cuda_graph_safe: bool
    graphs: object | None  # the captured decode graphs, once enabled
    kernel_choices: list  # core/kernel_choice.py ShapeChoice per op class and shape: the kernel each runs
    gguf_weights: str | None  # a GGUF's blocks "copied" onto huge pages or "mapped" from the file; None: not a GGUF
    max_in_flight: int  # steps launched before the oldest must be collected
    failure: str | None  # why the runner can no longer run (a tensor-parallel rank died), or None
    on_failure: Callable[[], None] | None  # called (from any thread) when it fails while idle

    @property
    def model(self) -> nn.Module: ...
    @property
    def kv_cache_bytes(self) -> int: ...
    def weight_bytes(self) -> int: ...
    def placement(self) -> list[StagePlacement]: ...  # where each part of the model lives, stage by stage
    def allocate_kv(self, num_blocks: int) -> None: ...
    def enable_decode_graphs(self, max_model_len: int, max_batch: int, capture: bool = True) -> None: ...
    def layout(self, batch: list[ScheduledSeq], all_logits: bool = False) -> StepInputs: ...
    def forward(self, inputs: StepInputs) -> StepOutput: ...
    def execute(self, batch: list[ScheduledSeq]) -> StepOutput: ...
    def submit(self, batch: list[ScheduledSeq]) -> Any: ...
    def collect(self, launched: Any) -> StepOutput: ...
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...
    def read_block(self, block: int) -> torch.Tensor: ...
    def write_block(self, block: int, data: torch.Tensor) -> None: ...
    def close(self) -> None: ...
