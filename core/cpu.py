"""What this CPU is: its model name and the ISA extensions kernel choices depend on (read once per process).

Named with every figure a bench prints, keyed into the kernel-choice cache (core/kernel_choice.py), and read
by `dtype="auto"` (bf16 where the CPU computes bf16 natively)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

import torch

# the /proc/cpuinfo flags that change which kernel wins
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16",
             "amx_int8")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    name, flags = platform.processor() or platform.machine(), frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = frozenset(value.split())
                break
    except OSError:  # not Linux: no flags known, so no ISA-specific choice is made
        pass
    return name, flags


def isa() -> list[str]:
    """The ISA_FLAGS this CPU has, in ISA_FLAGS order."""
    flags = cpu_model_and_flags()[1]
    return [f for f in ISA_FLAGS if f in flags]


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512_BF16 or AMX-BF16): bf16 is then faster than fp32."""
    return any(f in cpu_model_and_flags()[1] for f in NATIVE_BF16_FLAGS)


def cpu_signature() -> dict[str, Any]:
    """What a kernel timing depends on: the CPU model and ISA, torch's threads and version."""
    return {"cpu": cpu_model_and_flags()[0], "isa": isa(), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def describe_cpu(signature: dict[str, Any] | None = None) -> str:
    """e.g. "AMD EPYC (avx2 fma avx512f avx512_bf16 avx512_vnni), 2 threads, torch 2.13.0": named with every
    figure."""
    s = signature or cpu_signature()
    return f"{s['cpu']} ({' '.join(s['isa']) or 'no AVX2'}), {s['threads']} threads, torch {s['torch']}"
