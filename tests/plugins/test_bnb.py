"""bnb-int8 / bnb-nf4 with the real bitsandbytes: quantized linears against bitsandbytes' own
dequantization and the dense weight, fused shards, options, checkpoints written by transformers'
BitsAndBytesConfig, and a greedy smoke run on the embedded model.

Tolerances (max |out - ref| / max |ref| against F.linear in fp32 with the dequantized weight):
- bfloat16 / float16 compute: 2e-2, the bound tests/plugins/test_dense.py uses for bf16. The input,
  the per-row scales (int8) or the absmax (bitsandbytes' packed 4-bit CPU layout) and the output are
  each rounded to bf16 (2^-9 relative); measured errors are 2e-3 to 6e-3 (fp16: 4e-4).
- float32 compute: 1e-5 (the same products, summed in another order).
- LLM.int8() (threshold > 0): 3e-2; it also quantizes the activations to int8 per row (outlier
  columns above the threshold stay in fp16), a step of max|x| / 127: measured 3e-3 to 4e-3 here.
Against the dense fp32 weight (relative Frobenius error of the output, Gaussian weights and inputs):
int8 < 2e-2 (up to half a step, absmax / 127, per row: measured 6e-3 to 9e-3), nf4 < 0.15 (measured
0.083 to 0.10) and fp4 < 0.2 (0.12 to 0.13): 16 levels per block of 64.
"""

from __future__ import annotations

from pathlib import Path

import bitsandbytes.functional as BF
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from kvforge.core import LLM, SamplingParams
from kvforge.core.layers.linear import LinearBase, MergedColumnParallelLinear, ReplicatedLinear
from kvforge.core.loader import build_model, iterate_tensors, load_config, load_weights
from kvforge.core.plugins import get_quant_method, resolve_quant
from kvforge.core.quant_config import QuantConfig
from kvforge.plugins.quant.bnb_checkpoint import dequantize_checkpoint
from kvforge.plugins.quant.bnb_common import dequantize_4bit, dequantize_int8
from kvforge.plugins.quant.bnb_int8 import INT8PACK_MAX_ROWS, BnbInt8Method, quantize_int8
from kvforge.plugins.quant.bnb_nf4 import BnbNf4Method, quantize_4bit

K, N = 128, 96
CASES = [
    (BnbInt8Method, {}),
    (BnbInt8Method, {"compute_dtype": "float32"}),
    (BnbInt8Method, {"threshold": 6.0}),
    (BnbNf4Method, {}),
    (BnbNf4Method, {"double_quant": True}),
    (BnbNf4Method, {"quant_type": "fp4"}),
    (BnbNf4Method, {"blocksize": 128, "compute_dtype": "float32"}),
    (BnbNf4Method, {"blocksize": 256, "compute_dtype": "float16"}),  # blocks span two rows of 128
]
DENSE_BOUND = {"int8": 2e-2, "nf4": 0.15, "fp4": 0.2}


def _case_id(case) -> str:
    cls, options = case
    return cls.name + "".join(f"-{k}={v}" for k, v in options.items())


def _dequantize_4bit_reference(packed: torch.Tensor, state) -> torch.Tensor:
    """Pure torch: two codes a byte (high nibble first) over the flat weight, one absmax per block."""
    data = packed.view(torch.uint8).reshape(-1)
    codes = torch.stack([data >> 4, data & 15], dim=1).reshape(-1)[: state.shape.numel()].long()
    absmax = state.absmax.float()
    if state.nested:
        absmax = BF.dequantize_blockwise(state.absmax, state.state2) + state.offset
    scale = absmax.repeat_interleave(state.blocksize)[: codes.numel()]
    return (state.code[codes] * scale).reshape(state.shape)


def _reference_weight(method, weight: torch.Tensor) -> torch.Tensor:
    """The method's bitsandbytes quantization of `weight`, dequantized."""
    if isinstance(method, BnbInt8Method):
        return dequantize_int8(*quantize_int8(weight))
    o = method.options
    packed, state = quantize_4bit(weight, o["quant_type"], o["blocksize"], o["double_quant"])
    reference = _dequantize_4bit_reference(packed, state)
    if weight.shape[1] % o["blocksize"] == 0:  # where bitsandbytes' own CPU dequantization is right
        assert torch.equal(reference.to(weight.dtype), BF.dequantize_4bit(packed, state))
    return reference


def _tolerance(method) -> float:
    if method.options.get("threshold", 0) > 0:
        return 3e-2
    return 1e-5 if method.options["compute_dtype"] == "float32" else 2e-2


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_layer_matches_bitsandbytes_dequantization(case):
    cls, options = case
    method = cls(**options)
    weight, bias = torch.randn(N, K) * 0.05, torch.randn(N) * 0.1
    layer = ReplicatedLinear(K, N, bias=True, quant_method=method)
    layer.weight_loader(layer.weight, weight)
    layer.weight_loader(layer.bias, bias)
    layer.process_after_loading()
    assert layer.weight is None and "weight" not in dict(layer.named_parameters())

    reference_weight = _reference_weight(method, weight)
    kind = "int8" if cls is BnbInt8Method else method.options["quant_type"]
    if kind != "int8" and BF.has_avx512bf16():  # the fast CPU path is taken where it applies
        o = method.options
        assert layer.bnb_cpu_packed == (o["compute_dtype"] == "bfloat16" and K % o["blocksize"] == 0)
    for rows in (1, 7, INT8PACK_MAX_ROWS + 8):  # decode sizes and a prefill chunk (another int8 kernel)
        x = torch.randn(rows, K)
        if method.options.get("threshold"):
            x[:, 3] *= 20  # an outlier feature, above LLM.int8()'s threshold: it goes through in fp16
        out = layer(x)
        assert out.shape == (rows, N) and out.dtype == x.dtype
        reference = F.linear(x, reference_weight, bias)
        error = (out - reference).abs().max() / reference.abs().max()
        assert error < _tolerance(method), error
        dense = F.linear(x, weight)
        dense_error = (out - bias - dense).norm() / dense.norm()
        print(f"{_case_id(case)} rows={rows}: {error:.1e} against the dequantized weight, {dense_error:.3f} dense")
        assert dense_error < DENSE_BOUND[kind]

    x3 = torch.randn(2, 3, K)  # leading dims are kept
    assert torch.allclose(layer(x3), layer(x3.view(6, K)).view(2, 3, N))
    assert layer(torch.randn(0, K)).shape == (0, N)  # bitsandbytes' packed CPU kernel crashes on these
    strided = torch.randn(3, 2 * K, dtype=torch.bfloat16)[:, ::2]  # a non-contiguous bf16 input
    assert torch.allclose(layer(strided), layer(strided.contiguous()))

    dense_bytes = weight.numel() * 4
    if kind == "int8":
        ratio = method.weight_bytes(layer) / dense_bytes
        assert 0.25 <= ratio < 0.27, ratio  # int8 codes + fp32 and bf16 row scales
    else:
        # The code tables (16 values, and 256 more for the nested absmax of double quantization where the
        # packed CPU layout does not replace it) are a fixed cost per layer: 1 KB is 15% of this small test
        # layer's 4-bit size and nothing on a real one. Per weight: 4-bit codes + one absmax per block.
        state = layer.bnb_quant_state
        codes = (state.code, state.state2.code) if state.nested else (state.code,)
        tables = sum(t.numel() * t.element_size() for t in codes if t is not None)
        ratio = (method.weight_bytes(layer) - tables) / dense_bytes
        assert 1 / 8 <= ratio < 0.15, ratio


@pytest.mark.parametrize("cls", [BnbInt8Method, BnbNf4Method])
def test_bf16_model_and_unaligned_input(cls):
    """A bf16 model feeds bf16 activations, possibly views that do not start on a 64-byte boundary
    (torch's int8 kernel uses aligned loads)."""
    weight = torch.randn(N, K, dtype=torch.bfloat16) * 0.05
    layer = ReplicatedLinear(K, N, quant_method=cls(), params_dtype=torch.bfloat16)
    layer.weight_loader(layer.weight, weight)
    layer.process_after_loading()
    reference_weight = _reference_weight(layer.quant_method, weight)
    for rows in (1, 3):
        x = torch.randn(rows * (K + 8), dtype=torch.bfloat16)[8: 8 + rows * K].view(rows, K)
        assert x.is_contiguous() and x.data_ptr() % 64
        out = layer(x)
        assert out.dtype == torch.bfloat16
        reference = F.linear(x.float(), reference_weight.float())
        assert (out.float() - reference).abs().max() / reference.abs().max() < 2e-2


@pytest.mark.parametrize("blocksize", [64, 128, 256])
def test_4bit_dequantization_with_blocks_across_rows(blocksize):
    """K = 576 (the embedded model): blocks of 128 and 256 span two rows. bitsandbytes 0.50.2's CPU
    dequantize_4bit gets such 2-D weights wrong; the plugin dequantizes the flat layout."""
    weight = torch.randn(40, 576)
    for quant_type in ("nf4", "fp4"):
        packed, state = quantize_4bit(weight, quant_type, blocksize, double_quant=blocksize == 256)
        assert torch.equal(dequantize_4bit(packed, state), _dequantize_4bit_reference(packed, state))


@pytest.mark.parametrize("cls", [BnbInt8Method, BnbNf4Method])
def test_fused_shards_quantize_like_separate_layers(cls):
    """Rows never mix across the fused projections: int8 scales are per row, and 4-bit blocks stay
    inside a row when the block size divides K (128 here)."""
    shards = [torch.randn(64, K) * 0.05, torch.randn(32, K) * 0.02]
    method = cls(compute_dtype="float32")  # the standard bitsandbytes layout, to compare codes
    fused = MergedColumnParallelLinear(K, [64, 32], quant_method=method)
    for shard_id, shard in enumerate(shards):
        fused.weight_loader(fused.weight, shard, shard_id)
    fused.process_after_loading()
    if cls is BnbInt8Method:
        parts = [quantize_int8(s) for s in shards]
        assert torch.equal(fused.bnb_codes, torch.cat([p[0] for p in parts]))
        assert torch.equal(fused.bnb_scb, torch.cat([p[1] for p in parts]))
    else:
        parts = [quantize_4bit(s) for s in shards]
        assert torch.equal(fused.bnb_packed, torch.cat([p[0] for p in parts]))
        assert torch.equal(fused.bnb_quant_state.absmax, torch.cat([p[1].absmax for p in parts]))
    x = torch.randn(3, K)
    separate = []
    for shard in shards:
        layer = ReplicatedLinear(K, shard.shape[0], quant_method=cls(compute_dtype="float32"))
        layer.weight_loader(layer.weight, shard)
        layer.process_after_loading()
        separate.append(layer(x))
    assert torch.allclose(fused(x), torch.cat(separate, dim=1), rtol=1e-5, atol=1e-6)


def test_options_are_validated_by_name():
    with pytest.raises(ValueError, match="'quant_type'"):
        BnbNf4Method(quant_type="nf5")
    with pytest.raises(ValueError, match="'blocksize'"):
        BnbNf4Method(blocksize=32)
    with pytest.raises(ValueError, match="'block_size'"):  # unknown option
        BnbNf4Method(block_size=64)
    with pytest.raises(ValueError, match="'double_quant'"):
        BnbNf4Method(double_quant="yes")
    with pytest.raises(ValueError, match="'threshold'"):
        BnbInt8Method(threshold=-1.0)
    with pytest.raises(ValueError, match="'compute_dtype'"):
        BnbInt8Method(compute_dtype="int8")
    assert get_quant_method("bnb-nf4").options == {
        "quant_type": "nf4", "double_quant": False, "blocksize": 64, "compute_dtype": "bfloat16"}
    assert get_quant_method("bnb-int8", threshold=6).options == {"threshold": 6, "compute_dtype": "bfloat16"}
    assert BnbInt8Method.bits_per_weight({}) == pytest.approx(8.1)
    assert BnbNf4Method.bits_per_weight({}) == 4.5
    assert BnbNf4Method.bits_per_weight({"blocksize": 128}) == 4.25
    assert BnbNf4Method.bits_per_weight({"double_quant": True}) == 4 + 8 / 64 + 32 / (64 * 256)


# --- checkpoints written by transformers ---------------------------------------------------------

FORMATS = {
    "int8": dict(load_in_8bit=True),
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("dense-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bnb_checkpoint(dense_dir, tmp_path_factory):
    """fmt -> (saved directory, {module prefix: bitsandbytes' dequantization of the quantized layer}),
    each format quantized by transformers and saved once."""
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    saved = {}

    def get(fmt: str):
        if fmt not in saved:
            model = LlamaForCausalLM.from_pretrained(dense_dir, device_map="cpu",
                                                     quantization_config=BitsAndBytesConfig(**FORMATS[fmt]))
            path = tmp_path_factory.mktemp(f"bnb-{fmt}")
            model.save_pretrained(path)  # before any forward (NOTES: a 4-bit CPU forward repacks the absmax)
            expected = {}
            for name, module in model.named_modules():
                if name.rsplit(".", 1)[-1] in LINEARS:
                    w = module.weight
                    expected[name] = (BF.int8_vectorwise_dequant(w.data, w.SCB) if fmt == "int8"
                                      else BF.dequantize_4bit(w.data, w.quant_state)).float()
            saved[fmt] = path, expected
        return saved[fmt]

    return get


def _nibbles(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """The 4-bit codes; FP4 has a +0 and a -0 code, and a dequantized 0 comes back as +0."""
    data = packed.reshape(-1)
    codes = torch.stack([data >> 4, data & 15], dim=1).reshape(-1)
    return torch.where(codes == 8, 0, codes) if fmt == "fp4" else codes


def _stored(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_checkpoint_dequantizes_and_requantizes_to_the_stored_codes(fmt, bnb_checkpoint, dense_dir):
    path, expected = bnb_checkpoint(fmt)
    stored = _stored(path)
    consumed = []

    def counted():
        for name, tensor in iterate_tensors(path):
            consumed.append(name)
            yield name, tensor

    out = {}
    for name, tensor in dequantize_checkpoint(counted()):
        if name.removesuffix(".weight") in expected:  # streamed: yielded as soon as its last piece is read
            assert consumed[-1].startswith(name.removesuffix("weight")), (name, consumed[-1])
        out[name] = tensor
    assert set(out) == set(_stored(dense_dir))  # the dense checkpoint's names, nothing else
    for name, tensor in out.items():
        prefix = name.removesuffix(".weight")
        if prefix in expected:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[prefix]), name
        else:  # norms, embeddings, head: untouched
            assert torch.equal(tensor, stored[name]), name

    for prefix in expected:  # quantizing the dequantized weight again gives back what was stored
        dense = out[f"{prefix}.weight"]
        if fmt == "int8":
            codes, scb = quantize_int8(dense)
            assert torch.equal(codes, stored[f"{prefix}.weight"])
            assert torch.equal(scb, stored[f"{prefix}.SCB"])
            continue
        packed, state = quantize_4bit(dense, fmt[:3], 64, fmt == "nf4-double")
        assert torch.equal(_nibbles(packed, fmt), _nibbles(stored[f"{prefix}.weight"], fmt)), prefix
        if fmt != "nf4-double":
            assert torch.equal(state.absmax, stored[f"{prefix}.weight.absmax"]), prefix
            continue
        # Double quant: the absmax is 8-bit quantized around the mean of all absmax, and that mean moves
        # a little with the dequantized absmax; it comes back within 1% (one 8-bit step; measured < 0.4%).
        parts = {k.removeprefix(f"{prefix}.weight."): v for k, v in stored.items() if k.startswith(f"{prefix}.weight.")}
        reference = BF.QuantState.from_dict(parts, device=torch.device("cpu"))
        absmax = BF.dequantize_blockwise(state.absmax, state.state2) + state.offset
        absmax_stored = BF.dequantize_blockwise(reference.absmax, reference.state2) + reference.offset
        assert ((absmax - absmax_stored).abs() / absmax_stored).max() < 1e-2, prefix


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_loader_fuses_a_bnb_checkpoint_into_the_stored_codes(fmt, bnb_checkpoint):
    """The whole path: the loader streams the checkpoint through checkpoint_tensors into the fused
    qkv / gate_up layers, which quantize back to the checkpoint's codes."""
    path, _ = bnb_checkpoint(fmt)
    config = load_config(path)
    # config.json picks the method; compute in fp32 keeps bitsandbytes' standard layout, to compare codes
    name, options = resolve_quant("none", {"compute_dtype": "float32"}, config, path)
    cls = BnbInt8Method if fmt == "int8" else BnbNf4Method
    assert name == cls.name
    model = build_model(config, torch.float32, QuantConfig(cls, options))
    load_weights(model, path, progress=False, transform=lambda t: cls.checkpoint_tensors(t, options))
    stored = _stored(path)
    for i, layer in enumerate(model.model.layers):
        for fused, parts in ((layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
                             (layer.mlp.down_proj, ("mlp.down_proj",))):
            prefixes = [f"model.layers.{i}.{p}" for p in parts]
            if fmt == "int8":
                assert torch.equal(fused.bnb_codes, torch.cat([stored[f"{p}.weight"] for p in prefixes]))
                assert torch.equal(fused.bnb_scb, torch.cat([stored[f"{p}.SCB"] for p in prefixes]))
            else:
                assert torch.equal(fused.bnb_packed, torch.cat([stored[f"{p}.weight"] for p in prefixes]))
                assert torch.equal(fused.bnb_quant_state.absmax,
                                   torch.cat([stored[f"{p}.weight.absmax"] for p in prefixes]))
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"])
    hidden = torch.randn(3, 64)
    assert torch.allclose(model.lm_head(hidden), F.linear(hidden, stored["lm_head.weight"]), atol=1e-5)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_checkpoint_config_picks_the_method_and_layout(fmt, bnb_checkpoint):
    path, _ = bnb_checkpoint(fmt)
    config = load_config(path)
    if fmt == "int8":
        expected = ("bnb-int8", {"threshold": 0.0, "compute_dtype": "bfloat16"})
    else:
        expected = ("bnb-nf4", {"quant_type": fmt[:3], "blocksize": 64, "double_quant": fmt == "nf4-double",
                                "compute_dtype": "bfloat16"})
    assert resolve_quant("none", {}, config, path) == expected
    other = "bnb-nf4" if fmt == "int8" else "bnb-int8"
    with pytest.raises(ValueError, match=f"load it with quant {expected[0]}"):
        resolve_quant(other, {}, config, path)
    if fmt != "int8":
        with pytest.raises(ValueError, match="option 'blocksize' = 128 contradicts the checkpoint"):
            resolve_quant("bnb-nf4", {"blocksize": 128}, config, path)


def test_checkpoint_stream_edge_cases():
    codes, scb = quantize_int8(torch.randn(8, 16))
    plain = [("norm.weight", torch.ones(16)), ("column.weight", torch.randn(5, 1))]  # [n, 1]: held, passed on
    out = dict(dequantize_checkpoint(iter([("a.SCB", scb), ("a.weight", codes), *plain,
                                           ("a.weight_format", torch.tensor(0, dtype=torch.uint8))])))
    assert set(out) == {"a.weight", "norm.weight", "column.weight"}
    assert torch.equal(out["column.weight"], plain[1][1])
    with pytest.raises(ValueError, match="incomplete bitsandbytes checkpoint: module a has only weight"):
        list(dequantize_checkpoint(iter([("a.weight", codes)])))
    with pytest.raises(ValueError, match="weight_format 2"):
        list(dequantize_checkpoint(iter([("a.SCB", scb), ("a.weight", codes),
                                         ("a.weight_format", torch.tensor(2, dtype=torch.uint8))])))


# --- the embedded model --------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["bnb-int8", "bnb-nf4"])
def test_embedded_model_greedy_smoke(quant, embedded_path, embedded_llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = "The capital of France is"
    [reference] = embedded_llm.generate(prompt, params)
    llm = LLM(str(embedded_path), quant=quant, progress=False, kv_cache_bytes=32 << 20)
    [out] = llm.generate(prompt, params)
    assert len(out.token_ids) == 8
    assert out.token_ids[0] == reference.token_ids[0], (out.text, reference.text)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase) and m.weight is None
               and type(m.quant_method).name == quant]
    assert len(linears) == 4 * llm.engine.hf_config.num_hidden_layers  # all but the dense head
    ratio = (sum(m.quant_method.weight_bytes(m) for m in linears)
             / sum(4 * m.in_features * m.out_features for m in linears))
    assert ratio < (0.27 if quant == "bnb-int8" else 0.15), ratio

