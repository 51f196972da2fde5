"""glibc keeps freed activation buffers mapped once the engine tuned it (core/host_memory.py), so a buffer of a
size met before is not mapped and faulted in again. Run in a fresh interpreter, so the untuned behaviour is seen
first. Measured by what stays resident after the free (robust to transparent huge pages, which change how many
faults a mapping takes but not whether it is given back)."""

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
