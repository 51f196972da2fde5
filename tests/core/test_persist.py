"""The persisted KV tier, with the embedded model and real SQLite / PostgreSQL stores: blocks survive a
restart and are loaded instead of recomputed, with outputs equal to an engine without prefix caching;
a corrupt, truncated, missing or swapped file is dropped and recomputed; another dtype, block size or
quant config never sees them; the directory keeps to its byte budget (least recently used first);
a broken disk or a locked database never stalls the step loop; orphans are swept at open."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sqlite3
import struct
import time
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch

from kvforge.core import LLM, EngineConfig, SamplingParams
from kvforge.core.async_engine import AsyncEngine
from kvforge.core.kv import persist
from kvforge.core.kv.blocks import block_hash
from kvforge.core.kv.index import KVEntry
from kvforge.core.kv.persist import MAGIC, PersistedKV, checksum
from kvforge.core.kv.pool_setup import model_fingerprint
from kvforge.core.kv.sql_index import SQLKVIndex

TEXT = (
    "The harbour town woke slowly that winter. Fishing boats rocked against the stone quay while the "
    "baker carried trays of warm bread past the shuttered windows of the old customs house. Up on the "
    "hill the lighthouse keeper wrote the night's weather into a leather notebook: wind from the north "
    "east, a long swell, two ships passing well offshore before dawn. At the school the children "
    "argued about whether the frozen pond would hold their weight, and the teacher, who had grown up "
    "in the town, told them about the year the whole bay froze and people walked out to the island to "
    "trade apples for smoked fish. In the market square a woman sold wool dyed with onion skins and "
    "walnut shells, and a retired sailor repaired clocks at a folding table, humming songs nobody else "
    "remembered. By noon the fog lifted, the gulls returned to the rooftops, and the ferry sounded its "
    "horn twice as it left for the mainland with the post, three passengers and a crate of oysters."
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread for this module: on a small, shared machine two OpenMP threads next to the
    KV writer thread (or any other busy process) wait at every barrier and run many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(embedded_path):
    """The ground truth: the same model without any prefix caching (so without the disk tier). fp32, like every
    engine of this module: what is loaded from disk must give exactly the tokens of a recomputation."""
    return LLM(str(embedded_path), progress=False, kv_cache_bytes=64 << 20, enable_prefix_caching=False,
               dtype="float32")


@pytest.fixture(scope="module")
def prompt(reference):
    def make(tag: str, length: int) -> list[int]:
        ids = reference.tokenizer.encode(f"{tag}. {TEXT}")
        assert len(ids) >= length
        return ids[:length]
    return make


@pytest.fixture(scope="module")
def expected(reference):
    """The token ids the reference generates for each prompt (a list per sample when n > 1), cached."""
    cache: dict = {}

    def run(prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
        todo = [p for p in dict.fromkeys(map(tuple, prompts)) if (p, repr(params)) not in cache]
        for p, out in zip(todo, reference.generate([list(p) for p in todo], params) if todo else []):
            cache[(p, repr(params))] = [o.token_ids for o in out] if params.n > 1 else out.token_ids
        return [cache[(tuple(p), repr(params))] for p in prompts]
    return run


@pytest.fixture
def make_llm(embedded_path, tmp_path):
    """LLMs with the disk tier on, sharing tmp_path as their data directory; closed afterwards."""
    built: list[LLM] = []

    def make(db_url: str | None, **config) -> LLM:
        llm = LLM(str(embedded_path), progress=False, persist_kv=True, data_dir=str(tmp_path), db_url=db_url,
                  kv_cache_bytes=64 << 20, **{"dtype": "float32", **config})
        built.append(llm)
        return llm
    yield make
    for llm in built:
        llm.engine.close()



class Pool:
    """A bare KV tensor [layers, K/V, kv_heads, blocks, block_size, head_dim] as the persisted tier's pool."""

    def __init__(self, kv: torch.Tensor, kv_format=None) -> None:
        self.kv, self.kv_block_shape, self.kv_dtype = kv, kv[:, :, :, 0].shape, kv.dtype
        self.kv_format = kv_format

    def read_block(self, block: int) -> torch.Tensor:
        return self.kv[:, :, :, block].clone()

    def write_block(self, block: int, data: torch.Tensor) -> None:
        self.kv[:, :, :, block].copy_(data)


def hashes(llm: LLM, prompt: list[int], n: int) -> list[bytes]:
    """The hash chain of the prompt's first n blocks (rooted in the engine's model fingerprint)."""
    chain = [llm.engine.fingerprint]
    size = llm.engine.config.block_size
    for i in range(n):
        chain.append(block_hash(chain[-1], prompt[i * size:(i + 1) * size]))
    return chain[1:]


def rows(llm: LLM) -> dict[bytes, KVEntry]:
    return {e.hash: e for e in llm.engine.persisted.index.entries(llm.engine.fingerprint)}


def files_on_disk(kv_dir: Path) -> dict[str, int]:
    return {p.relative_to(kv_dir).as_posix(): p.stat().st_size for p in kv_dir.rglob("*") if p.is_file()}


def header(path: Path) -> dict:
    raw = path.read_bytes()
    assert raw.startswith(MAGIC)
    (length,) = struct.unpack_from("<I", raw, len(MAGIC))
    return json.loads(raw[len(MAGIC) + 4:len(MAGIC) + 4 + length])


def assert_index_matches_disk(llm: LLM) -> None:
    """Every row names a complete file with its checksum, and no file of this model lacks a row."""
    kv_dir = llm.engine.persisted.directory
    entries = rows(llm)
    for entry in entries.values():
        raw = (kv_dir / entry.file).read_bytes()
        assert len(raw) == entry.nbytes and checksum(raw) == entry.checksum, entry.file
        assert header(kv_dir / entry.file)["hash"] == entry.hash.hex()
    mine = {f for f in files_on_disk(kv_dir) if f.startswith(llm.engine.fingerprint.hex())}
    assert mine == {e.file for e in entries.values()}


@contextlib.contextmanager
def database_write_lock(url: str):
    """Hold a lock that blocks every write to kv_blocks from another connection."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
    else:
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("LOCK TABLE kv_blocks IN EXCLUSIVE MODE"))  # reads pass, writes wait
                yield
                conn.rollback()
        finally:
            engine.dispose()


def wait_for(condition, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# --- restart ---------------------------------------------------------------------------------------

def test_restart_loads_persisted_blocks_and_matches_reference(db_url, make_llm, prompt, expected):
    first = prompt("restart", 110)
    a = make_llm(db_url)
    out_a = a.generate([first], GREEDY)[0]
    assert [out_a.token_ids] == expected([first]) and out_a.num_cached_tokens == 0
    assert a.engine.persisted.flush()
    blocks = (len(first) + len(out_a.token_ids) - 1) // BLOCK  # 7: the last one filled while decoding
    assert blocks == 7
    assert set(rows(a)) == set(hashes(a, first + out_a.token_ids, blocks))
    assert a.engine.persisted.stats().written_blocks == blocks
    assert_index_matches_disk(a)
    a.engine.close()

    b = make_llm(db_url)  # a new process, in effect: empty KV pool, index read from the store
    assert b.engine.fingerprint == a.engine.fingerprint
    assert b.engine.persisted.stats().blocks == blocks
    follow_up = first + out_a.token_ids + prompt("And then", 40)  # the conversation continues
    out_b = b.generate([follow_up], GREEDY)[0]
    assert out_b.num_cached_tokens == blocks * BLOCK
    stats = b.engine.stats()
    assert stats.kv_disk_loaded_blocks_total == blocks and stats.kv_disk_load_failures_total == 0
    assert stats.cached_tokens_total == blocks * BLOCK
    assert [out_b.token_ids] == expected([follow_up])


# --- corruption ------------------------------------------------------------------------------------

BAD = 3  # the block of each prompt that goes bad on disk
MODES = ("flip", "truncate", "delete", "swap")


def test_bad_files_are_dropped_and_recomputed(db_url, make_llm, prompt, expected):
    prompts = {mode: prompt(f"Case {mode}", 101) for mode in MODES}  # 6 full blocks each, own chains
    reference_ids = expected(list(prompts.values()), SHORT)
    a = make_llm(db_url)
    assert [o.token_ids for o in a.generate(list(prompts.values()), SHORT)] == reference_ids
    assert a.engine.persisted.flush()
    a.engine.close()
    kv_dir, index = a.engine.persisted.directory, rows(a)
    chains = {mode: hashes(a, p, 6) for mode, p in prompts.items()}
    assert all(set(chain) <= set(index) for chain in chains.values())

    bad_bytes = {}
    for mode, chain in chains.items():
        path = kv_dir / index[chain[BAD]].file
        raw = bytearray(path.read_bytes())
        if mode == "flip":  # a few bits of the K/V payload, after the header
            for offset in (len(raw) // 2, len(raw) - 7):
                raw[offset] ^= 0x40
        elif mode == "truncate":
            raw = raw[:len(raw) // 3]
        elif mode == "swap":  # a valid file, but of another block
            raw = bytearray((kv_dir / index[chain[BAD + 1]].file).read_bytes())
        if mode == "delete":
            path.unlink()
        else:
            path.write_bytes(raw)
            bad_bytes[mode] = bytes(raw)

    started = time.time()
    b = make_llm(db_url)
    outs = b.generate(list(prompts.values()), SHORT)
    assert [o.token_ids for o in outs] == reference_ids
    assert [o.num_cached_tokens for o in outs] == [BAD * BLOCK] * len(MODES)  # loaded up to the bad block
    stats = b.engine.stats()
    assert stats.kv_disk_load_failures_total == len(MODES)
    assert stats.kv_disk_loaded_blocks_total == len(MODES) * BAD

    # The bad entries were dropped; the recomputed blocks were written again, good this time.
    assert b.engine.persisted.flush()
    assert_index_matches_disk(b)
    after = rows(b)
    for mode, chain in chains.items():
        assert set(chain) <= set(after), mode
        rewritten = after[chain[BAD]]
        assert rewritten.last_access >= started > after[chain[BAD + 1]].last_access, mode
        assert header(kv_dir / rewritten.file)["tokens"] == prompts[mode][BAD * BLOCK:(BAD + 1) * BLOCK]
        if mode in bad_bytes:
            assert (kv_dir / rewritten.file).read_bytes() != bad_bytes[mode]


def test_load_failure_drops_the_entry(db_url, tmp_path):
    """At the PersistedKV level (no engine to recompute and save again): a bad file is dropped, from
    the index and the disk, and a good one still loads the exact bytes that were saved."""
    index = SQLKVIndex.open(db_url)
    kv = torch.randn(2, 2, 1, 6, 4, 3)  # [layers, K/V, kv_heads, blocks, block_size, head_dim]
    fp = b"F" * 16
    h1, h2, h3 = block_hash(fp, [1, 2, 3, 4]), block_hash(fp, [5, 6, 7, 8]), block_hash(fp, [9, 9, 9, 9])
    persisted = PersistedKV(index, tmp_path / "kv", fp, Pool(kv))
    try:
        persisted.save(h1, fp, [1, 2, 3, 4], 0)
        persisted.save(h2, h1, [5, 6, 7, 8], 1)
        persisted.save(h3, h2, [9, 9, 9, 9], 2)
        assert persisted.flush()
        entries = {e.hash: e for e in index.entries(fp)}
        assert set(entries) == {h1, h2, h3} and entries[h2].parent_hash == h1

        assert persisted.load(h1, [1, 2, 3, 4], 4)
        assert torch.equal(kv[:, :, :, 4], kv[:, :, :, 0])
        assert not persisted.load(b"?" * 16, [1, 2, 3, 4], 4)  # unknown: not a failure

        path = tmp_path / "kv" / entries[h2].file
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 1
        path.write_bytes(raw)
        assert not persisted.load(h2, [5, 6, 7, 8], 5)
        assert not persisted.load(h3, [9, 9, 9, 0], 5)  # the file holds other tokens than asked for
        assert persisted.flush()
        assert set(e.hash for e in index.entries(fp)) == {h1}
        assert not path.exists() and not (tmp_path / "kv" / entries[h3].file).exists()
        assert not persisted.contains(h2) and persisted.contains(h1)
        stats = persisted.stats()
        assert (stats.loaded_blocks, stats.load_failures, stats.blocks) == (1, 2, 1)
    finally:
        persisted.close()

    # A file that holds another block, with a row that vouches for it (checksum and all), is refused.
    good = index.entries(fp)[0]
    persisted = PersistedKV(index, tmp_path / "kv", fp, Pool(kv))
    try:
        persisted.save(h2, h1, [5, 6, 7, 8], 1)
        assert persisted.flush()
        swapped = next(e for e in index.entries(fp) if e.hash == h2)
        (tmp_path / "kv" / swapped.file).write_bytes((tmp_path / "kv" / good.file).read_bytes())
        index.add([replace(swapped, nbytes=good.nbytes, checksum=good.checksum)])
    finally:
        persisted.close()
    persisted = PersistedKV(index, tmp_path / "kv", fp, Pool(kv))
    try:
        assert not persisted.load(h2, [5, 6, 7, 8], 5)
        assert persisted.load(h1, [1, 2, 3, 4], 5)
        assert persisted.stats().load_failures == 1
        assert persisted.flush() and [e.hash for e in index.entries(fp)] == [h1]
    finally:
        persisted.close()
        index.close()


def test_a_block_dropped_and_saved_again_in_one_batch_is_kept(db_url, tmp_path):
    """Regression: the writer handled a batch's writes before its drops, so when a bad block's drop
    and its recomputed copy's write were batched together, the fresh file and row were deleted."""
    index = SQLKVIndex.open(db_url)
    kv = torch.randn(2, 2, 1, 6, 4, 3)
    fp = b"G" * 16
    h1, h2 = block_hash(fp, [1, 2, 3, 4]), block_hash(fp, [5, 6, 7, 8])
    persisted = PersistedKV(index, tmp_path / "kv", fp, Pool(kv))
    try:
        persisted.save(h1, fp, [1, 2, 3, 4], 0)
        assert persisted.flush()
        path = tmp_path / "kv" / index.entries(fp)[0].file
        path.write_bytes(path.read_bytes()[:-1])
        with database_write_lock(db_url):
            persisted.save(h2, h1, [5, 6, 7, 8], 1)  # the writer takes it and waits on the database...
            wait_for(lambda: (tmp_path / "kv" / fp.hex() / h2.hex()[:2] / f"{h2.hex()}.kv").exists())
            time.sleep(0.1)
            assert not persisted.load(h1, [1, 2, 3, 4], 3)  # ...while the drop of h1...
            persisted.save(h1, fp, [1, 2, 3, 4], 0)  # ...and its recomputed copy queue up together
        assert persisted.flush()
        assert persisted.contains(h1) and {e.hash for e in index.entries(fp)} == {h1, h2}
        assert persisted.load(h1, [1, 2, 3, 4], 4) and torch.equal(kv[:, :, :, 4], kv[:, :, :, 0])
    finally:
        persisted.close()
        index.close()


# --- fingerprint -----------------------------------------------------------------------------------

def test_model_fingerprint_covers_everything_that_changes_the_kv(embedded_path, reference):
    tok = reference.tokenizer
    base = model_fingerprint(EngineConfig(dtype="float32"), embedded_path, tok)
    assert len(base) == 16
    same = [dict(dtype="float32"), dict(dtype="fp32"),
            dict(dtype="float32", kv_cache_bytes=1 << 20, max_num_seqs=3, persist_kv=True, seed=7,
                 data_dir="/elsewhere", kv_disk_budget_bytes=1, linear_kernels="torch", decode_attention="sdpa")]
    for config in same:
        assert model_fingerprint(EngineConfig(**config), embedded_path, tok) == base, config
    different = [dict(dtype="bfloat16"), dict(dtype="float16"), dict(quant="int8"),
                 dict(quant_options={"group_size": 64}), dict(quant_options={"group_size": 128}),
                 dict(block_size=8), dict(block_size=32)]
    prints = [model_fingerprint(EngineConfig(**config), embedded_path, tok) for config in different]
    assert len(set(prints) | {base}) == len(different) + 1
    resolved = EngineConfig().dtype  # the default, auto, is the dtype it resolves to on this machine
    assert model_fingerprint(EngineConfig(), embedded_path, tok) == model_fingerprint(
        EngineConfig(dtype=resolved), embedded_path, tok)


def test_blocks_of_another_config_are_never_used(make_llm, prompt, expected):
    p = prompt("Fingerprint", 101)
    a = make_llm(None)
    assert [a.generate([p], SHORT)[0].token_ids] == expected([p], SHORT)
    assert a.engine.persisted.flush()
    assert len(rows(a)) == 6
    seen = {a.engine.fingerprint}
    for config in (dict(dtype="bfloat16"), dict(block_size=8), dict(quant="bnb-int8")):
        other = make_llm(None, **config)
        assert other.engine.fingerprint not in seen
        seen.add(other.engine.fingerprint)
        assert other.engine.persisted.stats().blocks == 0  # the shared index holds none of its blocks
        out = other.generate([p], SHORT)[0]
        stats = other.engine.stats()
        assert out.num_cached_tokens == 0, config
        assert stats.kv_disk_loaded_blocks_total == 0 and stats.kv_disk_load_failures_total == 0, config
        if "dtype" not in config and "quant" not in config:  # the same model: the same tokens
            assert [out.token_ids] == expected([p], SHORT), config
        assert other.engine.persisted.flush() and other.engine.persisted.stats().written_blocks > 0
        other.engine.close()
    assert set(a.engine.persisted.index.totals()) == seen

    a.engine.block_pool.reset_cache()  # the original config still finds its blocks on disk
    out = a.generate([p], SHORT)[0]
    assert out.num_cached_tokens == 6 * BLOCK and a.engine.stats().kv_disk_loaded_blocks_total == 6
    assert [out.token_ids] == expected([p], SHORT)


# --- eviction --------------------------------------------------------------------------------------

def test_disk_budget_evicts_least_recently_used(db_url, make_llm, prompt, expected, reference):
    block_bytes = reference.engine.runner.kv_bytes_per_block
    budget = int(4.5 * block_bytes)  # room for 4 block files (a file is a block plus a small header)
    llm = make_llm(db_url, kv_disk_budget_bytes=budget)
    assert llm.engine.runner.kv_bytes_per_block == block_bytes
    persisted, kv_dir = llm.engine.persisted, llm.engine.persisted.directory
    one = SamplingParams(temperature=0, max_tokens=1)
    pa, pb, pc = prompt("Alpha", 33), prompt("Bravo", 33), prompt("Charlie", 33)  # 2 full blocks each

    def run(p: list[int]) -> int:
        out = llm.generate([p], one)[0]
        assert [out.token_ids] == expected([p], one)
        assert persisted.flush()
        return out.num_cached_tokens

    run(pa)
    run(pb)
    assert set(rows(llm)) == set(hashes(llm, pa, 2) + hashes(llm, pb, 2))
    assert persisted.stats().evicted_blocks == 0
    llm.engine.block_pool.reset_cache()  # forget the in-memory copies: the next hits come from disk
    assert run(pa) == 2 * BLOCK  # loaded from disk: alpha is now more recent than bravo
    run(pc)  # 6 blocks > budget: the two least recently used go
    assert set(rows(llm)) == set(hashes(llm, pa, 2) + hashes(llm, pc, 2))
    assert persisted.stats().evicted_blocks == 2
    assert set(files_on_disk(kv_dir)) == {e.file for e in rows(llm).values()}

    longer = [prompt(f"Round {i}", 100) for i in range(3)]  # 6 full blocks each
    assert [o.token_ids for o in llm.generate(longer, SHORT)] == expected(longer, SHORT)
    assert persisted.flush()
    on_disk = files_on_disk(kv_dir)
    totals = persisted.index.totals()
    assert 0 < sum(on_disk.values()) <= budget
    assert sum(nbytes for _, nbytes in totals.values()) == sum(on_disk.values())
    assert totals[llm.engine.fingerprint][0] == len(on_disk) <= 4
    stats = persisted.stats()
    assert stats.evicted_blocks == stats.written_blocks - len(on_disk) > 2  # every block accounted for
    assert stats.bytes_total <= budget
    assert_index_matches_disk(llm)


def test_eviction_takes_a_chain_tail_first_and_never_leaves_unreachable_blocks(db_url, tmp_path):
    """Blocks used together are evicted deepest first, so what stays is a usable prefix; and a block
    whose parent is evicted goes with it (nothing could ever reach it again)."""
    index = SQLKVIndex.open(db_url)
    kv = torch.randn(2, 2, 1, 6, 4, 3)
    fp = b"E" * 16
    h1 = block_hash(fp, [1, 2, 3, 4])
    h2 = block_hash(h1, [5, 6, 7, 8])
    h3 = block_hash(h2, [9, 10, 11, 12])
    h4 = block_hash(fp, [7, 7, 7, 7])
    probe = PersistedKV(index, tmp_path / "probe", b"P" * 16, Pool(kv))
    probe.save(block_hash(b"P" * 16, [1, 2, 3, 4]), b"P" * 16, [1, 2, 3, 4], 0)
    probe.close()
    file_bytes = index.entries(b"P" * 16)[0].nbytes  # every test block has the same size
    index.clear()

    persisted = PersistedKV(index, tmp_path / "kv", fp, Pool(kv), budget_bytes=2 * file_bytes)
    try:
        when = time.time()  # one time for the chain, as the engine passes: a busy machine cannot reorder it
        for depth, (digest, parent, tokens) in enumerate([(h1, fp, [1, 2, 3, 4]), (h2, h1, [5, 6, 7, 8]),
                                                          (h3, h2, [9, 10, 11, 12])]):
            persisted.save(digest, parent, tokens, depth, depth, when)
        assert persisted.flush()
        assert {e.hash for e in index.entries(fp)} == {h1, h2}  # the tail went, the prefix stays

        index.set_access({h1: 1.0})  # the head is now the least recently used
        persisted.save(h4, fp, [7, 7, 7, 7], 3)
        assert persisted.flush()
        assert {e.hash for e in index.entries(fp)} == {h4}  # h1 evicted, and h2 with it
        assert not persisted.contains(h2) and persisted.stats().evicted_blocks == 3
        assert sorted(p.name for p in (tmp_path / "kv").rglob("*.kv")) == [f"{h4.hex()}.kv"]
    finally:
        persisted.close()


# --- the writer never holds up the engine --------------------------------------------------------------

def test_disk_and_database_trouble_never_stall_the_engine(db_url, make_llm, prompt, expected):
    llm = make_llm(db_url)
    persisted = llm.engine.persisted
    model_dir = persisted.directory / llm.engine.fingerprint.hex()

    shutil.rmtree(model_dir)
    model_dir.write_text("not a directory")  # every write fails (root ignores permissions, not this)
    for tag in ("Broken disk", "Still serving"):
        p = prompt(tag, 101)
        assert [llm.generate([p], SHORT)[0].token_ids] == expected([p], SHORT)
    assert persisted.flush()
    stats = persisted.stats()
    assert (stats.written_blocks, stats.pending, stats.blocks) == (0, 0, 0)
    assert persisted._writer.is_alive()
    assert rows(llm) == {}

    model_dir.unlink()  # the disk recovers: writes resume
    p = prompt("Recovered", 101)
    assert [llm.generate([p], SHORT)[0].token_ids] == expected([p], SHORT)
    assert persisted.flush()
    assert set(rows(llm)) == set(hashes(llm, p, 6))

    with database_write_lock(db_url):  # the index cannot be written: the step loop does not wait
        p = prompt("Locked", 101)
        started = time.monotonic()
        assert [llm.generate([p], SHORT)[0].token_ids] == expected([p], SHORT)
        assert time.monotonic() - started < 20  # the writer waits up to 30 s for the lock (forever on PostgreSQL)
        assert persisted.stats().pending == 6
        assert not persisted.flush(timeout=0.2)
    assert persisted.flush()
    assert set(rows(llm)) == set(hashes(llm, prompt("Recovered", 101), 6) + hashes(llm, p, 6))
    assert persisted.stats().pending == 0
    assert_index_matches_disk(llm)


# --- a writer that falls behind ------------------------------------------------------------------------

def test_blocks_deferred_while_the_writer_is_behind_are_written_when_idle(db_url, make_llm, prompt, expected,
                                                                          monkeypatch):
    """A busy step loop copies no block the writer cannot take (its backlog full): the block is deferred, then
    written when the engine idles if the pool still holds it; a block evicted first is dropped, never a wrong one."""
    llm = make_llm(db_url)
    persisted = llm.engine.persisted
    monkeypatch.setattr(persist, "MAX_PENDING_BYTES", 0)  # the writer never has room while this holds
    kept, evicted = prompt("Deferred", 101), prompt("Evicted", 101)  # 6 full blocks each
    assert [llm.generate([kept], SHORT)[0].token_ids] == expected([kept], SHORT)
    stats = persisted.stats()
    assert (stats.written_blocks, stats.pending) == (0, 6)  # nothing copied, all remembered
    assert llm.engine.persist_deferred()  # idle, but still no room: they stay deferred
    monkeypatch.undo()
    while llm.engine.persist_deferred():
        persisted.flush(timeout=5)
    assert persisted.flush() and set(rows(llm)) == set(hashes(llm, kept, 6))
    assert_index_matches_disk(llm)

    monkeypatch.setattr(persist, "MAX_PENDING_BYTES", 0)
    assert [llm.generate([evicted], SHORT)[0].token_ids] == expected([evicted], SHORT)
    llm.engine.block_pool.reset_cache()  # its blocks leave the pool before the engine idles
    monkeypatch.undo()
    assert not llm.engine.persist_deferred()
    assert persisted.flush() and set(rows(llm)) == set(hashes(llm, kept, 6))
    assert persisted.stats().dropped_writes == 6 and persisted.stats().pending == 0
    llm.engine.close()

    restarted = make_llm(db_url)
    out = restarted.generate([kept + prompt("More", 20)], SHORT)[0]
    assert out.num_cached_tokens == 6 * BLOCK
    assert [out.token_ids] == expected([kept + prompt("More", 20)], SHORT)


def test_the_serving_engine_writes_deferred_blocks_once_idle(make_llm, prompt, expected, monkeypatch):
    """Under AsyncEngine (the server's), with room for one block at a time, what a busy step deferred is written
    by the engine thread's idle loop, with no flush asked for."""
    llm = make_llm(None)
    persisted = llm.engine.persisted
    monkeypatch.setattr(persist, "MAX_PENDING_BYTES", persisted._block_nbytes)
    engine = AsyncEngine(llm.engine)
    p = prompt("Served", 101)

    async def generate() -> list[int]:
        tokens = []
        async for out in engine.add_request(p, SHORT):
            tokens = out.token_ids
        return tokens

    try:
        assert [asyncio.run(generate())] == expected([p], SHORT)
        wait_for(lambda: set(rows(llm)) == set(hashes(llm, p, 6)) and persisted.stats().pending == 0)
    finally:
        engine.close()
    assert_index_matches_disk(llm)


# --- preemption and n > 1 ------------------------------------------------------------------------------

def test_preemption_and_parallel_samples_with_persistence(make_llm, prompt, expected):
    llm = make_llm(None, num_kv_blocks=14)  # two 116-token requests need 16 blocks: one gets preempted
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [prompt(f"Preempt {i}", 100) for i in range(3)]
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats.preemptions_total > 0
    assert [o.token_ids for o in outs] == expected(prompts, params)
    assert llm.engine.persisted.flush() and llm.engine.persisted.stats().written_blocks > 0

    greedy_pair = SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True)
    samples = llm.generate([prompts[0]], greedy_pair)[0]
    assert [s.token_ids for s in samples] == expected(prompts[:1], params) * 2
    seeded = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)
    p = prompt("Sampling", 90)
    samples = llm.generate([p], seeded)[0]
    assert [s.token_ids for s in samples] == expected([p], seeded)[0]
    assert len({tuple(s.token_ids) for s in samples}) > 1
    assert llm.engine.block_pool.num_used == 0
    assert llm.engine.persisted.flush()
    assert_index_matches_disk(llm)


# --- orphans -------------------------------------------------------------------------------------------

def test_orphans_are_swept_when_opened(db_url, tmp_path):
    index = SQLKVIndex.open(db_url)
    kv = torch.randn(2, 2, 1, 4, 4, 3)
    fp, other_fp = b"S" * 16, b"T" * 16
    h1 = block_hash(fp, [1, 2, 3, 4])
    persisted = PersistedKV(index, tmp_path / "kv", fp, Pool(kv))
    persisted.save(h1, fp, [1, 2, 3, 4], 0)
    persisted.close()
    kept = tmp_path / "kv" / index.entries(fp)[0].file
    model_dir = tmp_path / "kv" / fp.hex()
    stray = model_dir / "ab" / f"{'ab' * 16}.kv"  # a file the index does not name
    temp = kept.with_name(f"{kept.name}.4242.tmp")  # a write cut short before its rename
    foreign = tmp_path / "kv" / other_fp.hex() / "ab" / f"{'ab' * 16}.kv"  # another model's: not ours
    fresh = model_dir / "cd" / f"{'cd' * 16}.kv"  # unindexed but young: maybe another process's write
    old = time.time() - 3600
    for path in (stray, temp, foreign, fresh):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"junk")
        if path is not fresh:
            os.utime(path, (old, old))
    (model_dir / "ef" / "a-directory").mkdir(parents=True)  # never fails the start

    persisted = PersistedKV(index, tmp_path / "kv", fp, Pool(kv))
    try:
        assert not stray.exists() and not temp.exists()
        assert kept.exists() and foreign.exists() and fresh.exists()
        kv[:, :, :, 3].zero_()
        assert persisted.load(h1, [1, 2, 3, 4], 3) and torch.equal(kv[:, :, :, 3], kv[:, :, :, 0])
    finally:
        persisted.close()
        index.close()
