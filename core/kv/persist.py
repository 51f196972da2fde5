"""PersistedKV: the disk tier of the prefix cache, so a conversation's KV outlives the process.

A full, computed block is copied out of the KV pool on the engine thread (one memcpy) and handed
to a background writer, which writes it atomically (temp file, fsync, rename) and then records it
in the KV index (core/kv/index.py) with its checksum. The writer is background work: on Linux it runs
at the lowest CPU priority, so on a busy machine its file writes and checksums wait for idle CPU instead
of slowing the engine thread. When it falls behind (more than MAX_PENDING_BYTES copied and waiting), a
block is not copied but deferred: only its hash and place are noted, and it is copied and written when the
engine is idle (`save_deferred`), if its pool block still holds it by then (`holds`). When the
in-memory prefix cache misses, the engine asks this tier for the blocks that follow and loads them
into fresh pool blocks instead of recomputing them. A file that is missing, corrupt, or holds other
tokens is dropped (logged) and the block is recomputed, so a bad file can never change an output. The
directory keeps to a byte budget by evicting the least recently used blocks, across every model that
shares it.

Block hashes are rooted in the model fingerprint (core/kv/pool_setup.py model_fingerprint): a block written
under another model, dtype, quant method, block size or tokenizer can never be found.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import struct
import sys
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from kvforge.core.kv.index import KVEntry, KVIndex
from kvforge.core.kv.quant import KVFormat
from kvforge.core.private_files import DIR_MODE, open_private, private_dir

log = logging.getLogger(__name__)

MAGIC = b"KVFORGE-KV\x01"
# Blocks copied but not yet written; past this, new blocks are deferred to idle time. Small: a block the writer
# cannot write soon costs the step loop its copy (fresh memory, ~0.4 MB for the embedded model) for nothing. A 256
# MiB backlog cost 64 offline streams ~20% of their tok/s (AMD EPYC Zen 5, 2 cores); 4 MiB, none measurable.
MAX_PENDING_BYTES = 8 << 20
MAX_DEFERRED = 1 << 16  # deferred blocks remembered (hash, tokens, place); the oldest are dropped past it
# A block's access time is stamped `depth` steps earlier than its chain's: among blocks used together,
# eviction takes a conversation's tail before its head, so what remains is still a reachable prefix.
DEPTH_STEP_S = 1e-3
SWEEP_MIN_AGE_S = 600  # younger unindexed files may belong to another process's write in progress
# The writer thread's nice value. `kvforge bench serve` (64 streams, 2 busy cores, the median of 6 interleaved
# rounds): HTTP / offline engine tok/s 0.82 with the writer at the engine's priority, 0.82 at nice 10, 0.90-0.96
# at 19; each block costs the writer ~1-2 ms of CPU (mostly the kernel's file write and the checksum).
WRITER_NICE = 19


class KVBlockAccess(Protocol):
    """The KV pool as the persisted tier sees it: whole blocks with every KV head (a tensor-parallel pool
    gathers its ranks' heads on read and hands each rank its own on write)."""

    kv_block_shape: tuple[int, ...]  # [layers, 2, kv_heads, block_size, head_dim (a quantized format's row bytes)]
    kv_dtype: torch.dtype
    kv_format: KVFormat | None  # the quantized format of the pool's rows (None: the model's dtype)

    def read_block(self, block: int) -> torch.Tensor: ...

    def write_block(self, block: int, data: torch.Tensor) -> None: ...


class CorruptBlock(ValueError):
    pass


def lower_priority(nice: int) -> None:
    """Give the calling thread this nice value (Linux schedules each thread on its own; elsewhere, or when the
    system refuses, nothing changes)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass


def token_digest(token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(array("q", token_ids).tobytes()).digest()[:16]


def checksum(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


@dataclass
class _Write:
    digest: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    data: torch.Tensor  # [layers, 2, kv_heads, block_size, head_dim], a copy
    last_access: float


@dataclass
class _Deferred:
    """A block to write once the engine is idle, if pool block `block` still holds it."""

    parent: bytes
    token_ids: tuple[int, ...]
    block: int
    last_access: float


@dataclass
class PersistStats:
    blocks: int = 0  # this model's blocks on disk
    bytes_total: int = 0  # every model's blocks in the directory
    budget_bytes: int = 0
    pending: int = 0  # blocks queued for writing or deferred to idle time
    written_blocks: int = 0
    loaded_blocks: int = 0
    load_failures: int = 0
    evicted_blocks: int = 0
    dropped_writes: int = 0


class PersistedKV:
    def __init__(self, index: KVIndex, directory: Path, fingerprint: bytes, pool: KVBlockAccess,
                 budget_bytes: int = 2 << 30, holds: Callable[[int, bytes], bool] | None = None) -> None:
        """`holds(block, digest)`: whether pool block `block` still holds the block of that hash (the block
        pool's `holds`); without it nothing is deferred (a refused block is dropped)."""
        self.index, self.directory, self.fingerprint = index, Path(directory), fingerprint
        self.budget_bytes = budget_bytes
        self._pool = pool
        self._holds = holds
        self._deferred: OrderedDict[bytes, _Deferred] = OrderedDict()  # hash -> where it is, oldest first
        self._block_shape = tuple(pool.kv_block_shape)
        self._dtype = pool.kv_dtype
        self._format = None if pool.kv_format is None else pool.kv_format.stored_as  # in each file's header
        self._model_dir = private_dir(private_dir(self.directory) / fingerprint.hex())
        self._lock = threading.Lock()
        self._block_nbytes = math.prod(self._block_shape) * torch.empty((), dtype=self._dtype).element_size()
        # this model's blocks on disk (recency lives in the shared index: eviction spans every model)
        self._index: dict[bytes, KVEntry] = {e.hash: e for e in index.entries(fingerprint)}
        self._total_bytes = self._stored_bytes()
        self._pending: set[bytes] = set()  # queued for writing
        self._counters = PersistStats(budget_bytes=budget_bytes)
        self._touched: dict[bytes, float] = {}  # hash -> access time not yet in the index (LRU)
        self._sweep_orphans()
        self._queue: queue.Queue[_Write | tuple[str, object] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvforge-kv-writer", daemon=True)
        self._writer.start()

    # --- engine thread ------------------------------------------------------------------------

    def contains(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._index

    def touch(self, digest: bytes, depth: int = 0, when: float | None = None) -> None:
        """The block (at index `depth` of a sequence) was used at `when`: keep its disk copy from
        looking old. Pass one `when` for a whole chain so its blocks order by depth."""
        with self._lock:
            if digest in self._index:
                self._touched[digest] = (when or time.time()) - depth * DEPTH_STEP_S

    def save(self, digest: bytes, parent: bytes, token_ids: Sequence[int], block: int, depth: int = 0,
             when: float | None = None) -> None:
        """Queue a full, computed block for writing (a no-op if it is on disk or queued already); deferred to
        idle time when the writer is behind."""
        last_access = (when or time.time()) - depth * DEPTH_STEP_S
        with self._lock:
            if digest in self._index or digest in self._pending:
                return
            if self._backlogged():  # the disk is behind: never stall the step loop
                self._defer(digest, _Deferred(parent, tuple(token_ids), block, last_access))
                return
            self._pending.add(digest)
        self._queue.put(_Write(digest, parent, tuple(token_ids), self._pool.read_block(block), last_access))

    def _backlogged(self) -> bool:
        return (len(self._pending) + 1) * self._block_nbytes > MAX_PENDING_BYTES

    def _defer(self, digest: bytes, entry: _Deferred) -> None:
        if self._holds is None:
            self._counters.dropped_writes += 1
            return
        self._deferred[digest] = entry
        self._deferred.move_to_end(digest)
        if len(self._deferred) > MAX_DEFERRED:
            self._deferred.popitem(last=False)
            self._counters.dropped_writes += 1

    def save_deferred(self) -> bool:
        """Queue the deferred blocks whose pool blocks still hold them, oldest first, while the writer's backlog
        allows. Call it from the thread that steps the engine, when it is idle. True while some remain deferred."""
        while True:
            with self._lock:
                if not self._deferred or self._backlogged():
                    return bool(self._deferred)
                digest, entry = self._deferred.popitem(last=False)
                if digest in self._index or digest in self._pending:
                    continue
            if not self._holds(entry.block, digest):  # evicted from the pool before it could be written
                with self._lock:
                    self._counters.dropped_writes += 1
                continue
            data = self._pool.read_block(entry.block)
            with self._lock:
                if not self._holds(entry.block, digest):  # evicted while it was read: the copy may be another's
                    self._counters.dropped_writes += 1
                    continue
                self._pending.add(digest)
            self._queue.put(_Write(digest, entry.parent, entry.token_ids, data, entry.last_access))

    def load(self, digest: bytes, token_ids: Sequence[int], block: int, depth: int = 0,
             when: float | None = None) -> bool:
        """Fill pool block `block` from disk. False (and the file is dropped) if it cannot be trusted."""
        with self._lock:
            entry = self._index.get(digest)
        if entry is None:
            return False
        try:
            data = self._read(entry, token_ids)
        except (OSError, CorruptBlock) as exc:
            log.warning("persisted KV block %s dropped, it will be recomputed: %s", digest.hex(), exc)
            with self._lock:
                self._index.pop(digest, None)
                self._counters.load_failures += 1
            self._queue.put(("drop", entry))
            return False
        self._pool.write_block(block, data)
        with self._lock:
            self._counters.loaded_blocks += 1
        self.touch(digest, depth, when)
        return True

    def _read(self, entry: KVEntry, token_ids: Sequence[int]) -> torch.Tensor:
        path = self.directory / entry.file
        with open(path, "rb") as f:
            raw = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(raw)
        if len(raw) != entry.nbytes or checksum(raw) != entry.checksum:
            raise CorruptBlock(f"{path}: checksum mismatch")
        if not raw.startswith(MAGIC):
            raise CorruptBlock(f"{path}: not a kvforge KV block file")
        (header_len,) = struct.unpack_from("<I", raw, len(MAGIC))
        start = len(MAGIC) + 4
        header = json.loads(raw[start:start + header_len])
        if (header["hash"] != entry.hash.hex() or header["fingerprint"] != self.fingerprint.hex()
                or header["tokens"] != list(token_ids)):
            raise CorruptBlock(f"{path}: holds another block")
        dtype = self._dtype
        if header["dtype"] != str(dtype) or tuple(header["shape"]) != tuple(self._block_shape) or \
                header.get("kv_format") != self._format:  # (the fingerprint differs too: never found by hash)
            raise CorruptBlock(f"{path}: holds a block of another shape, dtype or KV format")
        payload = torch.frombuffer(raw, dtype=torch.uint8, offset=start + header_len)
        return payload.view(dtype).view(self._block_shape)

    # --- writer thread ------------------------------------------------------------------------

    def _write_loop(self) -> None:
        lower_priority(WRITER_NICE)
        while True:
            items = [self._queue.get()]
            while len(items) < 256:  # one index transaction per batch of blocks
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._process(items)
            except Exception:  # the database is unreachable, the disk full...: keep the engine serving
                log.exception("persisting KV blocks failed")
                with self._lock:
                    for item in items:
                        if isinstance(item, _Write):
                            self._pending.discard(item.digest)
            finally:
                for _ in items:
                    self._queue.task_done()
            if any(item is None for item in items):
                return

    def _process(self, items: list) -> None:
        # Drops first: a dropped block is recomputed and saved again, so a write of it in this batch
        # is always newer, and removing the old entry after it would delete the fresh file and row.
        dropped = [item[1] for item in items if isinstance(item, tuple) and item[0] == "drop"]
        if dropped:
            self._remove(dropped)
        written = []
        for item in items:
            if isinstance(item, _Write):
                try:
                    written.append(self._write_file(item))
                except OSError as exc:
                    log.warning("could not persist KV block %s: %s", item.digest.hex(), exc)
                    with self._lock:
                        self._pending.discard(item.digest)
        if written:
            self.index.add(written)  # the file is complete before the index names it
            with self._lock:
                for entry in written:
                    self._index[entry.hash] = entry
                    self._pending.discard(entry.hash)
                self._counters.written_blocks += len(written)
        with self._lock:
            touched, self._touched = self._touched, {}
        self.index.set_access(touched)
        if written:
            self._evict_over_budget()

    def _write_file(self, item: _Write) -> KVEntry:
        data = item.data.cpu().contiguous()
        header = json.dumps({
            "hash": item.digest.hex(), "parent": item.parent.hex(), "fingerprint": self.fingerprint.hex(),
            "tokens": list(item.token_ids), "dtype": str(data.dtype), "shape": list(data.shape),
            "kv_format": self._format,
        }).encode()
        head = b"".join((MAGIC, struct.pack("<I", len(header)), header))
        payload = memoryview(data.view(torch.uint8).view(-1).numpy())  # the tensor's bytes, not a copy of them
        digest = hashlib.blake2b(head, digest_size=32)
        digest.update(payload)  # = checksum(file contents), without joining them into one more copy
        name = item.digest.hex()
        relative = f"{self.fingerprint.hex()}/{name[:2]}/{name}.kv"
        path = self.directory / relative
        path.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open_private(tmp) as f:
            f.write(head)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a reader sees the old state or the whole file
        return KVEntry(item.digest, item.parent, self.fingerprint, token_digest(item.token_ids),
                       len(item.token_ids), relative, len(head) + payload.nbytes, digest.digest(), item.last_access)

    def _remove(self, entries: list[KVEntry]) -> None:
        """Index rows first, then files: a crash in between leaves an orphan file, never a dangling row
        that would be trusted (and orphans are swept at the next start)."""
        self.index.remove(e.hash for e in entries)
        for entry in entries:
            (self.directory / entry.file).unlink(missing_ok=True)
        with self._lock:
            for entry in entries:
                self._index.pop(entry.hash, None)

    def _evict_over_budget(self) -> None:
        total = self._stored_bytes()  # every process and model sharing the directory
        while total > self.budget_bytes:
            victims, excess = [], total - self.budget_bytes
            for entry in self.index.least_recent(256):
                if excess <= 0:
                    break
                victims.append(entry)
                excess -= entry.nbytes
            if not victims:
                break
            victims += self._descendants(victims)
            self._remove(victims)
            with self._lock:
                self._counters.evicted_blocks += len(victims)
            total = self._stored_bytes()
        self._total_bytes = total

    def _descendants(self, entries: list[KVEntry]) -> list[KVEntry]:
        """Blocks whose chain runs through these: unreachable once they go, so they go too."""
        found, seen, frontier = [], {e.hash for e in entries}, [e.hash for e in entries]
        while frontier:
            children = [c for c in self.index.children(frontier) if c.hash not in seen]
            seen.update(c.hash for c in children)
            found += children
            frontier = [c.hash for c in children]
        return found

    def _stored_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.index.totals().values())

    def _sweep_orphans(self) -> None:
        """Delete this model's files the index does not name (a crash between write and index, or
        between index removal and unlink) and leftover temp files."""
        known = {e.file for e in self._index.values()}
        cutoff = time.time() - SWEEP_MIN_AGE_S
        for path in self._model_dir.glob("*/*"):
            try:
                if (path.is_file() and path.relative_to(self.directory).as_posix() not in known
                        and path.stat().st_mtime < cutoff):
                    path.unlink()
            except OSError:
                pass  # gone meanwhile, or not ours to delete: never fail the engine's start

    # --- control ------------------------------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> bool:
        """Write every queued and deferred block (or until `timeout` passes); True if all were. From the thread
        that steps the engine, or while it is idle (deferred blocks are read from the pool)."""
        deadline = time.monotonic() + timeout
        while True:
            more = self.save_deferred()  # as many as the backlog takes; the rest after these are written
            self._queue.put(("sync", None))  # also records pending access times
            while self._queue.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.005)
            if self._queue.unfinished_tasks:
                return False  # timed out
            if not more:
                return True

    def close(self) -> None:
        """Write what is queued and deferred, then stop the writer."""
        if self._writer.is_alive():
            self.flush(timeout=60)
            self._queue.put(None)
            self._writer.join(timeout=60)

    def stats(self) -> PersistStats:
        with self._lock:
            return replace(self._counters, blocks=len(self._index), bytes_total=self._total_bytes,
                           pending=len(self._pending) + len(self._deferred))
