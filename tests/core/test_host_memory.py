"""glibc keeps freed activation buffers mapped once the engine tuned it (core/host_memory.py), so a buffer of a
size met before is not mapped and faulted in again. Run in a fresh interpreter, so the untuned behaviour is seen
first. Measured by what stays resident after the free (robust to transparent huge pages, which change how many
faults a mapping takes but not whether it is given back). The CPU KV pool's zero-filled tensor holds memory only
where it is written."""

import json
import os
import platform
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os, torch
from kvforge.core.host_memory import keep_freed_memory

PAGE = os.sysconf("SC_PAGE_SIZE")

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

def kept_after_free(numel):
    before = resident()
    torch.empty(numel, dtype=torch.uint8).fill_(1)  # allocated, touched, freed
    return resident() - before

size = 40 << 20  # above glibc's highest dynamic mmap threshold (32 MiB): mapped afresh and unmapped by default
untuned = kept_after_free(size)
tuned = keep_freed_memory()
print(json.dumps({"untuned": untuned, "tuned": tuned, "after": kept_after_free(size)}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc thresholds are glibc's")
def test_a_freed_buffer_stays_mapped_for_the_next_step():
    result = json.loads(subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                                       env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout)
    size = 40 << 20
    assert result["untuned"] < size // 4  # the default: given back to the system on free
    assert result["tuned"] is True
    assert result["after"] > size * 3 // 4  # kept: the next buffer of this size reuses the pages


POOL_SCRIPT = r"""
import json, torch
from kvforge.core.host_memory import zeroed_on_demand

def anonymous():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))

size = 256 << 20
before = anonymous()
pool = zeroed_on_demand((16, size // 16 // 4), torch.float32)
allocated = anonymous() - before
zeros = pool.max().item() == 0 and pool.min().item() == 0  # reads map the zero page: nothing committed
read = anonymous() - before
pool[:2] = 1.5  # 2 of 16 rows written
written = anonymous() - before
total = pool.sum().item()
del pool
freed = anonymous() - before
print(json.dumps({"shape": list(zeroed_on_demand((0, 8), torch.bfloat16).shape), "allocated": allocated,
                  "zeros": zeros, "read": read, "written": written, "total": total, "freed": freed}))
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="reads RssAnon from /proc/self/status")
def test_the_kv_pool_holds_memory_where_it_is_written():
    """A 256 MiB pool costs nothing until written; a tenth of it written costs about a tenth; it reads as zeros and
    is freed with the tensor. In a fresh interpreter: a test process's other threads would move RssAnon too."""
    result = json.loads(subprocess.run([sys.executable, "-c", POOL_SCRIPT], capture_output=True, text=True,
                                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout)
    size = 256 << 20
    assert result["shape"] == [0, 8] and result["zeros"] is True
    assert result["allocated"] < size // 16 and result["read"] < size // 16
    assert size // 10 < result["written"] < size // 4
    assert result["total"] == 1.5 * 2 * size // 16 // 4
    assert result["freed"] < size // 16


def test_a_file_range_is_read_whole_in_chunks_across_threads(tmp_path, monkeypatch):
    """read_into_huge_pages (a GGUF's tensor data, --gguf-weights copied): the range's bytes exactly, read in chunks on
    several threads (4 KiB chunks here, so a 50 KB range takes 13), and a range past the file's end refused."""
    import torch

    from kvforge.core import host_memory

    data = os.urandom(50_000)
    path = tmp_path / "blob"
    path.write_bytes(data)
    monkeypatch.setattr(host_memory, "READ_CHUNK", 4096)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        copy = host_memory.read_into_huge_pages(path, 123, 49_000)
        assert copy.dtype == torch.uint8 and bytes(copy.numpy()) == data[123: 123 + 49_000]
        with pytest.raises(ValueError, match="1 bytes short of the 50000 asked for"):
            host_memory.read_into_huge_pages(path, 1, 50_000)
    finally:
        torch.set_num_threads(torch_threads)
