"""`kvforge cache stats|clear` on a data directory written by real engines with persist_kv on: two models
(the embedded model at two block sizes, so two fingerprints). The numbers printed must match the files
on disk and the rows of the index; clear must empty both, or only the one model asked for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvforge.app.cli import main
from kvforge.core import EngineConfig, LLMEngine, SamplingParams
from kvforge.core.kv.sql_index import SQLKVIndex

TEXT = ("The ferry left the harbour at dawn with the post, three passengers and a crate of oysters, while the "
        "lighthouse keeper wrote the night's weather into a leather notebook and the baker opened the shop.")


@pytest.fixture(scope="module")
def populated(embedded_path, tmp_path_factory) -> tuple[Path, dict[int, str]]:
    """A data directory with both models' blocks persisted; block size -> fingerprint hex."""
    data = tmp_path_factory.mktemp("cache-cli") / "data"
    url = f"sqlite:///{data / 'kvforge.db'}"
    fingerprints = {}
    for block_size in (16, 8):
        engine = LLMEngine(EngineConfig(model=str(embedded_path), block_size=block_size, kv_cache_bytes=16 << 20,
                                        persist_kv=True, data_dir=str(data), db_url=url), progress=False)
        engine.add_request(engine.tokenizer.encode(TEXT), SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished():
            engine.step()
        assert engine.persisted.flush()
        engine.close()  # closes the database it opened (SQLite checkpoints the WAL): the files can be copied
        fingerprints[block_size] = engine.fingerprint.hex()
    return data, fingerprints


@pytest.fixture
def data_dir(populated, tmp_path) -> Path:
    """A private copy of the populated directory (tests change it); its store is the default one in it."""
    copy = tmp_path / "data"
    shutil.copytree(populated[0], copy)
    return copy


def cache(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["cache", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def stats_json(capsys, data_dir: Path) -> dict:
    code, out, err = cache(capsys, "stats", "--data-dir", str(data_dir), "--json")
    assert code == 0, err
    return json.loads(out)  # exactly one JSON object


def index(data_dir: Path) -> dict[str, list]:
    with SQLKVIndex.open(f"sqlite:///{data_dir / 'kvforge.db'}") as kv:
        return {fp.hex(): kv.entries(fp) for fp in kv.totals()}


def kv_files(data_dir: Path, fingerprint: str = "") -> list[Path]:
    return sorted(p for p in (data_dir / "kv" / fingerprint).rglob("*") if p.is_file())


def test_stats_match_files_and_index(capsys, data_dir, populated):
    fingerprints = populated[1]
    s = stats_json(capsys, data_dir)
    rows = index(data_dir)
    assert {m["fingerprint"] for m in s["models"]} == set(fingerprints.values()) == set(rows)
    for m in s["models"]:
        files = kv_files(data_dir, m["fingerprint"])
        entries = rows[m["fingerprint"]]
        assert m["blocks"] == len(entries) == len(files) == m["files"] > 0
        assert m["bytes"] == sum(e.nbytes for e in entries) == sum(f.stat().st_size for f in files)
    # the prompt is ~45 tokens: twice as many full blocks of 8 tokens as of 16
    by_fp = {m["fingerprint"]: m["blocks"] for m in s["models"]}
    assert by_fp[fingerprints[8]] >= 2 * by_fp[fingerprints[16]] >= 4
    assert s["total"] == {"blocks": sum(by_fp.values()), "bytes": sum(m["bytes"] for m in s["models"])}
    assert s["files_on_disk"] == s["index_rows"] == s["total"]["blocks"]
    assert s["orphan_files"] == s["missing_files"] == 0
    assert s["kv_dir"] == str(data_dir / "kv") and s["db"].endswith("kvforge.db")


def test_stats_table_and_orphans(capsys, data_dir, populated):
    fp16 = populated[1][16]
    (data_dir / "kv" / fp16 / "zz").mkdir()
    (data_dir / "kv" / fp16 / "zz" / "stray.kv").write_bytes(b"not a block")  # a crash between write and index
    kv_files(data_dir, populated[1][8])[0].unlink()  # a file removed behind the index's back
    code, out, err = cache(capsys, "stats", "--data-dir", str(data_dir))
    assert code == 0, err
    assert fp16 in out and populated[1][8] in out and "total" in out and "MiB" in out
    assert "1 orphan files" in out and "1 rows whose file is missing" in out
    s = stats_json(capsys, data_dir)
    assert s["orphan_files"] == 1 and s["missing_files"] == 1 and s["files_on_disk"] == s["index_rows"]


def test_clear_one_fingerprint_keeps_the_other(capsys, data_dir, populated):
    fp16, fp8 = populated[1][16], populated[1][8]
    before = stats_json(capsys, data_dir)
    kept = next(m for m in before["models"] if m["fingerprint"] == fp8)
    gone = next(m for m in before["models"] if m["fingerprint"] == fp16)
    code, out, err = cache(capsys, "clear", "--data-dir", str(data_dir), "--fingerprint", fp16)
    assert code == 0, err
    assert fp16 in out and f"{gone['blocks']} index rows" in out and f"{gone['files']} files" in out
    assert not (data_dir / "kv" / fp16).exists()
    assert set(index(data_dir)) == {fp8} and len(kv_files(data_dir)) == kept["files"]
    after = stats_json(capsys, data_dir)
    assert after["models"] == [kept] and after["orphan_files"] == after["missing_files"] == 0


def test_clear_everything(capsys, data_dir):
    before = stats_json(capsys, data_dir)
    code, out, err = cache(capsys, "clear", "--data-dir", str(data_dir), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["index_rows"] == before["total"]["blocks"] == result["files"] > 0
    assert result["file_bytes"] == before["bytes_on_disk"]
    assert index(data_dir) == {} and kv_files(data_dir) == []
    assert [p for p in (data_dir / "kv").rglob("*")] == []  # the empty directories went too
    after = stats_json(capsys, data_dir)
    assert after["models"] == [] and after["files_on_disk"] == after["index_rows"] == 0


def test_explicit_db_url(capsys, data_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    db = elsewhere / "index.db"
    shutil.move(data_dir / "kvforge.db", db)
    code, out, err = cache(capsys, "stats", "--data-dir", str(data_dir), "--db", f"sqlite:///{db}", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["index_rows"] == s["files_on_disk"] > 0 and s["orphan_files"] == 0


def test_missing_directory_creates_nothing(capsys, tmp_path):
    nowhere = tmp_path / "nowhere"
    code, out, err = cache(capsys, "stats", "--data-dir", str(nowhere))
    assert code == 0, err
    assert "does not exist" in out and "no persisted KV blocks" in out
    code, out, err = cache(capsys, "clear", "--data-dir", str(nowhere))
    assert code == 0, err
    assert "0 index rows" in out and "0 files" in out
    assert not nowhere.exists()  # neither a database nor a directory was created


def test_bad_fingerprint_is_a_clear_error(capsys, tmp_path):
    code, out, err = cache(capsys, "clear", "--data-dir", str(tmp_path), "--fingerprint", "xyz")
    assert code == 2 and "--fingerprint" in err and "Traceback" not in err
