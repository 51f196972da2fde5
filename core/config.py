"""Every engine knob and its default, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}

KERNELS = ("auto", "triton", "torch")
CPU_KV_CACHE_BYTES = 1 << 30  # the CPU pool's default budget


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded default model
    dtype: str = "float32"  # float32 | bfloat16 | float16 (and the short names fp32, bf16, fp16)
    quant: str = "none"  # a `kvforge.quant` plugin name
    quant_options: dict[str, Any] = field(default_factory=dict)
    decoding: str = "none"  # a `kvforge.decoding` plugin name (speculative decoding); "none": off
    decoding_options: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"  # rank 0's device under tensor parallelism (rank r: cuda:<local rank>)
    tp_size: int = 1  # tensor-parallel ranks, one process each; every rank holds 1/tp_size of the weights and KV
    block_size: int = 16  # tokens per KV block
    # KV pool budget; ignored when num_kv_blocks is set. None: 1 GiB on CPU; on CUDA what
    # gpu_memory_utilization leaves after the weights and a profiling forward's peak
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the device's memory kvforge may use in all
    kernels: str = "auto"  # auto | triton | torch: Triton kernels (auto: on CUDA when triton is installed)
    cuda_graphs: bool = True  # CUDA + Triton kernels: replay captured graphs for decode batches (False: eager)
    num_kv_blocks: int | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True  # reuse the KV of equal prompt prefixes across requests
    # Persisted KV tier (needs prefix caching): full prefix blocks also go to disk, indexed in the store,
    # so a later request -- even after a restart -- loads them instead of recomputing.
    persist_kv: bool = False
    data_dir: str | None = None  # KV files (data_dir/kv) and the default SQLite store; None: the user data dir
    db_url: str | None = None  # SQLAlchemy URL of the store; None: sqlite:///<data_dir>/kvforge.db
    kv_disk_budget_bytes: int = 2 << 30  # least recently used blocks are evicted past this
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (decode tokens + prefill chunks)
    seed: int = 0  # seeds requests that give no seed of their own
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_disk_budget_bytes < 0:
            raise ValueError(f"kv_disk_budget_bytes must be >= 0, got {self.kv_disk_budget_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.decoding == "none" and self.decoding_options:
            raise ValueError("decoding_options are given but decoding is 'none': choose a decoding plugin")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolved_data_dir(self) -> Path:
        from kvforge.core.store import default_data_dir

        return Path(self.data_dir).expanduser() if self.data_dir else default_data_dir()

    def resolved_db_url(self) -> str:
        from kvforge.core.store import default_db_url

        return self.db_url or default_db_url(self.resolved_data_dir())


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The seed formula: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes, per token."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
