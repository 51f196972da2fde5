"""What the benches run on: the device and software versions, the device's measured copy bandwidth (the
bandwidth roofline's denominator), and the synchronisation / memory release a timing needs on CUDA."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time

import torch


def is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


def sync(device: str) -> None:
    """Wait for the device's queued work, so a wall-clock time covers it."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def free_memory(device: str) -> None:
    gc.collect()
    if is_cuda(device):
        torch.cuda.empty_cache()


def cpu_name() -> str:
    """The CPU's model and ISA extensions (core/cpu.py): named with every figure a bench prints."""
    from kvforge.core.cpu import cpu_model_and_flags, isa

    return f"{cpu_model_and_flags()[0]}; {' '.join(isa()) or 'no AVX2'}"


def device_info(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count()}
    for package in ("transformers", "triton"):
        try:
            info[package] = __import__(package).__version__
        except Exception:  # not installed, or broken: the row says so
            info[package] = None
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        info |= {"name": props.name, "total_memory_gib": props.total_memory / (1 << 30),
                 "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
                 "cuda": torch.version.cuda}
    else:
        info |= {"name": f"CPU ({cpu_name()})", "threads": torch.get_num_threads()}
    return info


def copy_bandwidth(device: str, gib: float, repeats: int = 10) -> dict:
    """`dst.copy_(src)` of a `gib` GiB bf16 buffer: (bytes read + bytes written) / time, median of `repeats`."""
    numel = max(1, int(gib * (1 << 30)) // 2)
    src = torch.ones(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    try:
        dst.copy_(src)  # warm-up
        sync(device)
        times = []
        for _ in range(repeats):
            if is_cuda(device):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                start = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - start)
    finally:
        del src, dst
        free_memory(device)
    seconds = statistics.median(times)
    moved = 2 * numel * 2
    return {"buffer_bytes": numel * 2, "bytes_per_copy": moved, "median_s": seconds,
            "bytes_per_s": moved / seconds, "gb_per_s": moved / seconds / 1e9}
