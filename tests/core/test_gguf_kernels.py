"""The GGUF-block C kernels (core/cpu_kernels/gguf_blocks.c), on every block type, SIMD and portable: rows
dequantized bit for bit as the `gguf` package dequantizes them; the matmul with fp32 activations x @ W to fp32
rounding; with int16 and int8 activations within the stated bound of x @ W (fp64 reference): the rounding of x to
that width per 32 values, half a step per value times the weight's scaled code, plus fp32 rounding."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvforge.core.cpu_kernels import (
    GGUF_SIMD,
    GGUF_SUPER,
    GgufExperts,
    GgufSegments,
    gguf_dequant,
    gguf_experts_linear,
    gguf_linear,
    gguf_simd_features,
    unavailable,
)
from kvforge.plugins.quant.gguf_blocks import DECODERS, decode
from tests.helpers.gguf_layers import random_blocks
from tests.helpers.optional_parts import require

T = GGMLQuantizationType


@pytest.fixture(autouse=True, scope="module")
def built():
    require(unavailable() is None, f"the C kernels cannot be built here: {unavailable()}")


def test_every_decoded_type_has_a_kernel():
    assert {int(t) for t in DECODERS} == set(GGUF_SUPER)


QUANTIZED = {"int8": 127, "int16": 32767}  # activations -> the largest code of x


def error_bound(x: torch.Tensor, raw, qtype, activations: str = "int8") -> torch.Tensor:
    """Per output: sum over x's 32-blocks of max|x_b| / (2 Q) * sum |s c| over the block's weights (s c: the weight
    less its offset, as gguf_blocks.decode splits it; Q the largest code of x), plus 2e-6 of sum |x| |W| for fp32
    rounding."""
    codes = decode(raw, qtype)
    scaled = (codes.scales.repeat_interleave(codes.group, 1) * codes.codes.float()).abs().double()
    n, k = scaled.shape
    amax = x.abs().double().view(x.shape[0], k // 32, 32).amax(-1)
    bound = (amax[:, None, :] / (2 * QUANTIZED[activations]) * scaled.view(n, k // 32, 32).sum(-1)[None]).sum(-1)
    weight = torch.from_numpy(dequantize(raw, qtype)).double()
    return bound + 2e-6 * (x.abs().double() @ weight.abs().T) + 1e-30


@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda t: t.name)
def test_rows_dequantize_bit_for_bit(qtype):
    raw = random_blocks(qtype, 21, 512, seed=3)
    blocks = torch.from_numpy(raw)
    expected = torch.from_numpy(dequantize(raw, qtype))
    assert torch.equal(gguf_dequant(int(qtype), blocks, 512), expected)
    ids = torch.tensor([20, 0, 7, 7])
    assert torch.equal(gguf_dequant(int(qtype), blocks, 512, ids), expected[ids])
    assert torch.equal(gguf_dequant(int(qtype), blocks, 512, ids, torch.bfloat16), expected[ids].bfloat16())
    with pytest.raises(IndexError):
        gguf_dequant(int(qtype), blocks, 512, torch.tensor([21]))


@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda t: t.name)
def test_exact_matmul_is_x_times_the_dequantized_weight(qtype):
    """fp32 activations (the default): x meets W formed exactly as GGUF dequantizes it: fp32 rounding from the fp64
    product; the SIMD and portable paths and every batch size give the same bits."""
    torch.manual_seed(0)
    raw = random_blocks(qtype, 37, 512, seed=1)
    weights = GgufSegments([(int(qtype), torch.from_numpy(raw))], 512)
    reference = torch.from_numpy(dequantize(raw, qtype)).double()
    x = torch.randn(5, 512) * torch.rand(5, 512) ** 4
    got = gguf_linear(x, weights)
    expected = x.double() @ reference.T
    assert ((got.double() - expected).abs() <= 1e-6 * (x.double().abs() @ reference.abs().T) + 1e-30).all()
    assert torch.equal(gguf_linear(x, weights, simd="none"), got)
    assert torch.equal(torch.cat([gguf_linear(x[i:i + 1], weights) for i in range(5)]), got)
    assert torch.equal(gguf_linear(x[:2], weights), got[:2])


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.BF16], ids=lambda t: t.name)
def test_many_rows_without_the_fixed_order(qtype):
    """batch_invariant=False (the `auto` activations' prefill, dense weights kept bf16): from 24 rows of x the
    outer-product tile, each sum over k in order: still fp32 rounding from x @ W (a looser constant: one accumulator
    over 512 products), mixed with a second segment; fewer rows, and the portable loops, keep the fixed order."""
    torch.manual_seed(0)
    if qtype == T.BF16:
        dense = (torch.randn(53, 512) * 0.02).bfloat16()
        parts, reference = [(30, dense[:37].view(torch.uint8)), (30, dense[37:].view(torch.uint8))], dense.double()
    else:
        raw, other = random_blocks(qtype, 37, 512, seed=1), random_blocks(T.Q6_K, 16, 512, seed=2)
        parts = [(int(qtype), torch.from_numpy(raw)), (int(T.Q6_K), torch.from_numpy(other))]
        reference = torch.cat([torch.from_numpy(dequantize(raw, qtype)), torch.from_numpy(dequantize(other, T.Q6_K))])
        reference = reference.double()
    weights = GgufSegments(parts, 512)
    x = torch.randn(40, 512) * torch.rand(40, 512) ** 4
    got = gguf_linear(x, weights, batch_invariant=False)
    expected = x.double() @ reference.T
    assert ((got.double() - expected).abs() <= 1e-5 * (x.double().abs() @ reference.abs().T) + 1e-30).all()
    fixed = gguf_linear(x, weights)
    assert not torch.equal(got, fixed)  # the other path ran
    assert torch.equal(gguf_linear(x[:23], weights, batch_invariant=False), fixed[:23])
    assert torch.equal(gguf_linear(x, weights, simd="none", batch_invariant=False), fixed)


@pytest.mark.parametrize("activations", list(QUANTIZED))
@pytest.mark.parametrize("simd", list(GGUF_SIMD))
@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda t: t.name)
def test_matmul_within_the_bound(qtype, simd, activations):
    torch.manual_seed(0)
    raw = random_blocks(qtype, 37, 512, seed=1)  # 37 rows: a last tile of one row
    weights = GgufSegments([(int(qtype), torch.from_numpy(raw))], 512)
    reference = torch.from_numpy(dequantize(raw, qtype)).double()
    for rows in (1, 2, 5):  # one row, a whole pass of two, and a remainder
        x = torch.randn(rows, 512) * torch.rand(rows, 512) ** 4  # uneven magnitudes within a block
        got = gguf_linear(x, weights, simd=simd, activations=activations)
        error = (got.double() - x.double() @ reference.T).abs()
        ratio = (error / error_bound(x, raw, qtype, activations)).max().item()
        assert ratio <= 1, (rows, ratio)
        exact = (gguf_linear(x, weights).double() - x.double() @ reference.T).abs()
        assert (error > exact).float().mean() > 0.5  # the kernel does quantize x: most outputs are off by more


@pytest.mark.parametrize("activations", list(QUANTIZED))
@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda t: t.name)
def test_rows_do_not_depend_on_the_batch_and_simd_agrees(qtype, activations):
    """One row at a time (the register path: with int16 x on AVX-512 two sub-blocks at a time, else AVX2's), two,
    seven (AVX-512: the register path, 4 + 3 rows a pass; else decoded tiles) and twenty (decoded tiles): the
    same bits (every path sums in the same order); with AVX2's code forced, two rows at a time; an odd number of
    32-weight blocks (the 32-weight types: 33, a group of 8 short) for the even / odd split."""
    cols = 1024 if GGUF_SUPER[int(qtype)][0] == 256 else 1056
    raw = torch.from_numpy(random_blocks(qtype, 64, cols, seed=2))
    weights = GgufSegments([(int(qtype), raw)], cols)
    x = torch.randn(20, cols)
    batch = gguf_linear(x, weights, activations=activations)
    assert torch.equal(torch.cat([gguf_linear(x[i:i + 1], weights, activations=activations) for i in range(20)]),
                       batch)
    assert torch.equal(gguf_linear(x[:2], weights, activations=activations), batch[:2])
    assert torch.equal(gguf_linear(x[:7], weights, activations=activations), batch[:7])
    assert torch.equal(torch.cat([gguf_linear(x[i:i + 2], weights, simd="avx2", activations=activations)
                                  for i in range(0, 20, 2)]), batch)
    # the same integer sums, fp32 sums in another order
    portable = gguf_linear(x, weights, simd="none", activations=activations)
    assert (portable - batch).abs().max() <= 1e-5 * batch.abs().max()


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q4_K, T.Q6_K, T.BF16], ids=lambda t: t.name)
def test_many_bf16_rows_without_the_fixed_order(qtype):
    """Many rows of a bf16 model's x without the fixed order (prefill): where AVX512_BF16 is built, the weights rounded
    to bf16 meet x in bf16 products, within 2^-8 of |x| @ |W| (each weight's rounding, 2^-9 relative, and the
    output's); elsewhere, and with simd avx2, the fp32 tile (x widened exactly: x.float()'s result, rounded). Two
    segments whose units cross between them; x a slice of a wider tensor (a row stride)."""
    if qtype == T.BF16:
        dense = torch.randn(64, 512)
        raw = dense.bfloat16().view(torch.uint8).numpy()
        parts = [(raw[:40], dense[:40].bfloat16().double()), (raw[40:], dense[40:].bfloat16().double())]
    else:
        raw = random_blocks(qtype, 64, 512, seed=7)
        parts = [(raw[:40], torch.from_numpy(dequantize(raw[:40], qtype)).double()),
                 (raw[40:], torch.from_numpy(dequantize(raw[40:], qtype)).double())]
    weights = GgufSegments([(int(qtype), torch.from_numpy(r)) for r, _ in parts], 512)
    reference = torch.cat([w for _, w in parts])
    for rows in (9, 40, 300):  # a 12-row tile's last pass mostly repeats; 300: two chunks of x
        x = (torch.randn(rows, 700) * torch.rand(rows, 700) ** 4).bfloat16()[:, 100:612]
        got = gguf_linear(x, weights, batch_invariant=False)
        widened = gguf_linear(x.float(), weights, batch_invariant=False).bfloat16()
        assert torch.equal(gguf_linear(x, weights, simd="avx2", batch_invariant=False), widened)
        error = (got.double() - x.double() @ reference.T).abs()
        assert (error <= (x.double().abs() @ reference.abs().T) / 256 + 1e-30).all()
        if qtype != T.BF16:  # (bf16 weights lose nothing to the rounding: both paths give about the same bits)
            assert torch.equal(got, widened) == ("avx512_bf16_tile" not in gguf_simd_features())  # which path ran


@pytest.mark.parametrize("activations", list(QUANTIZED))
def test_fused_segments_of_mixed_types_and_strided_rows(activations):
    """q / k / v of a Q4_K_M file: Q4_K, Q4_K, Q6_K side by side in one output (in int16 x is kept in two layouts,
    natural for Q4_K and slot order for Q6_K); x in bf16 with a row stride (a slice of a wider tensor); a segment that
    is a row slice of a bigger tensor (tensor parallelism)."""
    parts = [(T.Q4_K, random_blocks(T.Q4_K, 32, 512, seed=4)), (T.Q4_K, random_blocks(T.Q4_K, 8, 512, seed=5)),
             (T.Q6_K, random_blocks(T.Q6_K, 16, 512, seed=6)[4:12])]
    weights = GgufSegments([(int(t), torch.from_numpy(r)) for t, r in parts], 512)
    wide = torch.randn(3, 700).to(torch.bfloat16)
    x = wide[:, 100:612]
    got = gguf_linear(x, weights, activations=activations)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 48)
    separate = torch.cat([gguf_linear(x, GgufSegments([(int(t), torch.from_numpy(r))], 512), activations=activations)
                          for t, r in parts], 1)
    assert torch.equal(got, separate)
    reference = torch.cat([torch.from_numpy(dequantize(r, t)) for t, r in parts]).double()
    bound = torch.cat([error_bound(x.float(), r, t, activations) for t, r in parts], 1)
    # bf16 output: one more rounding (2^-8 relative)
    assert ((got.double() - x.double() @ reference.T).abs() <= bound + got.double().abs() / 256).all()


@pytest.mark.parametrize("activations", ["fp32", "int16"])
def test_output_columns_are_stored_where_asked(activations):
    """`columns` sends each output column of the weights to its place (how Llama's permuted Q / K rows are put back in
    order): the same values as the plain call, permuted, for one row (the register path), 20 (tiles) and 40 of bf16
    x without the fixed order (the prefill tiles); a list that is no permutation is refused."""
    parts = [(int(T.Q4_K), torch.from_numpy(random_blocks(T.Q4_K, 40, 512, seed=8))),
             (int(T.Q6_K), torch.from_numpy(random_blocks(T.Q6_K, 24, 512, seed=9)))]
    columns = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    plain, permuted = GgufSegments(parts, 512), GgufSegments(parts, 512, columns)
    for x, invariant in ((torch.randn(1, 512), True), (torch.randn(20, 512), True),
                         (torch.randn(40, 512).bfloat16(), False)):
        expected = torch.empty(x.shape[0], 64, dtype=x.dtype)
        expected[:, columns] = gguf_linear(x, plain, activations=activations, batch_invariant=invariant)
        assert torch.equal(gguf_linear(x, permuted, activations=activations, batch_invariant=invariant), expected)
    with pytest.raises(ValueError, match="permutation"):
        GgufSegments(parts, 512, torch.zeros(64, dtype=torch.long))


@pytest.mark.parametrize("simd", list(GGUF_SIMD))
@pytest.mark.parametrize("activations", list(QUANTIZED))
def test_experts_in_one_call_equal_one_call_each(activations, simd):
    """A MoE layer's routed experts in one call (gguf_experts_linear): each expert's rows the bits gguf_linear gives
    for them alone, with fused gate / up segments of two types (Q4_K with Q6_K: both of x's int16 layouts), experts
    with no rows, one row (a decode token), five and twenty (past the register path: decoded tiles), x's rows
    gathered by id (a token routed to several experts) and in bf16."""
    experts, cols = 6, 512
    segments = [GgufSegments([(int(T.Q4_K), torch.from_numpy(random_blocks(T.Q4_K, 24, cols, seed=10 + e))),
                              (int(T.Q6_K), torch.from_numpy(random_blocks(T.Q6_K, 24, cols, seed=20 + e)))], cols)
                for e in range(experts)]
    stacked = GgufExperts(segments)
    counts = [1, 0, 5, 20, 0, 2]
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(11, cols).to(dtype)
        ids = torch.randint(0, 11, (sum(counts),), generator=torch.Generator().manual_seed(1))
        got = gguf_experts_linear(x, starts, stacked, ids, activations, simd)
        assert got.shape == (sum(counts), 48) and got.dtype == dtype
        for e in range(experts):
            rows = ids[starts[e]:starts[e + 1]]
            assert torch.equal(got[starts[e]:starts[e + 1]],
                               gguf_linear(x[rows], segments[e], simd=simd, activations=activations)), (e, dtype)
        # without ids: x's own rows in order
        gathered = x[ids].contiguous()
        assert torch.equal(gguf_experts_linear(gathered, starts, stacked, None, activations, simd), got)
    with pytest.raises(ValueError, match="starts"):
        gguf_experts_linear(x, starts.flip(0), stacked, ids, activations)
    with pytest.raises(ValueError, match="rows"):
        gguf_experts_linear(x, starts, stacked, ids + 11, activations)


def test_the_avx2_build_passes_these_tests_too(tmp_path):
    """The kernels built for AVX2 alone (KVFORGE_CPU_MARCH=x86-64-v3: what a CPU without AVX-512 runs), in a process
    of their own, pass this file's other tests and the other kernels' (test_cpu_kernels.py, test_kv_quant.py): on an
    AVX-512 machine the AVX2 code is tested as built for AVX2 (not only through simd="avx2", which keeps AVX-512
    VNNI's 256-bit instructions)."""
    import os
    import platform
    import subprocess
    import sys
    from pathlib import Path

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64-v3 names an x86 instruction set")
    env = {**os.environ, "KVFORGE_CPU_MARCH": "x86-64-v3", "KVFORGE_CACHE_DIR": str(tmp_path)}
    features = subprocess.run([sys.executable, "-c", "from kvforge.core.cpu_kernels import gguf_simd_features; "
                               "print(*gguf_simd_features())"], env=env, capture_output=True, text=True, timeout=600)
    assert features.stdout.split() == ["avx2"], features.stderr[-2000:]
    here = Path(__file__)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here),
                          str(here.with_name("test_cpu_kernels.py")), str(here.with_name("test_kv_quant.py")), "-k",
                          "not avx2_build"], env=env,
                         cwd=here.parents[2], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:]


def test_layout_errors_are_named():
    with pytest.raises(ValueError, match="no block kernel"):
        GgufSegments([(int(T.IQ2_XXS), torch.zeros(1, 66, dtype=torch.uint8))], 256)
    with pytest.raises(ValueError, match=r"uint8 \[rows, 18\]"):
        GgufSegments([(int(T.Q4_0), torch.zeros(2, 20, dtype=torch.uint8))], 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [200, 203])  # 203: the last cols % 8 products after the lanes' sum (portable path)
def test_float_weights_are_read_in_place(dtype, cols):
    """F32 / F16 / BF16 weights (their bytes as the file holds them): fp32 math on x as given, through the same
    paths as the block types (rows converted in registers for a few rows of x, a converted panel for many, the
    portable loops), each row's result independent of the batch and of the path; rows read back as their values."""
    qtype = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}[dtype]
    weight = (torch.randn(37, cols) * 0.02).to(dtype)
    raw = weight.view(torch.uint8)
    segments = GgufSegments([(qtype, raw[:20]), (qtype, raw[20:])], cols)
    x = torch.randn(70, cols)  # more rows than one chunk of the panel path
    got = gguf_linear(x, segments)
    expected = x.double() @ weight.double().T
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(torch.cat([gguf_linear(x[i:i + 1], segments) for i in range(6)]), got[:6])
    assert torch.equal(gguf_linear(x[:3], segments), got[:3])
    assert torch.equal(gguf_linear(x, segments, simd="none"), got)
    assert torch.equal(gguf_dequant(qtype, raw, cols, torch.tensor([3, 36])), weight[[3, 36]].float())
    with pytest.raises(ValueError, match="float and block types"):
        GgufSegments([(qtype, raw), (int(T.Q8_0), torch.from_numpy(random_blocks(T.Q8_0, 4, 224)))], cols)
