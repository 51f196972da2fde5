"""Bounded reads of model files that someone else wrote: a GGUF header, a safetensors header's length, a
checkpoint directory's JSON files. Whatever a file claims (an array of 2^62 items, a string longer than the file,
a million tensors), reading it costs at most time and memory in proportion to the file's real size and the
limits below, and a file that breaks a rule is a `ModelFileError` whose message says which.

Only regular files are read (a FIFO, device or socket is refused from its stat, before any open, and files are
opened with O_NONBLOCK and checked again from the open descriptor), so no read can block.

The GGUF header pass is hand-written, though the `gguf` package (GGUFReader) is the format's reference reader
and stays the one that loads weights: GGUFReader believes the counts a file claims. An array of 2^62 items loops
2^62 times appending empty views once it runs past the end of the memory-mapped file (memory grows until the
process dies); every string of a vocabulary costs it two numpy views (a 1.5M-token file: minutes and >1 GB). The
pass here checks every count against the bytes left in the file before it loops, keeps only small values, and
walks a vocabulary with one struct read per string. A load checks a file with it first, so GGUFReader then only
sees files whose arrays, strings and tensors fit (core/loader.py); the models catalog reads nothing else.

Headers are cached per file version (resolved path, size, modification time), errors included: a broken file is
read once, not on every listing.
"""

from __future__ import annotations

import os
import stat
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

# Limits of what a GGUF header may hold; each is far above what released models use.
MAX_GGUF_KEYS = 4096  # metadata entries (released models: ~30-60)
MAX_GGUF_KEY_BYTES = 1024  # a key's length (the longest in use are ~50)
MAX_GGUF_STRING_BYTES = 16 << 20  # one string value (chat templates are < 200 KB)
MAX_GGUF_ARRAY_ITEMS = 4_000_000  # all arrays together: what GGUFReader turns into numpy views at load (Llama 4's
#                                   vocabulary, scores and merges: ~850k)
MAX_GGUF_ARRAY_DEPTH = 2  # an array of arrays, no deeper
MAX_GGUF_TENSORS = 65536  # the largest released files hold a few thousand
MAX_TENSOR_NAME_BYTES = 256  # ggml's own limit is 64
GGML_MAX_DIMS = 4
KEPT_STRING_BYTES = 1024  # string values longer than this are checked and skipped, not kept
# safetensors' own header limit (the Rust reader refuses larger): checked here before the library reads it
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
MAX_CONFIG_JSON_BYTES = 4 << 20  # config.json, generation_config.json, quantize_config.json (real ones: < 100 KB)
MAX_INDEX_JSON_BYTES = 64 << 20  # model.safetensors.index.json (one line per tensor: ~10 MB for the largest)
CACHED_HEADERS = 256  # file versions remembered

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what GGUFReader reads
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_WINDOW = 1 << 20  # bytes read at a time


class ModelFileError(ValueError):
    """A model file that is not what it claims, or larger than a limit of this module; the message names the file
    and the rule."""


@dataclass(frozen=True)
class GGUFArray:
    """An array value as the header describes it (its items are checked, not kept)."""
    item_type: int
    count: int


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # as the file stores it: the fastest-varying dimension first
    n_elements: int
    n_bytes: int
    offset: int  # from the start of the data section


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per cached file version
class GGUFHeader:
    version: int
    metadata: Mapping[str, int | float | bool | str | GGUFArray | None]  # None: a string too long to keep
    tensors: tuple[GGUFTensor, ...]
    data_offset: int
    file_size: int


def regular_file(path: Path) -> os.stat_result:
    """The stat of `path` (symlinks followed) if it is a regular file; ModelFileError otherwise (a FIFO, device or
    socket would block or act on open)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ModelFileError(f"{path.name}: no such file") from None
    if not stat.S_ISREG(info.st_mode):
        raise ModelFileError(f"{path.name}: not a regular file")
    return info


def open_regular(path: Path) -> tuple[int, os.stat_result]:
    """A read-only descriptor on a regular file, never blocking on open: the file type is checked from the path
    before opening and from the descriptor after (the path may have been swapped in between)."""
    before = regular_file(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    after = os.fstat(fd)
    if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise ModelFileError(f"{path.name}: changed while being opened")
    return fd, after


# --- GGUF --------------------------------------------------------------------------------------------------------

_CACHE: OrderedDict[tuple[str, int, int], Future] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def read_gguf_header(path: Path) -> GGUFHeader:
    """`path`'s GGUF header, read within the limits above (ModelFileError past one, OSError when unreadable); once
    per file version, and one reader per version at a time (concurrent askers wait for it)."""
    info = regular_file(path)
    key = (str(Path(path).resolve()), info.st_size, info.st_mtime_ns)
    with _CACHE_LOCK:
        future = _CACHE.get(key)
        owner = future is None
        if owner:
            future = _CACHE[key] = Future()
            while len(_CACHE) > CACHED_HEADERS:
                _CACHE.popitem(last=False)
        else:
            _CACHE.move_to_end(key)
    if owner:
        try:
            future.set_result(_read_gguf(Path(path)))
        except ModelFileError as exc:  # the file's fault: remembered for this version
            future.set_exception(exc)
        except BaseException as exc:  # unreadable now (permissions, I/O): tried again next time
            with _CACHE_LOCK:
                if _CACHE.get(key) is future:
                    del _CACHE[key]
            future.set_exception(exc)
    return future.result()


class _Reader:
    """Sequential reads through a window of the file, every length checked against the bytes left."""

    def __init__(self, fd: int, size: int, name: str) -> None:
        self.fd, self.size, self.name = fd, size, name
        self.buf, self.base, self.i = b"", 0, 0  # buf holds the file from `base`; `i` is the cursor in it
        self.order = "<"

    @property
    def offset(self) -> int:
        return self.base + self.i

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.name}: {what} (at byte {self.offset} of {self.size})")

    def left(self) -> int:
        return self.size - self.offset

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.left()} are left")
        if self.i + n > len(self.buf):
            self.base, self.i = self.offset, 0
            self.buf = os.pread(self.fd, max(n, _WINDOW), self.base)
            if len(self.buf) < n:
                raise self.fail("the file shrank while being read")

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.left()} are left")
        if self.i + n <= len(self.buf):
            self.i += n
        else:
            self.base, self.i, self.buf = self.offset + n, 0, b""

    def scalar(self, code: str, what: str):
        size = struct.calcsize(code)
        self.need(size, what)
        (value,) = struct.unpack_from(self.order + code, self.buf, self.i)
        self.i += size
        return value

    def string(self, limit: int, what: str, keep_up_to: int | None = None) -> str | None:
        """A string of at most `limit` bytes; None (skipped) when longer than `keep_up_to`."""
        n = self.scalar("Q", what)
        if n > limit:
            raise self.fail(f"{what} claims {n} bytes (at most {limit})")
        if keep_up_to is not None and n > keep_up_to:
            self.skip(n, what)
            return None
        self.need(n, what)
        text = self.buf[self.i:self.i + n].decode("utf-8", errors="replace")
        self.i += n
        return text

    def skip_strings(self, count: int, what: str) -> None:
        """`count` strings, each length checked; one struct read per string (vocabularies hold millions)."""
        length = struct.Struct(self.order + "Q").unpack_from
        for _ in range(count):
            if self.i + 8 > len(self.buf):
                self.need(8, what)
            (n,) = length(self.buf, self.i)
            self.i += 8
            if n > MAX_GGUF_STRING_BYTES:
                raise self.fail(f"a string of {what} claims {n} bytes (at most {MAX_GGUF_STRING_BYTES})")
            if self.i + n <= len(self.buf):
                self.i += n
            else:
                self.skip(n, what)


def _read_gguf(path: Path) -> GGUFHeader:
    fd, info = open_regular(path)
    try:
        return _parse_gguf(_Reader(fd, info.st_size, path.name))
    finally:
        os.close(fd)


def _parse_gguf(r: _Reader) -> GGUFHeader:
    r.need(24, "the header")
    if r.buf[:4] != GGUF_MAGIC:
        raise ModelFileError(f"{r.name}: not a GGUF file (no GGUF magic)")
    r.i = 4
    version = r.scalar("I", "the version")
    if version & 0xFFFF == 0:  # written big-endian (GGUFReader reads those too)
        r.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in GGUF_VERSIONS:
        raise ModelFileError(f"{r.name}: GGUF version {version} (readable: {', '.join(map(str, GGUF_VERSIONS))})")
    tensor_count, kv_count = r.scalar("Q", "the tensor count"), r.scalar("Q", "the metadata count")
    if kv_count > MAX_GGUF_KEYS:
        raise r.fail(f"claims {kv_count} metadata entries (at most {MAX_GGUF_KEYS})")
    if tensor_count > MAX_GGUF_TENSORS:
        raise r.fail(f"claims {tensor_count} tensors (at most {MAX_GGUF_TENSORS})")
    metadata: dict[str, int | float | bool | str | GGUFArray | None] = {}
    items = [0]  # array items so far, against MAX_GGUF_ARRAY_ITEMS
    for _ in range(kv_count):
        key = r.string(MAX_GGUF_KEY_BYTES, "a metadata key")
        if key in metadata:
            raise r.fail(f"metadata key {key!r} appears twice")
        value_type = r.scalar("I", f"the type of {key!r}")
        metadata[key] = _value(r, value_type, key, items, depth=0)
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(f"{r.name}: general.alignment {alignment!r} is not a power of two")
    infos = [_tensor_info(r) for _ in range(tensor_count)]
    data_offset = -(-r.offset // alignment) * alignment
    data_bytes = r.size - data_offset
    names, tensors = set(), []
    for name, dims, ggml_type, offset in infos:
        if name in names:
            raise ModelFileError(f"{r.name}: tensor {name!r} appears twice")
        names.add(name)
        tensors.append(_tensor(r.name, name, dims, ggml_type, offset, alignment, data_bytes))
    return GGUFHeader(version, metadata, tuple(tensors), data_offset, r.size)


def _value(r: _Reader, value_type: int, key: str, items: list[int], depth: int):
    """A metadata value: scalars and short strings kept, long strings and arrays checked and skipped."""
    if value_type in _SCALARS:
        return r.scalar(_SCALARS[value_type], repr(key))
    if value_type == _STRING:
        return r.string(MAX_GGUF_STRING_BYTES, repr(key), keep_up_to=KEPT_STRING_BYTES)
    if value_type != _ARRAY:
        raise r.fail(f"{key!r} has the unknown value type {value_type}")
    if depth >= MAX_GGUF_ARRAY_DEPTH:
        raise r.fail(f"{key!r} nests arrays deeper than {MAX_GGUF_ARRAY_DEPTH}")
    item_type, count = r.scalar("I", repr(key)), r.scalar("Q", repr(key))
    # the least each item takes (a string its length, an array its type and count): checked before any loop
    smallest = struct.calcsize(_SCALARS[item_type]) if item_type in _SCALARS else \
        {_STRING: 8, _ARRAY: 12}.get(item_type)
    if smallest is None:
        raise r.fail(f"{key!r} is an array of the unknown value type {item_type}")
    if count * smallest > r.left():
        raise r.fail(f"truncated: {key!r} claims {count} items of at least {smallest} bytes, {r.left()} bytes are left")
    items[0] += count
    if items[0] > MAX_GGUF_ARRAY_ITEMS:
        raise r.fail(f"{key!r} claims {count} items: the arrays would hold over {MAX_GGUF_ARRAY_ITEMS}")
    if item_type in _SCALARS:
        r.skip(count * smallest, f"the {count} items of {key!r}")
    elif item_type == _STRING:
        r.skip_strings(count, repr(key))
    else:
        for _ in range(count):
            _value(r, _ARRAY, key, items, depth + 1)
    return GGUFArray(item_type, count)


def _tensor_info(r: _Reader) -> tuple[str, tuple[int, ...], int, int]:
    name = r.string(MAX_TENSOR_NAME_BYTES, "a tensor name")
    n_dims = r.scalar("I", f"tensor {name!r}")
    if n_dims > GGML_MAX_DIMS:
        raise r.fail(f"tensor {name!r} claims {n_dims} dimensions (at most {GGML_MAX_DIMS})")
    dims = tuple(r.scalar("Q", f"tensor {name!r}") for _ in range(n_dims))
    return name, dims, r.scalar("I", f"tensor {name!r}"), r.scalar("Q", f"tensor {name!r}")


def _tensor(file: str, name: str, dims: tuple[int, ...], ggml_type: int, offset: int, alignment: int,
            data_bytes: int) -> GGUFTensor:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ModelFileError(f"{file}: tensor {name!r} has the unknown type {ggml_type}") from None
    elements = 1
    for d in dims:
        elements *= d
    if elements >= 1 << 63:
        raise ModelFileError(f"{file}: tensor {name!r} claims {elements} elements")
    if dims and dims[0] % block:
        raise ModelFileError(f"{file}: tensor {name!r}'s rows of {dims[0]} are not whole blocks of {block}")
    n_bytes = elements // block * type_size
    if offset % alignment or offset + n_bytes > data_bytes:
        raise ModelFileError(f"{file}: tensor {name!r} ({n_bytes} bytes at {offset}) lies outside the file's "
                             f"{max(data_bytes, 0)} bytes of data (truncated?)")
    return GGUFTensor(name, ggml_type, dims, elements, n_bytes, offset)


# --- safetensors checkpoints --------------------------------------------------------------------------------------

def check_safetensors(path: Path) -> None:
    """A safetensors file's header length: within the file and safetensors' own limit (the library then parses the
    header and checks every tensor's offsets against the file)."""
    fd, info = open_regular(path)
    try:
        head = os.pread(fd, 9, 0)
    finally:
        os.close(fd)
    if len(head) < 9:
        raise ModelFileError(f"{path.name}: too short for a safetensors file ({info.st_size} bytes)")
    (length,) = struct.unpack_from("<Q", head)
    if length > min(info.st_size - 8, MAX_SAFETENSORS_HEADER_BYTES) or head[8:9] != b"{":
        raise ModelFileError(f"{path.name}: a safetensors header of {length} bytes in a file of {info.st_size} "
                             f"(at most {MAX_SAFETENSORS_HEADER_BYTES}, starting with '{{')")


def check_json_file(path: Path, max_bytes: int = MAX_CONFIG_JSON_BYTES) -> None:
    info = regular_file(path)
    if info.st_size > max_bytes:
        raise ModelFileError(f"{path.name}: {info.st_size} bytes (at most {max_bytes})")


_JSON_LIMITS = {"config.json": MAX_CONFIG_JSON_BYTES, "generation_config.json": MAX_CONFIG_JSON_BYTES,
                "quantize_config.json": MAX_CONFIG_JSON_BYTES, "model.safetensors.index.json": MAX_INDEX_JSON_BYTES}


def check_checkpoint_dir(path: Path) -> None:
    """A checkpoint directory a load may read: every file in it regular (a FIFO named tokenizer.json would block the
    load), its config JSON files within their sizes, its safetensors headers within theirs."""
    for child in sorted(Path(path).iterdir()):
        info = os.stat(child) if child.exists() else None  # a dangling link is never read
        if info is None or stat.S_ISDIR(info.st_mode):
            continue
        if not stat.S_ISREG(info.st_mode):
            raise ModelFileError(f"{child.name}: not a regular file")
        if child.name in _JSON_LIMITS:
            check_json_file(child, _JSON_LIMITS[child.name])
        elif child.suffix == ".safetensors":
            check_safetensors(child)
