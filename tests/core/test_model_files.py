"""core/model_files.py, the bounded readers of model files: the GGUF header pass agrees with the `gguf` package on a
real file, and on malformed bytes (hypothesis: cut short, bytes overwritten, huge counts planted) it either reads a
header or raises ModelFileError, quickly; no open blocks; errors are cached per file version."""

from __future__ import annotations

import itertools
import os
import struct
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.core.model_files import (
    MAX_SAFETENSORS_HEADER_BYTES,
    GGUFArray,
    ModelFileError,
    check_checkpoint_dir,
    check_safetensors,
    read_gguf_header,
)
from tests.helpers.hostile_files import huge_array_gguf, tiny_gguf, truncated_vocab_gguf

_names = itertools.count()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model-files")


@pytest.fixture(scope="module")
def valid(files) -> bytes:
    return tiny_gguf(files / "valid.gguf", tokens=16).read_bytes()


def test_the_header_is_what_the_gguf_package_reads(files, valid):
    from gguf import GGUFReader

    path = files / "valid.gguf"
    header, reader = read_gguf_header(path), GGUFReader(str(path))
    assert [(t.name, t.ggml_type, t.n_elements, t.n_bytes, header.data_offset + t.offset) for t in header.tensors] \
        == [(t.name, int(t.tensor_type), int(t.n_elements), int(t.n_bytes), int(t.data_offset)) for t in reader.tensors]
    assert {t.ggml_type for t in header.tensors} == {0, 8}  # F32 and Q8_0 (its bytes counted by blocks)
    assert header.metadata["general.architecture"] == "llama" and header.metadata["llama.block_count"] == 2
    assert header.metadata["tokenizer.ggml.tokens"] == GGUFArray(8, 16)


def test_the_findings_files_are_refused_by_their_counts(files):
    with pytest.raises(ModelFileError, match="claims 4611686018427387904 items"):
        read_gguf_header(huge_array_gguf(files / "huge.gguf"))
    with pytest.raises(ModelFileError, match="truncated"):
        read_gguf_header(truncated_vocab_gguf(files / "cut.gguf", tokens=20_000))


def test_no_open_blocks_on_a_fifo(files):
    """A FIFO is refused from its stat (a plain open would wait for a writer forever)."""
    os.mkfifo(files / "fifo.gguf")
    (files / "weights").mkdir()
    (files / "weights" / "config.json").write_text("{}")
    os.mkfifo(files / "weights" / "model.safetensors")
    errors = []

    def read():
        for check in (lambda: read_gguf_header(files / "fifo.gguf"), lambda: check_checkpoint_dir(files / "weights")):
            try:
                check()
            except ModelFileError as exc:
                errors.append(str(exc))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and len(errors) == 2 and all("not a regular file" in e for e in errors), errors


def test_errors_are_cached_per_file_version(files, valid):
    path = files / "changing.gguf"
    path.write_bytes(valid[:40])
    with pytest.raises(ModelFileError) as first:
        read_gguf_header(path)
    with pytest.raises(ModelFileError) as second:
        read_gguf_header(path)
    assert second.value is first.value  # the same error: the file was not read again
    path.write_bytes(valid)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000_000))
    assert read_gguf_header(path).metadata["general.architecture"] == "llama"


def test_safetensors_and_config_limits(files):
    directory = files / "checkpoint"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelFileError, match="safetensors header of 1099511627776 bytes"):
        check_checkpoint_dir(directory)
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    check_safetensors(directory / "model.safetensors")
    assert MAX_SAFETENSORS_HEADER_BYTES == 100_000_000  # safetensors' own limit
    with open(directory / "config.json", "wb") as f:
        f.truncate(5 << 20)  # sparse: 5 MiB of zeros
    with pytest.raises(ModelFileError, match="config.json"):
        check_checkpoint_dir(directory)


def planted_counts(valid: bytes):
    """Edits of the valid file: a cut, overwritten bytes, or a huge or random 8-byte count planted anywhere."""
    at = st.integers(0, len(valid) - 1)
    return st.one_of(
        st.tuples(st.just("cut"), at, st.just(b"")),
        st.tuples(st.just("bytes"), at, st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("count"), at, st.sampled_from([1 << 62, 1 << 63, 2**64 - 1, 1 << 32, 1 << 20]).map(
            lambda n: struct.pack("<Q", n))),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_malformed_bytes_are_read_or_refused_quickly(files, valid, data):
    edits = data.draw(st.lists(planted_counts(valid), min_size=1, max_size=3))
    content = bytearray(valid)
    for kind, at, value in edits:
        if kind == "cut":
            del content[at:]
        else:
            content[at:at + len(value)] = value
    path = files / f"fuzz-{next(_names)}.gguf"
    path.write_bytes(bytes(content))
    start = time.monotonic()
    try:
        header = read_gguf_header(path)
    except ModelFileError:
        pass
    else:  # what it read fits the file
        assert all(header.data_offset + t.offset + t.n_bytes <= len(content) for t in header.tensors)
    assert time.monotonic() - start < 1.0
    path.unlink()
