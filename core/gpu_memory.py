"""Sizing the KV pool on a GPU from `gpu_memory_utilization`, after a profiling forward.

kvforge may use `utilization x total` bytes of the device. Out of that come the weights, the peak
activations of the largest step the scheduler can build (max_num_batched_tokens tokens, logits for
max_num_seqs rows) and memory outside torch's allocator (the CUDA context, cuBLAS workspaces); the KV
pool gets the rest. The peak is measured, not estimated: one forward over a batch of that size.
"""

from __future__ import annotations

import logging

import torch

from kvforge.core.runner import ModelRunner, StepInputs

log = logging.getLogger(__name__)

GIB = 1 << 30


def profile_inputs(max_tokens: int, max_seqs: int, max_model_len: int, block_size: int) -> tuple[StepInputs, int]:
    """The largest step the scheduler can build: `max_tokens` new tokens as fresh prompts of at most
    `max_model_len` tokens, over consecutive pool blocks, with logits for up to `max_seqs` rows.
    Returns the inputs and the number of KV blocks they use."""
    inputs = StepInputs([], [], [], [], [], [])
    block, row = 0, 0
    while row < max_tokens:
        length = min(max_model_len, max_tokens - row)
        blocks = -(-length // block_size)
        table = list(range(block, block + blocks))
        inputs.input_ids.extend([0] * length)
        inputs.positions.extend(range(length))
        inputs.slots.extend(block * block_size + p for p in range(length))
        inputs.prefills.append((row, row + length, length, table))
        block, row = block + blocks, row + length
    inputs.logits_rows = list(range(min(max_seqs, row)))
    return inputs, block


def kv_cache_budget(total: int, utilization: float, peak_torch: int, non_torch: int) -> int:
    """Bytes left for the KV pool(s): utilization x total, less the torch peak (weights + activations)
    and what the process holds outside torch's allocator. ValueError when nothing is left."""
    allowed = int(total * utilization)
    budget = allowed - peak_torch - non_torch
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} allows {allowed / GIB:.2f} GiB of the device's {total / GIB:.2f} "
            f"GiB, but the model's weights and activations take {peak_torch / GIB:.2f} GiB (and {non_torch / GIB:.2f} "
            f"GiB outside torch): no room is left for the KV cache -- raise gpu_memory_utilization, lower "
            f"max_num_batched_tokens, or quantize the model")
    return budget


@torch.inference_mode()
def measure_kv_budget(runner: ModelRunner, utilization: float, max_tokens: int, max_seqs: int,
                      max_model_len: int) -> int:
    """Run the profiling forward on the runner's CUDA device and return the KV budget in bytes."""
    device = runner.device
    inputs, blocks = profile_inputs(max_tokens, max_seqs, max_model_len, runner.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner.allocate_kv(blocks)
    profile_pool = runner.kv_cache_bytes
    runner.forward(inputs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - profile_pool
    runner.allocate_kv(0)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    budget = kv_cache_budget(total, utilization, peak, non_torch)
    log.info("KV budget %.2f GiB: %.0f%% of %.2f GiB, less %.2f GiB peak (weights + activations) and %.2f GiB "
             "outside torch", budget / GIB, utilization * 100, total / GIB, peak / GIB, non_torch / GIB)
    return budget
