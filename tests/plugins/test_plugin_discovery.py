"""Entry-point discovery of quantization plugins, with real third-party packages built from source
in the test and installed by pip into a private --target directory (no fake metadata files)."""

from __future__ import annotations

import importlib
import re
import shutil
from pathlib import Path

import pytest
import torch

from kvforge.core import LLM, SamplingParams
from kvforge.core.layers.linear import LinearBase
from kvforge.core.plugins import QUANT_GROUP, QuantMethod, discover, refresh_plugins
from kvforge.plugins.quant.dense import DenseMethod
from tests.helpers.plugin_packages import build_and_install, toy_int8_site

VOCAB = 49152

SQUATTER_SOURCE = '''
from kvforge.plugins.quant.dense import DenseMethod
from tests.helpers.plugin_packages import build_and_install, toy_int8_site


class SquatterMethod(DenseMethod):
    """Claims the built-in name `none`."""

    description = "A third-party replacement for the dense method."
'''

BROKEN_SOURCE = '''
raise ImportError("kvforge_broken_plugin needs libtoyquant.so, which is not installed")
'''


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory):
    return toy_int8_site(tmp_path_factory.mktemp("toy-int8"))


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory):
    return build_and_install(tmp_path_factory.mktemp("broken"), "kvforge-broken-plugin", "0.0.1",
                              "kvforge_broken_plugin", BROKEN_SOURCE, {"broken": "kvforge_broken_plugin:Method"})


@pytest.fixture(scope="module")
def squatter_site(tmp_path_factory):
    return build_and_install(tmp_path_factory.mktemp("squatter"), "kvforge-none-squatter", "1.0",
                              "kvforge_none_squatter", SQUATTER_SOURCE,
                              {"none": "kvforge_none_squatter:SquatterMethod"})


@pytest.fixture(autouse=True)
def _rescan_plugins():
    """Discovery is cached per process: rescan after each test's sites left sys.path (monkeypatch's undo
    runs before this teardown), so later tests do not see them."""
    yield
    refresh_plugins()


def _use(monkeypatch, *sites: Path) -> None:
    for site in sites:
        monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    refresh_plugins()


# --- the built-in ---------------------------------------------------------------------------------


def test_builtin_dense_method_is_discovered():
    registry = discover(QUANT_GROUP)
    assert registry.plugins["none"] is DenseMethod
    assert registry.sources["none"].split()[0] == "kvforge"
    assert not any(name.startswith("none") for name in registry.errors), registry.errors
    assert registry.get("none") is DenseMethod
    with pytest.raises(ValueError, match="toy-int8"):
        registry.get("toy-int8")  # not installed in this test


# --- a working third-party plugin -----------------------------------------------------------------


def test_third_party_plugin_is_discovered_with_its_distribution(monkeypatch, toy_site):
    assert "toy-int8" not in discover(QUANT_GROUP).plugins  # invisible until its site is on sys.path
    _use(monkeypatch, toy_site)
    registry = discover(QUANT_GROUP)
    assert set(registry.plugins) >= {"none", "toy-int8"}
    cls = registry.get("toy-int8")
    assert cls.__module__ == "kvforge_toy_int8" and cls.__name__ == "ToyInt8Method"
    assert issubclass(cls, QuantMethod) and cls.name == "toy-int8"
    dist, version = registry.sources["toy-int8"].split()
    assert _normalize(dist) == "kvforge-toy-int8" and version == "0.3.1"
    assert registry.plugins["none"] is DenseMethod
    assert not [key for key in registry.errors if key.split()[0] in ("none", "toy-int8")], registry.errors


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, embedded_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                         initializer_range=0.3, rms_norm_eps=1e-6, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(99)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_path / name, path / name)
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_third_party_plugin_runs_the_model(monkeypatch, toy_site, tiny_dir):
    _use(monkeypatch, toy_site)
    path, hf_weights = tiny_dir
    plugin_module = importlib.import_module("kvforge_toy_int8")
    plugin_cls = plugin_module.ToyInt8Method

    llm = LLM(str(path), quant="toy-int8", progress=False, num_kv_blocks=64)
    model = llm.engine.runner.model
    linears = [m for name, m in model.named_modules() if isinstance(m, LinearBase) and name != "lm_head"]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer
    assert isinstance(model.lm_head.quant_method, DenseMethod)  # the head stays dense
    for layer in linears:
        assert isinstance(layer.quant_method, plugin_cls)
        assert layer.qweight.dtype == torch.int8
        assert "weight" not in dict(layer.named_parameters(recurse=False))

    # The quantized fused qkv projection computes what HF's q/k/v weights do, within int8 error.
    prefix = "model.layers.1.self_attn."
    w = torch.cat([hf_weights[prefix + f"{p}_proj.weight"] for p in "qkv"])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = model.model.layers[1].self_attn.qkv_proj(x)
    want = x @ w.T
    assert got.shape == want.shape
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.02, rel  # quantized (not bit-identical), yet close

    calls_before = plugin_module.APPLY_CALLS
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 12)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert len(outs) == 2
    for out in outs:
        assert 1 <= len(out.token_ids) <= 8
        assert all(0 <= t < VOCAB for t in out.token_ids)
        assert out.finish_reason in ("length", "stop")
    steps = max(len(o.token_ids) for o in outs)
    assert plugin_module.APPLY_CALLS - calls_before >= steps * len(linears)
    assert llm.engine.block_pool.num_used == 0


# --- a broken plugin ------------------------------------------------------------------------------


def test_broken_plugin_is_reported_and_others_still_load(monkeypatch, toy_site, broken_site):
    _use(monkeypatch, broken_site, toy_site)
    registry = discover(QUANT_GROUP)
    assert "broken" not in registry.plugins
    assert "ImportError" in registry.errors["broken"] and "libtoyquant" in registry.errors["broken"]
    assert registry.plugins["none"] is DenseMethod
    assert registry.plugins["toy-int8"].__name__ == "ToyInt8Method"
    with pytest.raises(ValueError, match="failed to load"):
        registry.get("broken")


# --- a plugin that claims a built-in name ---------------------------------------------------------


def test_plugin_claiming_builtin_name_is_refused(monkeypatch, squatter_site):
    _use(monkeypatch, squatter_site)
    registry = discover(QUANT_GROUP)
    assert registry.plugins["none"] is DenseMethod
    assert registry.sources["none"].split()[0] == "kvforge"
    refused = [key for key in registry.errors if key.startswith("none")]
    assert len(refused) == 1, registry.errors
    assert "squatter" in refused[0] and "duplicate" in registry.errors[refused[0]]


def test_plugin_claiming_builtin_name_wins_with_override(monkeypatch, squatter_site):
    _use(monkeypatch, squatter_site)
    registry = discover(QUANT_GROUP, override={"none"})
    cls = registry.plugins["none"]
    assert cls is not DenseMethod and cls.__name__ == "SquatterMethod" and issubclass(cls, DenseMethod)
    dist, version = registry.sources["none"].split()
    assert _normalize(dist) == "kvforge-none-squatter" and version == "1.0"
    assert not [key for key in registry.errors if key.startswith("none")], registry.errors
    # override only applies to the names listed
    assert discover(QUANT_GROUP, override={"other"}).plugins["none"] is DenseMethod


def test_third_party_plugin_is_discovered_in_every_tensor_parallel_rank(monkeypatch, toy_site, tiny_dir):
    """Each rank is its own process and discovers plugins itself: without the package on its path rank 1
    cannot load the model (a clear error); with it, TP = 2 runs through the plugin. The toy plugin's
    per-row int8 scale sees only a rank's part of a row-parallel layer's rows, so TP = 2 is compared with
    TP = 1 by perplexity, not token for token."""
    import os

    from kvforge.core.perplexity import perplexity

    _use(monkeypatch, toy_site)
    path, _ = tiny_dir
    with pytest.raises(ValueError, match="rank 1: ValueError: unknown kvforge.quant plugin 'toy-int8'"):
        LLM(str(path), quant="toy-int8", progress=False, num_kv_blocks=64, tp_size=2)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(toy_site), os.environ.get("PYTHONPATH", "")]))
    text = list(range(3, 200, 3))
    ppl = {}
    for tp in (1, 2):
        llm = LLM(str(path), quant="toy-int8", progress=False, num_kv_blocks=64, tp_size=tp)
        try:
            ppl[tp] = perplexity(llm.engine, text)
        finally:
            llm.engine.close()
    dense = LLM(str(path), progress=False, num_kv_blocks=64)
    dense_ppl = perplexity(dense.engine, text)
    assert abs(ppl[2] / ppl[1] - 1) < 0.01 and ppl[2] != dense_ppl, (ppl, dense_ppl)
