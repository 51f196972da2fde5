"""The GPTQ and AWQ plugins: checkpoint tensors loaded through the linear layers' own weight loaders (fused and
row-parallel shards), the kernels (`int4pack`, `dequant`, `triton`) against the dequantized reference, the
int4pack layout conversions, weight bytes, option and layout errors, checkpoint detection, and a tiny Llama
loaded from round-to-nearest GPTQ / AWQ checkpoints against HF transformers running the same dequantized weights.

Checkpoint tensors come from `packing.quantize_rtn` + `pack_gptq` / `pack_awq` (the layouts GPTQ / AWQ tools
write); the reference weight of each shard is the quantizer's own `Quantized.dequantize()` (scales in fp16, as
the checkpoint stores them), so it does not go through the unpacking code under test.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvforge.core.cpu_kernels import unavailable
from kvforge.core.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from kvforge.core.plugins import checkpoint_quantization, resolve_quant
from kvforge.plugins.quant.awq import AwqMethod
from kvforge.plugins.quant.cpu_kernels import int4pack_available
from kvforge.plugins.quant.gptq import GptqMethod
from kvforge.plugins.quant.packing import Quantized, pack_awq, pack_gptq, quantize_rtn, unpack_awq, unpack_gptq
from tests.helpers.optional_parts import require
from tests.helpers.parity import compare, hf_greedy

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_CUDA = torch.cuda.is_available()
FP32_U = 2.0**-24  # unit roundoff of fp32
BF16_U = 2.0**-8  # unit roundoff of bf16 (8 significant bits)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one intra-op thread is as fast, and on a busy 2-core machine OpenMP threads waiting on each
    other make the many tiny ops of quantize_rtn's clipping search ~100x slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------------------
# Building a quantized layer from per-shard checkpoint tensors
# --------------------------------------------------------------------------------------------------------------

# kind -> (in_features, [(shard id, out features)], constructor)
KINDS = {
    "replicated": (128, [(None, 80)], lambda m, b: ReplicatedLinear(128, 80, bias=b, quant_method=m)),
    "merged": (128, [(0, 96), (1, 32)],  # gate / up of different sizes
               lambda m, b: MergedColumnParallelLinear(128, [96, 32], bias=b, quant_method=m)),
    "qkv": (128, [("q", 128), ("k", 64), ("v", 64)],  # 4 query heads, 2 kv heads of 32
            lambda m, b: QKVParallelLinear(128, 32, 4, 2, bias=b, quant_method=m)),
    "row": (192, [(None, 64)], lambda m, b: RowParallelLinear(192, 64, bias=b, quant_method=m)),
}


def _method(name: str, **options):
    return (GptqMethod if name == "gptq" else AwqMethod)(**options)


def _load(layer: torch.nn.Module, tensors: dict[str, torch.Tensor], shard_id) -> None:
    """What core/loader.py does with one checkpoint tensor: cast to the parameter's dtype, call its loader."""
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        value = tensor if tensor.dtype == param.dtype else tensor.to(param.dtype)
        param.weight_loader(param, value, shard_id)


def _quantize(n: int, k: int, method, gen: torch.Generator, order: torch.Tensor | None) -> Quantized:
    """A random [n, k] weight quantized as `method` would find it in a checkpoint. Row 0 is all positive and
    row 1 all negative, so asymmetric groups hit both ends of the zero range (0 and 2**bits - 1; a zero of 0
    is the corner case of GPTQ v1's zero - 1 storage)."""
    opts = method.options
    weight = torch.randn(n, k, generator=gen)
    weight[0], weight[1] = weight[0].abs(), -weight[1].abs()
    sym = opts.get("sym", False) if method.name == "gptq" else False
    desc_act = opts.get("desc_act", False)
    # fp16 weight: quantize_rtn returns fp16 scales, exactly what the checkpoint stores
    quant = quantize_rtn(weight.half(), opts["bits"], opts["group_size"], sym, desc_act, order)
    if not sym:
        assert (quant.zeros[:, 0] == 0).all() and (quant.zeros[:, 1] == (1 << opts["bits"]) - 1).all()
    return quant


def _spread(quant: Quantized) -> torch.Tensor:
    """[N, K]: |s| * (|q - 8| + |8 - z|), what bf16 rounding of the int4pack scale and zero term can move W by
    (relative to u): the op computes W = (q - 8) * bf16(s) + bf16(s * (8 - z))."""
    g = quant.g_idx.long()
    s = quant.scales.double()[g]
    return (s.abs() * ((quant.q - 8).abs().double() + (8 - quant.zeros[g]).abs().double())).T


def _build(kind: str, method, bias: bool, seed: int = 0, drop_g_idx: bool = False):
    """A layer of `kind` loaded shard by shard from checkpoint tensors and processed; returns
    (layer, reference weight [N, K] fp64, int4pack spread [N, K], bias fp64 or None)."""
    k, shards, make = KINDS[kind]
    layer = make(method, bias)
    gen = torch.Generator().manual_seed(seed)
    desc_act = method.options.get("desc_act", False)
    order = torch.randperm(k, generator=gen) if desc_act else None  # fused shards share one act-order
    refs, spreads, biases = [], [], []
    for shard_id, n in shards:
        quant = _quantize(n, k, method, gen, order)
        if desc_act and method.options["group_size"] not in (-1, k):
            assert not torch.equal(quant.g_idx, quant.g_idx.sort().values), "act-order g_idx expected"
        if method.name == "gptq":
            tensors = pack_gptq(quant, method.options["checkpoint_format"])
            if drop_g_idx:  # checkpoints without act-order may leave g_idx out
                del tensors["g_idx"]
        else:
            tensors = pack_awq(quant)
        if bias:
            tensors["bias"] = torch.randn(n, generator=gen).half()
            biases.append(tensors["bias"].double())
        _load(layer, tensors, shard_id)
        refs.append(quant.dequantize().double())
        spreads.append(_spread(quant))
    layer.process_after_loading()
    return layer, torch.cat(refs), torch.cat(spreads), torch.cat(biases) if bias else None


def _inputs(k: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(1, k, generator=gen), torch.randn(5, k, generator=gen), torch.randn(2, 3, k, generator=gen)]


def _fp32_tolerance(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """fp32 kernels (dequant, triton on fp32): W is rebuilt exactly (fp16 scale x small integer, as the reference
    does), so the only error is fp32 accumulation in some order, <= K * u * sum|x||w| (doubled for slack), plus
    rounding the product and adding the bias (u * (|xW| + |b|), doubled)."""
    k = x.shape[-1]
    products = F.linear(x.double().abs(), weight.abs())
    rounding = F.linear(x.double(), weight).abs() + (0 if bias is None else bias.abs())
    return 2 * k * FP32_U * products + 2 * FP32_U * rounding + 1e-30


def _int4pack_tolerance(x: torch.Tensor, weight: torch.Tensor, spread: torch.Tensor, bias) -> torch.Tensor:
    """The int4pack op computes in bf16 (u = 2**-8): x rounded to bf16 (<= u|x|, so <= u * sum|x||w|), the scale
    and the zero term s * (8 - z) rounded to bf16 (<= u * sum|x| * spread), products accumulated in fp32 and x @ W.T
    rounded to bf16 (<= u * |xW|). Those first-order terms, times (1 + 4u) for the second-order ones, plus the fp32
    terms (accumulation over |W| + spread, the bias added in fp32)."""
    xa, k = x.double().abs(), x.shape[-1]
    products = F.linear(xa, weight.abs() + spread)
    xw = F.linear(x.double(), weight).abs()
    bf16 = (1 + 4 * BF16_U) * BF16_U * (products + xw)
    fp32 = 2 * k * FP32_U * products + 2 * FP32_U * (xw + (0 if bias is None else bias.abs()))
    return bf16 + fp32 + 1e-30


def _blocks_tolerance(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """The GGUF kernels with `auto` activations (the blocks kernel): x rounded per 32 values to int16, at most half a
    step (1 / 65534 of the block's largest |x|) per value, times |W|; plus fp32's terms (a prefill's x as given)."""
    amax = x.double().abs().unflatten(-1, (-1, 32)).amax(-1).repeat_interleave(32, -1)
    return F.linear(amax / 65534, weight.abs()) + _fp32_tolerance(x, weight, bias)


def _check(layer, x: torch.Tensor, weight: torch.Tensor, spread: torch.Tensor, bias) -> float:
    """layer(x) against F.linear(x, W_ref) + b; returns the worst error / tolerance ratio (must be <= 1)."""
    y = layer(x)
    assert y.shape == (*x.shape[:-1], weight.shape[0]) and y.dtype == x.dtype
    ref = F.linear(x.double(), weight, bias)
    if layer.kernel == "int4pack":
        tol = _int4pack_tolerance(x, weight, spread, bias)
    elif layer.kernel == "blocks":
        tol = _blocks_tolerance(x, weight, bias)
    else:
        tol = _fp32_tolerance(x, weight, bias)
    err = (y.double() - ref).abs()
    worst = float((err / tol).max())
    assert worst <= 1.0, f"{layer.kernel}: error {float(err.max()):.3g} exceeds the tolerance (ratio {worst:.2f})"
    return worst


# --------------------------------------------------------------------------------------------------------------
# 1. Quantized linears against the dequantized reference
# --------------------------------------------------------------------------------------------------------------

def _case(case_id, kind, method, bias=False, drop_g_idx=False, **options):
    return pytest.param(kind, method, options, bias, drop_g_idx, id=case_id)


CASES = [
    _case("gptq-b4-g32-sym-replicated-bias", "replicated", "gptq", bits=4, group_size=32, sym=True, bias=True),
    _case("gptq-b4-g64-asym-desc-merged", "merged", "gptq", bits=4, group_size=64, sym=False, desc_act=True),
    _case("gptq-b4-g32-asym-desc-v2-qkv-bias", "qkv", "gptq", bits=4, group_size=32, sym=False, desc_act=True,
          checkpoint_format="gptq_v2", bias=True),
    _case("gptq-b4-gK-asym-row", "row", "gptq", bits=4, group_size=-1, sym=False),
    _case("gptq-b4-g64-asym-v1-no-g_idx-merged-bias", "merged", "gptq", bits=4, group_size=64, sym=False,
          bias=True, drop_g_idx=True),
    _case("gptq-b4-g32-asym-desc-row-bias", "row", "gptq", bits=4, group_size=32, sym=False, desc_act=True,
          bias=True),
    _case("gptq-b8-g32-asym-desc-v2-replicated", "replicated", "gptq", bits=8, group_size=32, sym=False,
          desc_act=True, checkpoint_format="gptq_v2"),
    _case("gptq-b8-gK-sym-merged-bias", "merged", "gptq", bits=8, group_size=-1, sym=True, bias=True),
    _case("gptq-b8-g64-asym-desc-qkv", "qkv", "gptq", bits=8, group_size=64, sym=False, desc_act=True),
    _case("gptq-b8-g64-asym-v2-row-bias", "row", "gptq", bits=8, group_size=64, sym=False,
          checkpoint_format="gptq_v2", bias=True),
    _case("gptq-b2-g32-asym-desc-merged-bias", "merged", "gptq", bits=2, group_size=32, sym=False, desc_act=True,
          bias=True),
    _case("awq-g32-qkv-bias", "qkv", "awq", group_size=32, bias=True),
    _case("awq-g64-merged", "merged", "awq", group_size=64),
    _case("awq-g32-row-bias", "row", "awq", group_size=32, bias=True),
    _case("awq-g64-replicated", "replicated", "awq", group_size=64),
]


@pytest.mark.parametrize("kernel", ["auto", "dequant"])
@pytest.mark.parametrize(("kind", "method", "options", "bias", "drop_g_idx"), CASES)
def test_layer_matches_dequantized_reference(kind, method, options, bias, drop_g_idx, kernel):
    quant_method = _method(method, kernel=kernel, **options)
    layer, weight, spread, b = _build(kind, quant_method, bias, seed=len(kind) + options["group_size"],
                                      drop_g_idx=drop_g_idx)
    bits = quant_method.bits
    if kernel == "auto":  # 4-bit on CPU: torch's int4 op; other widths: dequant
        assert layer.kernel == ("int4pack" if bits == 4 and int4pack_available() else "dequant")
    else:
        assert layer.kernel == "dequant"
    assert (layer.bias is not None) == bias
    for name in ("qweight", "qzeros", "scales"):  # the checkpoint's parameters are gone once repacked
        assert not hasattr(layer, name)
    gen = torch.Generator().manual_seed(1)
    for x in _inputs(KINDS[kind][0], gen):
        _check(layer, x, weight, spread, b)


BLOCKS_CASES = [case for case in CASES if case.values[2].get("bits", 4) == 4]


@pytest.mark.parametrize(("kind", "method", "options", "bias", "drop_g_idx"), BLOCKS_CASES)
def test_blocks_kernel_serves_4bit_groups_of_32_exactly(kind, method, options, bias, drop_g_idx):
    """`kernel: blocks`: the weight rewritten into GGUF blocks (Q4_0 when every zero is 8, else Q5_0) is W exactly
    (dequantized back, bit for bit the reference in fp32), and the layer's output is within the GGUF kernel's int16
    bound (_blocks_tolerance); act-order groups (not 32 consecutive features each) are refused by name."""
    quant_method = _method(method, kernel="blocks", **options)
    if options.get("desc_act") and options["group_size"] != -1:
        with pytest.raises(ValueError, match="blocks kernel: its groups do not hold 32 consecutive"):
            _build(kind, quant_method, bias, seed=3, drop_g_idx=drop_g_idx)
        return
    require(unavailable() is None, f"the C kernels cannot be built here: {unavailable()}")
    layer, weight, _, b = _build(kind, quant_method, bias, seed=3, drop_g_idx=drop_g_idx)
    assert layer.kernel == "blocks" and layer.int4 is None
    (qtype, blocks), = layer.segments.parts
    assert qtype == (2 if options.get("sym") and method == "gptq" else 6)  # Q4_0 / Q5_0
    assert quant_method.weight_bytes(layer) == blocks.numel() < weight.numel() * 0.7
    assert torch.equal(quant_method.dequantize(layer, torch.float32).double(), weight)
    gen = torch.Generator().manual_seed(1)
    for x in _inputs(KINDS[kind][0], gen):
        _check(layer, x, weight, None, b)


@pytest.fixture
def triton_interpreter(monkeypatch):
    """The triton kernel on CPU runs under TRITON_INTERPRET=1, for this test only (pattern of test_triton_gemm)."""
    require(HAS_TRITON, "triton is not installed (pip install triton==3.9.0; Linux x86_64 wheels only)")
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cuda" if ON_CUDA else "cpu"


@pytest.mark.parametrize(("kind", "method", "options"), [
    ("merged", "gptq", dict(bits=4, group_size=32, sym=False, desc_act=True)),
    ("qkv", "awq", dict(group_size=64)),
    ("row", "gptq", dict(bits=8, group_size=64, sym=True, checkpoint_format="gptq_v2")),
], ids=["gptq-b4-desc-merged", "awq-qkv", "gptq-b8-row"])
def test_triton_kernel_matches_reference(triton_interpreter, kind, method, options):
    device = triton_interpreter
    layer, weight, spread, b = _build(kind, _method(method, kernel="triton", **options), bias=True)
    assert layer.kernel == "triton"
    layer.to(device)
    gen = torch.Generator().manual_seed(2)
    for x in _inputs(KINDS[kind][0], gen)[1:]:  # the interpreter is slow: batch 5 and the 3-D input
        y = layer(x.to(device)).cpu()
        ref = F.linear(x.double(), weight, b)
        tol = _fp32_tolerance(x, weight, b)
        assert float(((y.double() - ref).abs() / tol).max()) <= 1.0


# --------------------------------------------------------------------------------------------------------------
# 2. int4pack layouts
# --------------------------------------------------------------------------------------------------------------

def _int4pack_emulation(x: torch.Tensor, quant: Quantized) -> torch.Tensor:
    """What the op computes, in fp64: bf16 x times W' = (q - 8) * bf16(s) + bf16(s * (8 - z)), rounded to bf16."""
    g = quant.g_idx.long()
    s = quant.scales.float().to(torch.bfloat16).double()[g]
    zero_term = (quant.scales.float() * (8 - quant.zeros.float())).to(torch.bfloat16).double()[g]
    w = ((quant.q.double() - 8) * s + zero_term).T
    return F.linear(x.to(torch.bfloat16).double(), w)


@pytest.mark.skipif(not int4pack_available(), reason="this torch build has no CPU int4pack op")
@pytest.mark.parametrize(("k", "group", "desc_act", "op_group"), [
    (192, -1, False, 64),  # one group of 192 per row: not an op group size, expressed as 3 groups of 64
    (192, 96, False, 32),  # 96 -> 32 (scales repeated)
    (256, 256, False, 256),
    (128, 64, True, 64),  # act-order: input features permuted once, activations gathered
    (192, 96, True, 32),  # both
])
def test_int4pack_layouts(k, group, desc_act, op_group):
    method = GptqMethod(bits=4, group_size=group, sym=False, desc_act=desc_act)
    layer = ReplicatedLinear(k, 64, quant_method=method)
    gen = torch.Generator().manual_seed(k + group)
    order = torch.randperm(k, generator=gen) if desc_act else None
    quant = _quantize(64, k, method, gen, order)
    _load(layer, pack_gptq(quant), None)
    layer.process_after_loading()
    assert layer.kernel == "int4pack" and layer.int4.group == op_group
    if desc_act:
        perm = layer.int4.input_perm
        assert perm is not None and torch.equal(quant.g_idx[perm].long(), quant.g_idx.long().sort().values)
    else:
        assert layer.int4.input_perm is None
    weight = quant.dequantize().double()
    for x in _inputs(k, gen):
        _check(layer, x, weight, _spread(quant), None)
        # sharper: the op's own arithmetic emulated; what is left is the final bf16 rounding (one ulp, twice for
        # slack) and fp32 accumulation order. A wrong permutation / scale repeat / zero would be far outside.
        emulated = _int4pack_emulation(x, quant)
        tol = 2 * BF16_U * emulated.abs() + 2 * k * FP32_U * F.linear(x.double().abs(), weight.abs() + _spread(quant))
        assert ((layer(x).double() - emulated).abs() <= tol + 1e-30).all()


@pytest.mark.skipif(not int4pack_available(), reason="this torch build has no CPU int4pack op")
@pytest.mark.parametrize(("k", "group"), [(64, 16), (48, -1)], ids=["group-16", "K-48"])
def test_int4pack_cannot_take_layout_auto_falls_back(k, group):
    """Group sizes that are not a multiple of 32: auto runs dequant, an explicit int4pack is refused."""
    for kernel in ("auto", "int4pack"):
        method = GptqMethod(bits=4, group_size=group, sym=False, kernel=kernel)
        layer = ReplicatedLinear(k, 32, quant_method=method)
        quant = _quantize(32, k, method, torch.Generator().manual_seed(3), None)
        _load(layer, pack_gptq(quant), None)
        if kernel == "int4pack":
            with pytest.raises(ValueError, match="cannot use the int4pack kernel"):
                layer.process_after_loading()
            continue
        layer.process_after_loading()
        assert layer.kernel == "dequant"
        x = torch.randn(3, k)
        _check(layer, x, quant.dequantize().double(), _spread(quant), None)


@pytest.mark.skipif(not int4pack_available(), reason="this torch build has no CPU int4pack op")
def test_int4pack_out_features_not_multiple_of_16_falls_back():
    method = GptqMethod(bits=4, group_size=32, sym=True)
    layer = ReplicatedLinear(64, 40, quant_method=method)
    quant = _quantize(40, 64, method, torch.Generator().manual_seed(4), None)
    _load(layer, pack_gptq(quant), None)
    layer.process_after_loading()
    assert layer.kernel == "dequant"
    x = torch.randn(2, 64)
    _check(layer, x, quant.dequantize().double(), _spread(quant), None)


def test_int4pack_refused_for_8_bit():
    method = GptqMethod(bits=8, group_size=32, kernel="int4pack")
    layer = ReplicatedLinear(64, 32, quant_method=method)
    _load(layer, pack_gptq(_quantize(32, 64, method, torch.Generator().manual_seed(5), None)), None)
    with pytest.raises(ValueError, match=r"int4pack kernel needs 4-bit weights on CPU \(this is 8-bit"):
        layer.process_after_loading()


def test_triton_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if ON_CUDA:
        pytest.skip("triton can run here")
    method = GptqMethod(bits=4, group_size=32, kernel="triton")
    layer = ReplicatedLinear(64, 32, quant_method=method)
    _load(layer, pack_gptq(_quantize(32, 64, method, torch.Generator().manual_seed(6), None)), None)
    with pytest.raises(ValueError, match="triton kernel needs triton and a CUDA device"):
        layer.process_after_loading()


# --------------------------------------------------------------------------------------------------------------
# 3. Weight bytes
# --------------------------------------------------------------------------------------------------------------

def _build_plain(n: int, k: int, method):
    layer = ReplicatedLinear(k, n, quant_method=method)
    quant = _quantize(n, k, method, torch.Generator().manual_seed(7), None)
    _load(layer, pack_gptq(quant), None)
    layer.process_after_loading()
    return layer


@pytest.mark.skipif(not int4pack_available(), reason="this torch build has no CPU int4pack op")
def test_weight_bytes_int4pack_is_an_eighth_of_fp32_plus_scales():
    n, k, group = 128, 256, 64
    method = GptqMethod(bits=4, group_size=group, sym=False)
    layer = _build_plain(n, k, method)
    assert layer.kernel == "int4pack"
    dense = n * k * 4
    scales = (k // group) * n * 2 * 2  # a bf16 scale and zero per group and output feature
    measured = method.weight_bytes(layer)
    assert dense // 8 <= measured <= dense // 8 + scales, (measured, dense)
    # and the estimate used before loading agrees with what the loaded layer takes
    assert measured * 8 / (n * k) == pytest.approx(GptqMethod.bits_per_weight({"group_size": group}))


def test_weight_bytes_dequant_8_bit_is_a_quarter_of_fp32_plus_scales():
    n, k, group = 128, 256, 64
    method = GptqMethod(bits=8, group_size=group, sym=False)
    layer = _build_plain(n, k, method)
    assert layer.kernel == "dequant"
    dense = n * k * 4
    extra = (k // group) * n * (4 + 1) + k * 4  # fp32 scales, 8-bit zeros, int32 g_idx
    assert dense // 4 <= method.weight_bytes(layer) <= dense // 4 + extra


# --------------------------------------------------------------------------------------------------------------
# 4. Errors
# --------------------------------------------------------------------------------------------------------------

def test_fused_shards_with_different_g_idx_are_refused():
    method = GptqMethod(bits=4, group_size=32, sym=False, desc_act=True)
    layer = MergedColumnParallelLinear(128, [96, 32], quant_method=method)
    gen = torch.Generator().manual_seed(8)
    _load(layer, pack_gptq(_quantize(96, 128, method, gen, torch.randperm(128, generator=gen))), 0)
    up = pack_gptq(_quantize(32, 128, method, gen, torch.randperm(128, generator=gen)))  # its own act-order
    with pytest.raises(ValueError, match="g_idx"):
        _load(layer, up, 1)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_group_size_not_dividing_in_features_is_refused(method):
    with pytest.raises(ValueError, match="group size 48 does not divide the layer's 128 input features"):
        ReplicatedLinear(128, 64, quant_method=_method(method, group_size=48))


def test_checkpoint_with_another_group_size_does_not_fit():
    layer = ReplicatedLinear(128, 64, quant_method=GptqMethod(bits=4, group_size=32))
    tensors = pack_gptq(quantize_rtn(torch.randn(64, 128), 4, 64, sym=True))
    with pytest.raises(ValueError, match="does not fit parameter"):
        _load(layer, tensors, None)


@pytest.mark.parametrize(("cls", "options", "named"), [
    (GptqMethod, {"bogus": 1}, "'bogus'"),
    (GptqMethod, {"bits": 3}, "'bits'"),
    (AwqMethod, {"bits": 8}, "'bits'"),
    (GptqMethod, {"kernel": "fast"}, "'kernel'"),
    (AwqMethod, {"version": "gemv"}, "'version'"),
    (GptqMethod, {"checkpoint_format": "marlin"}, "'checkpoint_format'"),
    (GptqMethod, {"group_size": "64"}, "'group_size'"),
    (GptqMethod, {"group_size": True}, "'group_size'"),
    (GptqMethod, {"group_size": -2}, "'group_size'"),
    (GptqMethod, {"group_size": 0}, "'group_size'"),
    (GptqMethod, {"desc_act": "yes"}, "'desc_act'"),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_bad_options_are_refused_naming_the_option(cls, options, named):
    with pytest.raises(ValueError, match=named):
        cls(**options)


@pytest.mark.parametrize("bad", [4, -3], ids=["past-the-last-group", "negative"])
def test_g_idx_outside_the_groups_is_refused(bad):
    method = GptqMethod(bits=4, group_size=32, kernel="dequant")
    layer = ReplicatedLinear(128, 32, quant_method=method)
    tensors = pack_gptq(_quantize(32, 128, method, torch.Generator().manual_seed(9), None))
    tensors["g_idx"][5] = bad  # 4 groups: 0..3
    _load(layer, tensors, None)
    with pytest.raises(ValueError, match=r"g_idx refers to groups outside 0\.\.3"):
        layer.process_after_loading()


# --------------------------------------------------------------------------------------------------------------
# 5. Checkpoint detection
# --------------------------------------------------------------------------------------------------------------

GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
               "checkpoint_format": "gptq_v2", "damp_percent": 0.01, "true_sequential": True}


def _llama_config(**kwargs):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, **kwargs)


def test_checkpoint_quantization_from_config_json(tmp_path):
    config = _llama_config(quantization_config=dict(GPTQ_CONFIG))
    assert checkpoint_quantization(config, tmp_path) == GPTQ_CONFIG
    assert checkpoint_quantization(_llama_config(), tmp_path) is None  # dense


def test_checkpoint_quantization_from_legacy_quantize_config(tmp_path):
    legacy = {"bits": 8, "group_size": 64, "desc_act": False, "sym": True, "true_sequential": True}
    (tmp_path / "quantize_config.json").write_text(json.dumps(legacy))
    assert checkpoint_quantization(_llama_config(), tmp_path) == {"quant_method": "gptq", **legacy}
    assert resolve_quant("none", {}, _llama_config(), tmp_path) == (
        "gptq", {"bits": 8, "group_size": 64, "desc_act": False, "sym": True, "checkpoint_format": "gptq",
                 "kernel": "auto"})


def test_resolve_quant(tmp_path):
    config = _llama_config(quantization_config=dict(GPTQ_CONFIG))
    layout = {"bits": 4, "group_size": 32, "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2"}
    assert resolve_quant("none", {}, config, tmp_path) == ("gptq", {**layout, "kernel": "auto"})
    # the user may add what the checkpoint does not fix, and repeat what it does
    assert resolve_quant("gptq", {"kernel": "dequant", "bits": 4}, config, tmp_path) == (
        "gptq", {**layout, "kernel": "dequant"})
    with pytest.raises(ValueError, match="gptq"):
        resolve_quant("awq", {}, config, tmp_path)
    with pytest.raises(ValueError, match="option 'bits' = 8 contradicts the checkpoint, which has 4"):
        resolve_quant("gptq", {"bits": 8}, config, tmp_path)
    with pytest.raises(ValueError, match="'kernel'"):
        resolve_quant("none", {"kernel": "fast"}, config, tmp_path)
    # dense checkpoint: what the user asked for, the method's defaults filled in
    assert resolve_quant("none", {}, _llama_config(), tmp_path) == ("none", {"weights": "auto"})  # its default
    assert resolve_quant("gptq", {}, _llama_config(), tmp_path)[1]["kernel"] == "auto"  # defaults filled in
    with pytest.raises(ValueError, match="'x'"):  # a dense checkpoint still checks the options
        resolve_quant("none", {"x": 1}, _llama_config(), tmp_path)
    awq = _llama_config(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 64,
                                             "zero_point": True, "version": "GEMM"})
    assert resolve_quant("none", {}, awq, tmp_path) == (
        "awq", {"bits": 4, "group_size": 64, "zero_point": True, "version": "gemm", "kernel": "auto"})


@pytest.mark.parametrize(("quantization_config", "message"), [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "GPTQ checkpoint format 'marlin'"),
], ids=["awq-gemv", "gptq-marlin"])
def test_unsupported_checkpoint_layouts_are_refused(tmp_path, quantization_config, message):
    with pytest.raises(ValueError, match=message):
        resolve_quant("none", {}, _llama_config(quantization_config=quantization_config), tmp_path)


# --------------------------------------------------------------------------------------------------------------
# 6. A tiny Llama from RTN checkpoints, end to end
# --------------------------------------------------------------------------------------------------------------

NEW_TOKENS = 16
QUANTIZED = {
    "gptq": dict(method="gptq", bits=4, group_size=32, sym=False, desc_act=True, checkpoint_format="gptq_v2"),
    "awq": dict(method="awq", bits=4, group_size=64, sym=False),
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_path):
    """(dense dir, HF model, prompts): a random tiny Llama saved as safetensors, with the embedded tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                         initializer_range=0.3, rms_norm_eps=1e-6, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("dense")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_path / name, path / name)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 11, 24)]
    return path, model, prompts


def _dequantized_hf_model(model, out, method: str, checkpoint_format: str = "gptq"):
    """A copy of the HF model holding every tensor of the quantized checkpoint, projections dequantized."""
    tensors = load_file(out / "model.safetensors")
    state = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "qweight":
            parts = {key.rpartition(".")[2]: value for key, value in tensors.items() if key.startswith(module + ".")}
            quant = unpack_gptq(parts, 4, checkpoint_format) if method == "gptq" else unpack_awq(parts)
            state[f"{module}.weight"] = quant.dequantize()
        elif leaf not in ("qzeros", "scales", "g_idx"):
            state[name] = tensor
    reference = copy.deepcopy(model)
    reference.load_state_dict(state, strict=True)
    return reference.eval()


@pytest.fixture(scope="module")
def checkpoint(tiny_llama, tmp_path_factory):
    """method -> (checkpoint dir, HF greedy ids and logits on its dequantized weights), written once per module."""
    from kvforge.app.quantize.rtn_writer import write_rtn_checkpoint

    src, model, prompts = tiny_llama
    made = {}

    def get(method: str):
        if method not in made:
            options = QUANTIZED[method]
            out = write_rtn_checkpoint(src, tmp_path_factory.mktemp(method), **options)
            reference = _dequantized_hf_model(model, out, method, options.get("checkpoint_format", "gptq"))
            made[method] = out, hf_greedy(reference, prompts, NEW_TOKENS, pad_id=0, eos_ids={2})
        return made[method]

    return get


def _generate(path, prompts, **config):
    from kvforge.core import LLM, SamplingParams

    llm = LLM(str(path), progress=False, num_kv_blocks=64, **{"dtype": "float32", **config})  # HF's fp32 reference
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    return llm, [o.token_ids for o in outs]


def _quantized_linears(llm):
    return [m for m in llm.engine.runner.model.modules() if hasattr(m, "quant_method") and hasattr(m, "kernel")]


@pytest.mark.parametrize("method", list(QUANTIZED))
def test_tiny_llama_greedy_matches_hf_on_dequantized_weights(tiny_llama, checkpoint, method):
    _, model, prompts = tiny_llama
    out, (hf_ids, hf_logits) = checkpoint(method)
    llm, ours = _generate(out, prompts, quant_options={"kernel": "dequant"})
    assert llm.engine.config.quant == method  # detected from config.json
    linears = _quantized_linears(llm)
    assert len(linears) == 2 * 4 and {m.kernel for m in linears} == {"dequant"}  # qkv, o, gate_up, down per layer
    report = compare(ours, hf_ids, hf_logits)
    assert report.exact >= len(prompts) - 1, report
    # the reference is sensitive to the quantization: the dense model generates something else
    dense_ids, _ = hf_greedy(model, prompts, NEW_TOKENS, pad_id=0, eos_ids={2})
    assert dense_ids != hf_ids


@pytest.mark.skipif(not int4pack_available(), reason="this torch build has no CPU int4pack op")
@pytest.mark.parametrize("method", list(QUANTIZED))
def test_tiny_llama_auto_kernel_is_int4pack(tiny_llama, checkpoint, method):
    _, _, prompts = tiny_llama
    out, _ = checkpoint(method)
    llm, ours = _generate(out, prompts[:1])
    linears = _quantized_linears(llm)
    assert {m.kernel for m in linears} == {"int4pack"}
    assert len(ours[0]) == NEW_TOKENS
    # the storage estimate used before loading (4 bits + a bf16 scale and zero per group), plus the input
    # permutation of act-order layers
    weights = sum(m.in_features * m.out_features for m in linears)
    options = {k: v for k, v in QUANTIZED[method].items() if k in ("bits", "group_size")}
    expected = weights * _method(method).bits_per_weight(options) / 8
    perms = sum(m.in_features * 8 for m in linears) if QUANTIZED[method].get("desc_act") else 0
    measured = sum(m.quant_method.weight_bytes(m) for m in linears)
    assert expected <= measured <= expected + perms
    assert expected < weights * 4 / 6  # the point of it: over 6x smaller than fp32


@pytest.mark.parametrize("method", list(QUANTIZED))
def test_tiny_llama_on_the_blocks_kernel_matches_hf(tiny_llama, checkpoint, method):
    """`kernel: blocks` on a whole model: the layers whose groups hold 32 consecutive features each take the GGUF
    kernels (int16 decode steps), the others are refused by name; where they all do, greedy output is HF's on the
    dequantized weights (divergences only at HF's near-ties: compare's rule)."""
    require(unavailable() is None, f"the C kernels cannot be built here: {unavailable()}")
    _, _, prompts = tiny_llama
    out, (hf_ids, hf_logits) = checkpoint(method)
    if QUANTIZED[method].get("desc_act"):
        with pytest.raises(ValueError, match="blocks kernel: its groups do not hold 32 consecutive"):
            _generate(out, prompts[:1], quant_options={"kernel": "blocks"})
        return
    llm, ours = _generate(out, prompts, quant_options={"kernel": "blocks"})
    assert {m.kernel for m in _quantized_linears(llm)} == {"blocks"}
    report = compare(ours, hf_ids, hf_logits)
    assert report.exact >= len(prompts) - 1, report


def _with_extra_tensors(src, dst, extra: dict[str, torch.Tensor]):
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, **extra}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_zero_biases_of_bias_free_projections_are_skipped(tiny_llama, checkpoint, tmp_path):
    """auto-gptq writes an all-zero `bias` for every quantized projection, also where the model has none."""
    _, _, prompts = tiny_llama
    out, (hf_ids, hf_logits) = checkpoint("gptq")
    sizes = {"q_proj": 128, "k_proj": 64, "v_proj": 64, "o_proj": 128, "gate_proj": 256, "up_proj": 256,
             "down_proj": 128}
    zeros = {f"model.layers.{i}.{part}.{name}.bias": torch.zeros(size, dtype=torch.float16)
             for i in range(2) for name, size in sizes.items()
             for part in (["self_attn"] if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else ["mlp"])}
    path = _with_extra_tensors(out, tmp_path / "zero-bias", zeros)
    llm, ours = _generate(path, prompts, quant_options={"kernel": "dequant"})
    assert all(m.bias is None for m in _quantized_linears(llm))
    report = compare(ours, hf_ids, hf_logits)
    assert report.exact >= len(prompts) - 1, report


def test_nonzero_bias_of_a_bias_free_projection_is_refused(tiny_llama, checkpoint, tmp_path):
    out, _ = checkpoint("gptq")
    bias = torch.zeros(64, dtype=torch.float16)
    bias[3] = 0.5
    path = _with_extra_tensors(out, tmp_path / "bias", {"model.layers.1.self_attn.k_proj.bias": bias})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias has no matching parameter"):
        _generate(path, tiny_llama[2][:1])
