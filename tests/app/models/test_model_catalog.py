"""`kvforge models`: the models directory's entries (the UI picker's list) with format, architecture,
quantization, size and a memory estimate that matches what loading measures."""

from __future__ import annotations

import json
import os
import shutil

from kvforge.app.cli import main
from kvforge.app.models.catalog import catalog, model_names
from kvforge.core import LLM
from kvforge.core.config import kv_bytes_per_token
from kvforge.core.loader import EMBEDDED_MODEL


def link_or_copy(source, target) -> None:
    """Hard links where the filesystem allows (the files are large), copies elsewhere: an entry is listed only if it
    is really inside the models directory, and a symlink to the original is not."""
    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if source.is_dir():
        shutil.copytree(source, target, copy_function=link)
    else:
        link(source, target)


def test_the_list_describes_every_entry(tmp_path, gemma_gguf_path, embedded_path, capsys):
    link_or_copy(gemma_gguf_path, tmp_path / "gemma.gguf")
    link_or_copy(embedded_path, tmp_path / "smol-dense")
    os.symlink(tmp_path / "gemma.gguf", tmp_path / "alias.gguf")  # a link within the directory is an entry
    os.symlink(embedded_path, tmp_path / "outside")  # one out of it is not
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    (tmp_path / "notes.txt").write_text("not a model")
    assert model_names(tmp_path) == [EMBEDDED_MODEL, "alias.gguf", "broken", "gemma.gguf", "smol-dense"]
    os.remove(tmp_path / "alias.gguf")
    entries = {e.name: e for e in catalog(tmp_path, 1024, "bfloat16")}
    assert set(entries) == {EMBEDDED_MODEL, "broken", "gemma.gguf", "smol-dense"}
    embedded, gemma, dense = entries[EMBEDDED_MODEL], entries["gemma.gguf"], entries["smol-dense"]
    assert (embedded.format, embedded.architecture, embedded.quantization) == ("gguf", "llama", "Q4_1")
    assert (gemma.format, gemma.architecture, gemma.quantization) == ("gguf", "gemma3", "Q4_K_M")
    assert (dense.format, dense.architecture, dense.quantization) == ("safetensors", "LlamaForCausalLM", "none")
    assert embedded.parameters == dense.parameters and 130e6 < embedded.parameters < 140e6
    assert gemma.size_bytes == gemma_gguf_path.stat().st_size
    assert entries["broken"].error and entries["broken"].memory_bytes is None
    assert main(["models", "--models-dir", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in listed] == model_names(tmp_path)
    assert all(e["stages"] is None for e in listed)
    # --pp: each stage's layers and memory, for the GGUF files and the checkpoint alike (the same split)
    assert main(["models", "--models-dir", str(tmp_path), "--pp", "2", "--json"]) == 0
    staged = {e["name"]: e for e in json.loads(capsys.readouterr().out)}
    for name in (EMBEDDED_MODEL, "smol-dense"):
        first, last = staged[name]["stages"]
        assert (first["layers"], last["layers"]) == ([0, 11], [11, 30])
        assert abs(first["total_bytes"] + last["total_bytes"] - staged[name]["memory_bytes"]) <= 2
    assert main(["models", "--models-dir", str(tmp_path), "--pp", "2"]) == 0
    assert "  stage 1: layers 11-29" in capsys.readouterr().out


def test_the_gguf_estimate_is_what_loading_measures():
    """The embedded GGUF in fp32 (its default on CPUs without native bf16): weights estimated within 5% of the
    loaded engine's -- the blocks read in place from the file (the tied head and the embedding sharing one table),
    the norms dense."""
    entry = catalog(None, 0, "float32")[0]
    assert entry.weights_bytes == entry.memory_bytes  # no context: the weights alone
    llm = LLM(progress=False, dtype="float32", kv_cache_bytes=32 << 20)
    measured = llm.engine.runtime().weight_bytes
    assert [m for m in llm.engine.runner.model.modules() if getattr(m, "segments", None) is not None]
    assert abs(entry.memory_bytes / measured - 1) < 0.05, (entry.memory_bytes, measured)
    assert measured < 0.2 * entry.parameters * 4  # a fifth of the dense fp32 weights
    with_context = catalog(None, 2048, "float32")[0].memory_bytes - entry.memory_bytes
    config = llm.engine.hf_config
    assert with_context == 2048 * kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads,
                                                     config.hidden_size // config.num_attention_heads,
                                                     llm.engine.config.torch_dtype)


def test_a_gguf_header_is_parsed_once_per_file_version(tmp_path, gemma_gguf_path):
    """The UI asks for an estimate on every settings change: the header is read once, and read again when the
    file under the name changes (here: the embedded GGUF copied over by Gemma's)."""
    import shutil

    from kvforge.app.models.catalog import describe, gguf_facts
    from kvforge.core.loader import embedded_gguf_path

    path = tmp_path / "model.gguf"
    shutil.copyfile(embedded_gguf_path(), path)
    first = describe("model.gguf", path, 1024)
    assert gguf_facts(path) is gguf_facts(path)  # the second ask reads nothing
    assert (first.architecture, first.quantization) == ("llama", "Q4_1")
    shutil.copyfile(gemma_gguf_path, path)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000_000))
    second = describe("model.gguf", path, 1024)
    assert (second.architecture, second.quantization) == ("gemma3", "Q4_K_M")
    assert second.parameters != first.parameters


def test_a_listing_with_a_deadline_answers_with_what_it_has(tmp_path):
    """The routes' listing: an entry not read by the deadline comes back marked (its read goes on, cached), the
    next listing has it."""
    from kvforge.app.models.catalog import catalog
    from tests.helpers.hostile_files import tiny_gguf, truncated_vocab_gguf

    tiny_gguf(tmp_path / "good.gguf")
    truncated_vocab_gguf(tmp_path / "cut.gguf", tokens=100_000)  # ~40 ms to walk its vocabulary
    first = {e.name: e for e in catalog(tmp_path, 128, names={"cut.gguf"}, deadline_s=0)}
    assert list(first) == ["cut.gguf"] and first["cut.gguf"].error.startswith("not read within 0 s")
    later = {e.name: e for e in catalog(tmp_path, 128, deadline_s=30)}
    assert "truncated" in later["cut.gguf"].error and later["good.gguf"].error is None
    assert later["good.gguf"].parameters == 64 * 64 * 3 + 64 * 128


def test_kvforge_models_counts_the_kv_cache_type(tmp_path, embedded_path, capsys):
    """`kvforge models --kv-cache-dtype`: the KV part of each estimate at the type's bytes (head_dim 64: int8 66 bytes a
    row, q4 40, against bf16's 128), the weights unchanged; the GGUF and its converted checkpoint alike."""
    link_or_copy(embedded_path, tmp_path / "smol-dense")
    listed = {}
    for kv_cache_dtype in ("auto", "int8", "q4"):
        assert main(["models", "--models-dir", str(tmp_path), "--context", "4096", "--dtype", "bfloat16",
                     "--kv-cache-dtype", kv_cache_dtype, "--json"]) == 0
        listed[kv_cache_dtype] = {e["name"]: e for e in json.loads(capsys.readouterr().out)}
    for name in (EMBEDDED_MODEL, "smol-dense"):
        weights = listed["auto"][name]["weights_bytes"]
        kv = {k: entries[name]["memory_bytes"] - weights for k, entries in listed.items()}
        assert {entries[name]["weights_bytes"] for entries in listed.values()} == {weights}
        assert kv["auto"] == 4096 * 2 * 30 * 3 * 128, kv
        assert (kv["int8"], kv["q4"]) == (kv["auto"] * 66 // 128, kv["auto"] * 40 // 128), kv
        assert listed["q4"][name]["memory_bytes"] < listed["int8"][name]["memory_bytes"] < listed["auto"][name][
            "memory_bytes"]
