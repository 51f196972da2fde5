"""The Triton GPTQ-v2 dequantize-GEMM against the pure-torch reference (`packing.Quantized.dequantize`).

Without CUDA the kernel runs under the Triton interpreter: a module-scoped fixture sets TRITON_INTERPRET=1
for this module's tests only and restores it afterwards (so later tests, e.g. the plugins', still see
`triton_available()` False on a CPU machine). That works whatever imported triton first, because
triton 3.9 decides interpreted vs compiled when a function is jitted, and `triton_gemm` jits its kernel
at the first call (`test_interpreter_is_chosen_at_first_call` checks this in a fresh process).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvforge.plugins.quant.packing import pack_gptq, quantize_rtn, unpack_gptq
from kvforge.plugins.quant.triton_gemm import dequant_gemm, triton_available

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"


pytestmark = pytest.mark.usefixtures("triton_kernels")  # compiled on a GPU, else interpreted


def _layer(n: int, k: int, bits: int, group: int, sym: bool, desc_act: bool,
           scales_dtype: torch.dtype = torch.float16):
    """GPTQ v2 tensors of a random [n, k] layer and the weight they stand for (fp32 [n, k])."""
    quant = quantize_rtn(torch.randn(n, k), bits, group, sym=sym, desc_act=desc_act)
    tensors = pack_gptq(quant, "gptq_v2")
    tensors["scales"] = tensors["scales"].to(scales_dtype)
    weight = unpack_gptq(tensors, bits, "gptq_v2").dequantize()
    if desc_act and k // group > 1:
        assert not torch.equal(tensors["g_idx"], tensors["g_idx"].sort().values), "act-order g_idx expected"
    return {name: t.to(DEVICE) for name, t in tensors.items()}, weight.to(DEVICE)


# Unit roundoff of the output dtype: rounding the fp32 accumulator to it errs by at most u * |y|.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _check(x: torch.Tensor, tensors: dict, weight: torch.Tensor, bits: int, **blocks) -> None:
    y = dequant_gemm(x, tensors["qweight"], tensors["scales"], tensors["qzeros"], tensors["g_idx"], bits, **blocks)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], weight.shape[0]) and y.device == x.device
    # The kernel dequantizes W exactly in fp32 (scale * small integer) and rounds it to x.dtype (RNE), as
    # the reference does, so the exact answer is F.linear on those operands in fp64. What the kernel may
    # add: fp32 accumulation in another order (<= K * 2**-24 * sum|x||w|, doubled for tensor-core
    # accumulation) and the final rounding to x.dtype (<= u * |y|, plus half a subnormal step near 0).
    w = weight.to(x.dtype).double()
    ref = F.linear(x.double(), w)
    k = x.shape[-1]
    accumulation = 2 * k * 2.0**-24 * F.linear(x.double().abs(), w.abs())
    u = UNIT_ROUNDOFF[x.dtype]
    tol = u * ref.abs() + (1 + u) * accumulation + torch.finfo(x.dtype).smallest_normal * u
    err = (y.double() - ref).abs()
    worst = (err / tol).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"error {err.max().item():.3g} exceeds the tolerance (worst ratio {worst:.2f})"


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MS = (1, 3, 17)


def _grid():
    """bits x group (32, 64, K) x (sym, desc_act), cycling M, N, K and dtype so each value is covered."""
    cases = []
    for i, (bits, group, (sym, desc)) in enumerate(
            itertools.product((4, 8), (32, 64, None), itertools.product((True, False), (False, True)))):
        k = (64, 128, 192)[i % 3] if group != 32 else (64, 96, 128, 192)[i % 4]
        n = (40, 72)[i % 2]
        cases.append(pytest.param(bits, group or k, sym, desc, MS[i % 3], n, k, DTYPES[(i // 3) % 3],
                                  id=f"b{bits}-g{group or 'K'}-{'sym' if sym else 'asym'}{'-desc' if desc else ''}"
                                     f"-m{MS[i % 3]}-n{n}-k{k}-{str(DTYPES[(i // 3) % 3])[6:]}"))
    return cases


@pytest.mark.parametrize(("bits", "group", "sym", "desc_act", "m", "n", "k", "dtype"), _grid())
def test_matches_reference(bits, group, sym, desc_act, m, n, k, dtype):
    tensors, weight = _layer(n, k, bits, group, sym, desc_act)
    _check(torch.randn(m, k, device=DEVICE).to(dtype), tensors, weight, bits)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_every_dtype_and_m(dtype, m):
    tensors, weight = _layer(72, 128, 4, 32, sym=False, desc_act=True)
    _check(torch.randn(m, 128, device=DEVICE).to(dtype), tensors, weight, 4)


@pytest.mark.parametrize(("sym", "desc_act", "dtype"), [(True, False, torch.float16), (False, True, torch.float32)])
def test_two_bit(sym, desc_act, dtype):
    tensors, weight = _layer(48, 128, 2, 32, sym=sym, desc_act=desc_act)  # 2-bit zeros pack 16 columns a word
    _check(torch.randn(3, 128, device=DEVICE).to(dtype), tensors, weight, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_many_tiles_and_k_tail(dtype):
    """Small blocks: 2 M tiles, 3 N tiles (the last one partial), a K tail of half a block."""
    tensors, weight = _layer(40, 96, 4, 32, sym=False, desc_act=True)
    _check(torch.randn(17, 96, device=DEVICE).to(dtype), tensors, weight, 4, block_m=16, block_n=16, block_k=64)


@pytest.mark.parametrize("scales_dtype", (torch.bfloat16, torch.float32), ids=lambda d: str(d)[6:])
def test_scales_dtype_other_than_x(scales_dtype):
    tensors, weight = _layer(40, 64, 8, 32, sym=False, desc_act=False, scales_dtype=scales_dtype)
    _check(torch.randn(3, 64, device=DEVICE).half(), tensors, weight, 8)


def test_strided_and_batched_x():
    tensors, weight = _layer(40, 64, 4, 32, sym=True, desc_act=True)
    _check(torch.randn(3, 128, device=DEVICE)[:, ::2], tensors, weight, 4)  # non-contiguous rows
    _check(torch.randn(2, 3, 64, device=DEVICE), tensors, weight, 4)  # leading dims are flattened
    g = tensors["g_idx"].long()  # int64 g_idx works too
    _check(torch.randn(2, 64, device=DEVICE), {**tensors, "g_idx": g}, weight, 4)


def test_empty_batch():
    tensors, _ = _layer(40, 64, 4, 32, sym=True, desc_act=False)
    x = torch.randn(0, 64, device=DEVICE)
    y = dequant_gemm(x, tensors["qweight"], tensors["scales"], tensors["qzeros"], tensors["g_idx"], 4)
    assert y.shape == (0, 40)


def _bad(name: str, **change):
    return pytest.param(change, id=name)


@pytest.mark.parametrize("change", [
    _bad("k-not-whole-words", x=torch.randn(2, 60)),
    _bad("x-int", x=torch.ones(2, 64, dtype=torch.int32)),
    _bad("bits-3", bits=3),
    _bad("qweight-rows", qweight=torch.zeros(16, 40, dtype=torch.int32)),
    _bad("qweight-int64", qweight=torch.zeros(8, 40, dtype=torch.int64)),
    _bad("scales-n", scales=torch.ones(2, 48, dtype=torch.float16)),
    _bad("scales-int", scales=torch.ones(2, 40, dtype=torch.int32)),
    _bad("qzeros-shape", qzeros=torch.zeros(2, 4, dtype=torch.int32)),
    _bad("qzeros-groups", qzeros=torch.zeros(3, 5, dtype=torch.int32)),
    _bad("g_idx-length", g_idx=torch.zeros(32, dtype=torch.int32)),
    _bad("g_idx-float", g_idx=torch.zeros(64)),
    _bad("block-too-small", block_n=8),
    _bad("block-not-pow2", block_k=48),
])
def test_shape_errors(change):
    tensors, _ = _layer(40, 64, 4, 32, sym=True, desc_act=False)
    args = {"x": torch.randn(2, 64, device=DEVICE), **tensors, "bits": 4}
    args.update({key: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
                 for key, value in change.items()})
    with pytest.raises(ValueError):
        dequant_gemm(**args)


def test_triton_available_and_cpu_without_interpreter(monkeypatch):
    assert triton_available()
    if ON_CUDA:
        return
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_available()
    tensors, _ = _layer(40, 64, 4, 32, sym=True, desc_act=False)
    with pytest.raises(ValueError, match="CUDA"):
        dequant_gemm(torch.randn(2, 64), tensors["qweight"], tensors["scales"], tensors["qzeros"],
                     tensors["g_idx"], 4)


@pytest.mark.skipif(ON_CUDA, reason="checks the CPU interpreter path")
def test_interpreter_is_chosen_at_first_call():
    """triton and the kernel module imported before TRITON_INTERPRET is set: the first call still interprets."""
    script = (
        "import os, torch, triton\n"
        "from kvforge.plugins.quant.triton_gemm import dequant_gemm, triton_available\n"
        "from kvforge.plugins.quant.packing import pack_gptq, quantize_rtn\n"
        "assert not triton_available()\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "assert triton_available()\n"
        "t = pack_gptq(quantize_rtn(torch.randn(16, 32), 4, 32, sym=True), 'gptq_v2')\n"
        "y = dequant_gemm(torch.randn(1, 32), t['qweight'], t['scales'], t['qzeros'], t['g_idx'], 4)\n"
        "assert y.shape == (1, 16) and bool(torch.isfinite(y).all())\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
