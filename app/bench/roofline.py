"""What bounds batch-1 decode on a CPU, for `kvforge bench peers --shape`: the machine's streaming-read bandwidth
(measured here), the bytes of a GGUF that one decode step reads, and their ratio, the roofline decode rate. Plus
the CPU's identity (model, family / model / stepping, the vector ISA flags) that every figure is named with.

A decode step at batch 1 and short context reads every weight matrix once (the projections of every layer and the
output head: its GGUF byte sizes; one row of a separate token embedding, the norms and the KV read are left out,
a fraction of a percent at these sizes); of a mixture-of-experts layer's stacked experts only the experts a token
uses (`expert_used_count` of `expert_count`). It cannot run faster than bandwidth / those bytes: an engine's batch-1
rate as a fraction of that says how much of the memory system it uses.
"""

from __future__ import annotations

import time
from pathlib import Path

VECTOR_FLAG_PREFIXES = ("avx2", "fma", "avx512", "amx", "avx_vnni", "f16c")


def cpu_identity() -> dict:
    """The first CPU's model name, vendor, family / model / stepping and vector ISA flags from /proc/cpuinfo
    (empty fields off Linux)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if not key and fields:
                break  # the first processor's block only
            fields.setdefault(key, value.strip())
    except OSError:
        pass
    flags = fields.get("flags", "").split()

    def number(key: str) -> int | None:
        value = fields.get(key, "")
        return int(value) if value.isdigit() else None

    return {"model_name": fields.get("model name"), "vendor": fields.get("vendor_id"),
            "family": number("cpu family"), "model_number": number("model"), "stepping": number("stepping"),
            "vector_flags": sorted(f for f in flags if f.startswith(VECTOR_FLAG_PREFIXES))}


def stream_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 3) -> dict:
    """Streaming-read bandwidth in bytes/s: torch's sum over an `nbytes` fp32 tensor (written once first, so its
    pages exist) on `threads` threads, the best of `repeats`. torch's thread count is restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.empty(nbytes // 4, dtype=torch.float32)
        data.fill_(1.0)
        data.sum()  # a first pass: page-table and cache warm-up, not timed
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            times.append(time.perf_counter() - start)
        del data
    finally:
        torch.set_num_threads(before)
    best = min(times)
    return {"bytes_per_s": nbytes / best, "array_bytes": nbytes, "threads": threads, "repeats": repeats,
            "seconds": times, "how": f"torch.sum over a {nbytes / (1 << 30):.2g} GiB fp32 tensor, {threads} "
                                     f"thread{'s' if threads > 1 else ''}, best of {repeats}"}


def decode_bytes(gguf: Path) -> dict:
    """The bytes of `gguf` one decode step reads: every tensor of two or more dimensions (the projections and the
    output head), the token embedding left out when the file has a separate output head (a step reads one row of
    it), and of stacked experts (3-D `ffn_*_exps`) the used experts' share. `experts`: "used of count", or None."""
    from kvforge.core.gguf_moe import STACKED
    from kvforge.core.model_files import read_gguf_header

    header = read_gguf_header(Path(gguf))
    tensors, metadata = header.tensors, header.metadata
    arch = metadata.get("general.architecture")
    count, used = metadata.get(f"{arch}.expert_count"), metadata.get(f"{arch}.expert_used_count")
    untied = any(t.name == "output.weight" for t in tensors)
    read = [t for t in tensors if len(t.shape) >= 2 and not (untied and t.name == "token_embd.weight")]
    total = sum(t.n_bytes * used // count if count and STACKED.fullmatch(t.name) else t.n_bytes for t in read)
    return {"bytes": total, "tensors": len(read), "head": "output.weight" if untied else "token_embd.weight (tied)",
            "experts": f"{used} of {count}" if count else None}


def roofline_tok_s(bandwidth_bytes_per_s: float, step_bytes: int) -> float:
    """Batch-1 decode steps per second that the bandwidth allows."""
    return bandwidth_bytes_per_s / step_bytes
