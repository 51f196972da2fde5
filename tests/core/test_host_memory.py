"""glibc keeps freed activation buffers mapped once the engine tuned it (core/host_memory.py): a buffer of a
size met before is not faulted in again. Run in a fresh interpreter, so the untuned behaviour is seen first."""

import json
import os
import platform
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, resource, torch
from kvforge.core.host_memory import keep_freed_memory

def faults_of_second_allocation(numel):
    torch.empty(numel, dtype=torch.uint8).fill_(1)  # allocated, touched, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(numel, dtype=torch.uint8).fill_(1)  # the same size again
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

size = 40 << 20  # above glibc's highest dynamic mmap threshold (32 MiB): mapped afresh each time by default
untuned = faults_of_second_allocation(size)
tuned = keep_freed_memory()
print(json.dumps({"untuned": untuned, "tuned": tuned, "after": faults_of_second_allocation(size)}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc thresholds are glibc's")
def test_a_freed_buffer_is_reused_without_faulting_its_pages_again():
    result = json.loads(subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                                       env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout)
    pages = (40 << 20) // 4096
    assert result["untuned"] > pages // 2  # the default: mapped and zeroed anew
    assert result["tuned"] is True
    assert result["after"] < pages // 20
