"""Host memory: glibc malloc tuned for a step loop (large activation buffers stay in the process between steps),
pools committed as they are written, a GGUF file's blocks copied onto huge pages.

malloc, why: by default glibc serves allocations above a dynamic threshold (128 KiB at first, rising only as such chunks
are freed) with fresh mmap()s and gives them back on free, so the first steps that meet new sizes (a batch of
prefill chunks: [2048, 3072] gate/up outputs and the like) fault in and zero every page of every buffer, at every
layer. Measured on an AMD EPYC Zen 5 VM (2 cores): the first 64-prompt prefill after load took 4.7 s with 325k
page faults, and 2.5 s with 85 once freed memory is kept (later batches: ~2.6 s either way). vLLM gets the same
effect from tcmalloc, which it preloads; kvforge cannot preload a library into a running Python, but glibc's
own knobs (mallopt) take effect at any time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 64 << 20  # above it (the KV pool, load-time buffers) still mmap'd: returned when freed
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top before any is given back


def _glibc():
    """The C library when it is glibc, else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it (musl's mallopt is a no-op)
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system now (glibc's malloc_trim): once after loading, whose
    conversion buffers (a GGUF's codes, scales, int32 copies for packing) the kept-memory threshold would
    otherwise hold for the process's life (measured: ~230 MiB of the embedded model's native load)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds (once per process); False where the C library is not glibc (nothing changed)."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.warning("glibc refused the malloc thresholds: large buffers are mapped afresh at every step")
    return done


def zeroed_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages are committed only as they are written: a private anonymous mapping (the
    kernel maps every page to its shared zero page until written). torch.zeros writes every page at once: a 1 GiB KV
    pool was 1 GiB of the process from the start, where a 200-token chat on a 1.7B model writes 80 MB of it. The
    mapping lives as long as the tensor (frombuffer keeps it) and goes back to the system when freed."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def read_into_huge_pages(path: str | os.PathLike, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of a file as a uint8 tensor in private anonymous memory, the kernel asked for
    transparent huge pages (madvise: 2 MiB pages where it has them, 4 KiB where it has none). Why: the GGUF kernels
    stream every weight of a decode step, and on a file's mapping each 4 KiB page costs a TLB miss and stops the
    hardware prefetcher; measured on OLMoE-1B-7B Q4_0 (AMD EPYC Zen 5, 2 cores) the routed experts' kernel ran at
    ~28 GB/s from the mapping and ~31 GB/s from huge pages. Read with read() (no mapping of the file: the process
    holds only the copy, the page cache the file's pages, reclaimable), in chunks on torch's threads: each page's
    first write (the kernel zeroing it) is most of the cost, and it spreads over the cores (3.7 GiB from the page
    cache: 1.2-1.4 s on one thread, 0.5 s on two; a first huge-page allocation after the page cache filled the memory
    waits seconds longer for the kernel to compact it)."""
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(pages)

    def read(first: int) -> None:  # one chunk, through its own file object (seek + readinto: any OS)
        done, end = first, min(first + READ_CHUNK, nbytes)
        with open(path, "rb", buffering=0) as f:
            f.seek(offset + first)
            while done < end:
                count = f.readinto(view[done: end])
                if not count:
                    raise ValueError(f"{path}: {nbytes - done} bytes short of the {nbytes} asked for")
                done += count

    try:
        with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), 8))) as pool:
            list(pool.map(read, range(0, nbytes, READ_CHUNK)))
    finally:
        view.release()
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes]


READ_CHUNK = 64 << 20  # bytes per read() while copying a file in
