"""What the engine's KV pool is before any request: its bytes (kv_budget: given, 1 GiB on CPU, or what the GPU's
memory utilization leaves) and the identity its blocks are hashed under (model_fingerprint: anything that changes
the KV of a prefix changes it, so no cached or persisted block is ever read by another model or configuration)."""

from __future__ import annotations

import hashlib
import json

import torch

from kvforge.core.config import CPU_KV_CACHE_BYTES, EngineConfig
from kvforge.core.kv.quant import kv_format
from kvforge.core.loader import weight_files
from kvforge.core.metrics import available_memory_bytes
from kvforge.core.runner_api import Runner
from kvforge.core.tokenizer import Tokenizer


def kv_budget(config: EngineConfig, runner: Runner, max_model_len: int) -> int:
    """The KV pools' bytes: kv_cache_bytes when given; on CPU 1 GiB; on CUDA what gpu_memory_utilization leaves after
    the weights and a profiling forward's peak (core/gpu_memory.py)."""
    if runner.device.type != "cuda":
        budget = config.kv_cache_bytes or CPU_KV_CACHE_BYTES
        available = available_memory_bytes()
        if available is not None and budget > available:  # refused, not left to the kernel's OOM killer
            raise ValueError(f"the KV cache budget of {budget / (1 << 30):.2f} GiB is more than the "
                             f"{available / (1 << 30):.2f} GiB of memory available; lower kv_cache_gb")
        return budget
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    from kvforge.core import gpu_memory

    if config.tp_size > 1:  # the ranks' models live in other processes: size from what is free now
        free, total = torch.cuda.mem_get_info(runner.device)
        return gpu_memory.kv_cache_budget(total, config.gpu_memory_utilization, total - free, 0)
    return gpu_memory.measure_kv_budget(runner, config.gpu_memory_utilization, config.max_num_batched_tokens,
                                        config.max_num_seqs, max_model_len)


def model_fingerprint(config: EngineConfig, model_path, tokenizer: Tokenizer) -> bytes:
    """Root of every block hash: anything that changes the KV of a prefix changes it."""
    weights = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in weight_files(model_path)]
    identity = {
        "weights": weights, "config": (model_path / "config.json").read_text(),
        "dtype": str(config.torch_dtype), "quant": config.quant, "quant_options": config.quant_options,
        # a quantized pool's format and layout by name (a block written in one is never read as another); the model's
        # dtype else
        "kv_dtype": str(config.torch_dtype) if config.kv_cache_dtype == "auto" else kv_format(
            config.kv_cache_dtype).stored_as,
        "block_size": config.block_size, "tp_size": config.tp_size, "tokenizer": tokenizer.fingerprint(),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).digest()[:16]
