"""Kernel choice by measurement (core/kernel_choice.py): the decision rule, the cache per CPU signature, a
busy machine's timing not cached, the decode-attention variants agreeing with each other, and an engine that
keeps greedy parity whichever kernels are chosen."""

from __future__ import annotations

import json

import pytest
import torch

from kvforge.core import LLM, SamplingParams
from kvforge.core.cpu import cpu_signature, describe_cpu, native_bf16
from kvforge.core.kernel_choice import ChoiceCache, LinearKernel, choose_kernels, pick, time_kernels
from kvforge.core.layers.linear import ReplicatedLinear
from kvforge.plugins.quant.dense import onednn_packing_available
from tests.helpers.parity import compare, hf_greedy


def test_the_stock_kernel_stays_unless_another_is_clearly_faster():
    # geometric mean of the ratios over row counts: 0.5 * 2.0 -> 1.0, no gain, the stock one stays
    assert pick({"torch": {1: 10.0, 16: 10.0}, "onednn": {1: 5.0, 16: 20.0}}) == "torch"
    assert pick({"torch": {1: 10.0, 16: 10.0}, "onednn": {1: 9.8, 16: 9.8}}) == "torch"  # 2%: noise
    assert pick({"torch": {1: 10.0, 16: 10.0}, "onednn": {1: 8.0, 16: 9.0}}) == "onednn"
    assert pick({"a": {1: 10.0}, "b": {1: 8.0}, "c": {1: 4.0}}) == "c"


def test_cache_is_per_signature_and_merges(tmp_path):
    signature = cpu_signature()
    cache = ChoiceCache(tmp_path, signature)
    cache.write({"A:float32:4x4": {"choice": "onednn", "us": {"torch": {"1": 2.0}, "onednn": {"1": 1.0}}}})
    ChoiceCache(tmp_path, signature).write({"A:float32:8x8": {"choice": "torch", "us": {}}})
    assert set(ChoiceCache(tmp_path, signature).read()) == {"A:float32:4x4", "A:float32:8x8"}
    other = ChoiceCache(tmp_path, {**signature, "threads": signature["threads"] + 1})
    assert other.read() == {} and other.path != cache.path  # another thread count: timed again
    data = json.loads(cache.path.read_text())
    assert data["signature"]["cpu"] == signature["cpu"] and data["signature"]["rows"]


def test_describe_cpu_names_the_isa():
    text = describe_cpu()
    assert cpu_signature()["cpu"] in text and "threads" in text
    assert native_bf16() == any(flag in cpu_signature()["isa"] for flag in ("avx512_bf16", "amx_bf16"))


def _slow(weight, x, bias):  # a candidate that does 4x the work
    for _ in range(3):
        torch.nn.functional.linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def test_timing_ranks_a_slower_kernel_behind():
    weight = torch.randn(256, 256)
    kernels = {"stock": LinearKernel(lambda w: w, torch.nn.functional.linear), "slow": LinearKernel(lambda w: w, _slow)}
    timing = time_kernels(weight, None, kernels, rows=(1, 16))
    assert set(timing.us) == {"stock", "slow"} and all(t > 0 for r in timing.us.values() for t in r.values())
    assert pick(timing.us) == "stock"


def test_auto_choice_is_cached_and_read_back(tmp_path, monkeypatch):
    if not onednn_packing_available(torch.empty(1)):
        pytest.skip("this torch build has no oneDNN prepacked linear: nothing to choose")
    import kvforge.core.kernel_choice as kernel_choice

    monkeypatch.setattr(kernel_choice, "NOISY", float("inf"))  # a busy test machine's timing is cached too

    def model():
        layers = torch.nn.Sequential(ReplicatedLinear(64, 48), ReplicatedLinear(64, 48), ReplicatedLinear(48, 64))
        for layer in layers:
            layer.weight_loader(layer.weight, torch.randn_like(layer.weight))
            layer.process_after_loading()
        return layers

    first = choose_kernels(model(), torch.float32, cache_dir=tmp_path)
    assert sorted((c.key, c.layers) for c in first) == [("DenseMethod:float32:48x64", 2),
                                                        ("DenseMethod:float32:64x48", 1)]
    assert not any(c.cached for c in first) and all(set(c.us) == {"torch", "onednn"} for c in first)
    again = choose_kernels(model(), torch.float32, cache_dir=tmp_path)
    assert all(c.cached for c in again) and [c.choice for c in again] == [c.choice for c in first]
    retimed = choose_kernels(model(), torch.float32, cache_dir=tmp_path, retime=True)
    assert not any(c.cached for c in retimed)


def test_a_busy_machines_timing_is_not_cached(tmp_path, monkeypatch):
    if not onednn_packing_available(torch.empty(1)):
        pytest.skip("this torch build has no oneDNN prepacked linear: nothing to choose")
    import kvforge.core.kernel_choice as kernel_choice

    monkeypatch.setattr(kernel_choice, "NOISY", 0.5)  # every timing looks unsteady
    layer = ReplicatedLinear(64, 48)
    layer.weight_loader(layer.weight, torch.randn_like(layer.weight))
    layer.process_after_loading()
    assert len(choose_kernels(torch.nn.Sequential(layer), torch.float32, cache_dir=tmp_path)) == 1
    assert not (tmp_path / "kernel_choice").exists() or not any((tmp_path / "kernel_choice").iterdir())


def test_unknown_or_unavailable_kernel_is_refused(tmp_path):
    with pytest.raises(ValueError, match="linear_kernels must be one of auto, torch, onednn"):
        choose_kernels(torch.nn.Sequential(), torch.float32, linear="fast", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="decode_attention must be one of auto, bmm, bmm-native, sdpa"):
        choose_kernels(torch.nn.Sequential(), torch.float32, attention="flash", cache_dir=tmp_path)
    layer = ReplicatedLinear(64, 48, params_dtype=torch.float16)  # fp16: no oneDNN kernel offered
    layer.process_after_loading()
    with pytest.raises(ValueError, match="linear_kernels='onednn' is not available here"):
        choose_kernels(torch.nn.Sequential(layer), torch.float16, linear="onednn", cache_dir=tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_decode_attention_variants_agree(dtype, window, softcap):
    """bmm (fp32 math), bmm-native and sdpa (the model dtype) give the same attention over padded groups: a reference
    computed per sequence in fp64 over its own visible keys; soft-capped (Gemma 2) by those that offer it."""
    from kvforge.core.layers.decode_attention import DECODE_VARIANTS

    g, heads, kv_heads, d, padded = 5, 6, 2, 32, 64
    q = torch.randn(g, heads, d).to(dtype)
    kv = torch.randn(2, g, kv_heads, padded, d).to(dtype)
    lengths = torch.tensor([64, 50, 17, 1, 63])
    expected = torch.empty(g, heads, d, dtype=torch.float64)
    for s_ in range(g):
        end, start = int(lengths[s_]), 0 if window is None else max(0, int(lengths[s_]) - window)
        for h in range(heads):
            keys = kv[0, s_, h // (heads // kv_heads), start:end].double()
            values = kv[1, s_, h // (heads // kv_heads), start:end].double()
            scores = keys @ q[s_, h].double() * d ** -0.5
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            expected[s_, h] = torch.softmax(scores, dim=0) @ values
    gathering = {name: v for name, v in DECODE_VARIANTS.items()  # "paged": test_cpu_kernels.py
                 if v.mask is not None and (v.soft_caps or softcap is None)}
    assert len(gathering) == (3 if softcap is None else 2)
    for name, variant in gathering.items():
        out = variant.run(q, kv, variant.mask(lengths, padded, window, kv_heads, heads // kv_heads), d ** -0.5,
                          softcap)
        assert out.shape == (g, heads * d) and out.dtype == dtype, name
        error = (out.double().view(g, heads, d) - expected).abs().max().item()
        assert error < (1e-5 if dtype == torch.float32 else 2e-2), (name, error)
    full = torch.full((g,), padded)
    assert all(v.mask(full, padded, None, kv_heads, 3) is None for v in gathering.values())


@pytest.fixture()
def quick_attention_timing(monkeypatch):
    """Decode attention timed at one short context, every timing taken as steady (so cached)."""
    import kvforge.core.kernel_choice as kernel_choice

    monkeypatch.setattr(kernel_choice, "NOISY", float("inf"))
    monkeypatch.setattr(kernel_choice, "TIMED_CONTEXTS", (32,))


def test_decode_attention_is_timed_and_cached_with_the_linears(tmp_path, quick_attention_timing):
    from kvforge.core.layers.attention import Attention

    model = torch.nn.Sequential(Attention(4, 2, 16, 0.25, layer_index=0), Attention(4, 2, 16, 0.25, layer_index=1))
    first = choose_kernels(model, torch.float32, cache_dir=tmp_path)
    assert [(c.key, c.layers, set(c.us)) for c in first] == [
        ("decode_attention:float32:4x2x16", 2, {"bmm", "bmm-native", "sdpa", "paged"})]
    assert {layer.decode_variant for layer in model} == {first[0].choice}
    assert choose_kernels(model, torch.float32, cache_dir=tmp_path)[0].cached
    forced = choose_kernels(model, torch.bfloat16, attention="sdpa", cache_dir=tmp_path)
    assert forced[0].choice == "sdpa" and {layer.decode_variant for layer in model} == {"sdpa"}


def test_soft_capped_layers_are_timed_apart_without_sdpa(tmp_path, quick_attention_timing):
    """Layers with soft-capping (Gemma 2) form their own class, among the variants that cap: naming sdpa, which
    cannot, is a clear error (for the model and for one layer)."""
    from kvforge.core.layers.attention import Attention

    model = torch.nn.Sequential(Attention(4, 2, 16, 0.25, layer_index=0),
                                Attention(4, 2, 16, 0.25, layer_index=1, softcap=50.0))
    classes = choose_kernels(model, torch.float32, cache_dir=tmp_path)
    assert [(c.key, set(c.us)) for c in classes] == [
        ("decode_attention:float32:4x2x16", {"bmm", "bmm-native", "sdpa", "paged"}),
        ("decode_attention:float32:4x2x16:softcap", {"bmm", "bmm-native", "paged"})]
    with pytest.raises(ValueError, match="decode_attention='sdpa' cannot run here: .*soft-capping"):
        choose_kernels(model, torch.float32, attention="sdpa", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="soft-capping"):
        model[1].use_decode_variant("sdpa")


def test_auto_keeps_bf16_decode_attention_to_fp32_math(tmp_path, quick_attention_timing):
    """In bf16 the model-dtype variants are timed (the bench shows them) but auto runs an fp32-math one (bmm or the
    paged C kernel), even where another is faster: its K/V is what prefill (fp32 attention) writes for the same
    tokens, up to fp32's last bit."""
    from kvforge.core.layers.attention import Attention

    model = torch.nn.Sequential(Attention(4, 2, 16, 0.25, layer_index=0))
    loaded = choose_kernels(model, torch.bfloat16, cache_dir=tmp_path)
    assert set(loaded[0].us) == {"bmm", "bmm-native", "sdpa", "paged"} and loaded[0].choice in {"bmm", "paged"}
    assert loaded[0].choice == pick({name: loaded[0].us[name] for name in ("bmm", "paged")})
    assert {layer.decode_variant for layer in model} == {loaded[0].choice}


def test_an_unavailable_decode_attention_is_refused_by_name_and_skipped_by_auto(tmp_path):
    """Without a C compiler the paged kernel is not offered: auto times and picks among the others, naming it is a
    clear error (a fresh process: the kernel is built once per process)."""
    import subprocess
    import sys

    script = """
import torch
from kvforge.core.kernel_choice import choose_kernels
from kvforge.core.layers.attention import Attention
model = torch.nn.Sequential(Attention(4, 2, 16, 0.25))
chosen = choose_kernels(model, torch.float32)
assert "paged" not in chosen[0].us and chosen[0].choice != "paged", chosen
try:
    choose_kernels(model, torch.float32, attention="paged")
except ValueError as e:
    print(e)
"""
    env = {**__import__("os").environ, "CC": str(tmp_path / "no-such-compiler"), "KVFORGE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "decode_attention='paged' cannot run here: the C compiler" in done.stdout
    assert "no-such-compiler" in done.stdout


@pytest.fixture(scope="module")
def hf_model(embedded_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_path, dtype=torch.float32).eval()


@pytest.mark.parametrize(("linear", "attention"), [("torch", "bmm"), ("onednn", "sdpa"), ("torch", "paged")])
def test_greedy_parity_holds_with_either_kernel(linear, attention, embedded_path, hf_model):
    """fp32 greedy tokens equal HF transformers' whichever kernels the choice lands on."""
    if linear == "onednn" and not onednn_packing_available(torch.empty(1)):
        pytest.skip("this torch build has no oneDNN prepacked linear")
    llm = LLM(str(embedded_path), progress=False, dtype="float32", linear_kernels=linear, decode_attention=attention,
              kv_cache_bytes=64 << 20)
    try:
        chosen = llm.engine.runtime().kernel_choices
        assert {v for k, v in chosen.items() if not k.startswith("decode_attention")} == {linear}
        assert {v for k, v in chosen.items() if k.startswith("decode_attention")} == {attention}
        tok = llm.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}])
                   for q in ("What is the capital of France? Answer briefly.", "List three colours of the rainbow.",
                             "Hi!")]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        theirs, logits = hf_greedy(hf_model, prompts, 16, pad_id=tok.hf.pad_token_id or 0, eos_ids=tok.eos_token_ids)
        report = compare([o.token_ids for o in outs], theirs, logits)
        assert report.exact == len(prompts), report
    finally:
        llm.engine.close()
