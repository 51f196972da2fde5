"""The fused Triton kernels (core/kernels/fused.py) against the torch code they replace: `RMSNorm`,
`SiluAndMul`, `apply_rotary` and an index write into the paged KV cache.

Without CUDA the kernels run under the Triton interpreter: a module-scoped fixture sets TRITON_INTERPRET=1
for this module's tests only (as test_triton_gemm does). The kernels round bf16 intermediates to nearest
even by hand under the interpreter (its casts truncate), so fp16 / bf16 results are compared almost
bitwise: at most one ulp apart, and identical except for a rare few (an fp32 reduction or exp that differs
in its last bit can flip a rounding). Rotary and the KV store are exact in every dtype.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvforge.core.kv.quant import FP8_DTYPES, KV_FORMATS
from kvforge.core.layers.activation import SiluAndMul
from kvforge.core.layers.norm import RMSNorm
from kvforge.core.layers.rotary import RotaryEmbedding, apply_rotary

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


pytestmark = pytest.mark.usefixtures("triton_kernels")  # compiled on a GPU, else interpreted


def _fused():
    from kvforge.core.kernels import fused  # imported here: it needs triton, which the fixture requires

    return fused


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _wide(gen: torch.Generator, rows: int, cols: int, dtype: torch.dtype, pad: int = 5) -> torch.Tensor:
    """[rows, cols] whose rows are `pad` elements further apart than their width (a non-contiguous view)."""
    view = _randn(gen, rows, cols + pad, dtype=dtype)[:, 2:2 + cols]
    assert rows < 2 or not view.is_contiguous()
    return view


def _assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: within ~1e-6 relative. fp16 / bf16: at most one ulp apart and at least 99% bitwise equal."""
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.device == ref.device
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        return
    a, b = out.float(), ref.float()
    finfo = torch.finfo(ref.dtype)
    # one ulp of the smaller of two neighbours is at most eps times the larger magnitude
    tol = finfo.eps * torch.maximum(a.abs(), b.abs()) + finfo.eps * finfo.smallest_normal
    worst = ((a - b).abs() / tol).max().item()
    assert worst <= 1.0, f"{ref.dtype} results differ by more than an ulp (worst ratio {worst:.2f})"
    equal = (a == b).float().mean().item()
    assert equal >= 0.99, f"only {equal:.1%} of the {ref.dtype} results equal torch's bitwise"


# ---------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("residual", (False, True), ids=("plain", "residual"))
@pytest.mark.parametrize(("tokens", "width"), ((1, 576), (3, 100), (17, 7)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_rms_norm_matches_layer(dtype, tokens, width, residual):
    gen = torch.Generator().manual_seed(tokens * 1000 + width)
    layer = RMSNorm(width, eps=1e-5, dtype=dtype).to(DEVICE)
    layer.weight.data.copy_(_randn(gen, width, dtype=dtype))
    x = _wide(gen, tokens, width, dtype)
    if not residual:
        _assert_matches(_fused().rms_norm(x, layer.weight, layer.eps), layer(x))
        return
    res = _randn(gen, width, tokens, dtype=dtype).t()  # columns one token apart: a column stride != 1
    out, total = _fused().rms_norm(x, layer.weight, layer.eps, res)
    ref_out, ref_total = layer(x, res)
    assert torch.equal(total, ref_total)  # the sum is rounded to the dtype exactly as torch rounds it
    _assert_matches(out, ref_out)


def test_rms_norm_fp32_weight_on_bf16_input():
    """HF order with mixed dtypes: the normalised bf16 value times an fp32 weight gives fp32, as in torch."""
    gen = torch.Generator().manual_seed(1)
    layer = RMSNorm(100, dtype=torch.float32).to(DEVICE)
    layer.weight.data.copy_(_randn(gen, 100))
    x, res = _randn(gen, 3, 100, dtype=torch.bfloat16), _randn(gen, 3, 100, dtype=torch.bfloat16)
    out, total = _fused().rms_norm(x, layer.weight, layer.eps, res)
    ref_out, ref_total = layer(x, res)
    assert out.dtype == torch.float32 and total.dtype == torch.bfloat16
    assert torch.equal(total, ref_total)
    _assert_matches(out, ref_out)


@pytest.mark.parametrize("residual", (False, True), ids=("plain", "residual"))
def test_rms_norm_inplace(residual):
    gen = torch.Generator().manual_seed(2)
    layer = RMSNorm(100, dtype=torch.float16).to(DEVICE)
    layer.weight.data.copy_(_randn(gen, 100, dtype=torch.float16))
    x = _wide(gen, 3, 100, torch.float16)
    res = _randn(gen, 3, 100, dtype=torch.float16) if residual else None
    ref = layer(x.clone(), None if res is None else res.clone())
    got = _fused().rms_norm(x, layer.weight, layer.eps, res, inplace=True)
    if residual:
        assert got[0] is x and got[1] is res
        assert torch.equal(res, ref[1])
        ref = ref[0]
    else:
        assert got is x
    _assert_matches(x, ref)


# ---------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize(("tokens", "inter"), ((1, 7), (3, 100), (2, 2500)))  # 2500: two column tiles a row
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_silu_and_mul_matches_layer(dtype, tokens, inter):
    gen = torch.Generator().manual_seed(tokens * 1000 + inter)
    x = _wide(gen, tokens, 2 * inter, dtype) * 3  # silu's curved part and both tails
    out = _fused().silu_and_mul(x)
    assert out.shape == (tokens, inter)
    _assert_matches(out, SiluAndMul()(x))


def test_silu_and_mul_leading_dims():
    gen = torch.Generator().manual_seed(3)
    x = _randn(gen, 2, 3, 2 * 33, dtype=torch.bfloat16)
    _assert_matches(_fused().silu_and_mul(x), SiluAndMul()(x))


# ---------------------------------------------------------------- rotary_inplace


def _rope(head_dim: int, positions: torch.Tensor, dtype: torch.dtype):
    return RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), head_dim).to(DEVICE)(positions.to(DEVICE), dtype)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ((4, 2, 64), (3, 1, 24), (32, 8, 128)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_rotary_inplace_on_fused_qkv(dtype, heads, kv_heads, head_dim):
    """q|k of a fused qkv output, viewed as [T, heads + kv_heads, D] (row stride > its width): rotated in
    place, equal to apply_rotary bit for bit; v and the padding after it untouched. (32, 8, 128) spreads
    the heads of each token over three programs."""
    gen = torch.Generator().manual_seed(head_dim)
    tokens = 5 if head_dim < 128 else 3
    qk_width, v_width = (heads + kv_heads) * head_dim, kv_heads * head_dim
    qkv = _randn(gen, tokens, qk_width + v_width + 3, dtype=dtype)
    before = qkv.clone()
    qk = qkv[:, :qk_width].view(tokens, heads + kv_heads, head_dim)
    positions = torch.tensor([0, 7, 1234, 99_999, 5][:tokens])
    cos, sin = _rope(head_dim, positions, dtype)
    if head_dim == 24:
        cos, sin = cos.squeeze(1), sin.squeeze(1)  # [T, D] tables are accepted too
    ref = apply_rotary(qk.clone(), cos.view(tokens, 1, head_dim), sin.view(tokens, 1, head_dim))
    assert _fused().rotary_inplace(qk, cos, sin) is qk
    assert torch.equal(qk, ref)
    assert torch.equal(qkv[:, qk_width:], before[:, qk_width:])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_rotary_uses_each_half_of_the_tables(dtype):
    """Random cos / sin whose halves differ: each half is used where apply_rotary uses it."""
    gen = torch.Generator().manual_seed(4)
    x = _randn(gen, 3, 2, 80, dtype=dtype)
    cos, sin = _randn(gen, 3, 1, 80, dtype=dtype), _randn(gen, 3, 1, 80, dtype=dtype)
    ref = apply_rotary(x, cos, sin)
    assert torch.equal(_fused().rotary_inplace(x, cos, sin), ref)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("block_size", (5, 16))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=lambda d: str(d)[6:])
def test_store_kv_writes_one_layer(dtype, block_size):
    """Shuffled slots (two padding rows, one slot just past the layer) into layer 1 of a 3-layer pool
    whose head_dim is padded (so no cache stride is the default); k and v are columns of a fused qkv."""
    gen = torch.Generator().manual_seed(block_size)
    layers, kv_heads, blocks, head_dim, heads, tokens = 3, 3, 4, 24, 2, 9
    pool = _randn(gen, layers, 2, kv_heads, blocks, block_size, head_dim + 3, dtype=dtype)[..., :head_dim]
    expected = pool.clone()
    cache = pool[1]
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[2] = slots[6] = -1
    slots[4] = blocks * block_size  # the next layer's first slot in a packed pool: dropped
    slots = slots.to(torch.int32 if block_size == 5 else torch.int64).to(DEVICE)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    qkv = _randn(gen, tokens, q_width + 2 * kv_width, dtype=dtype)
    k = qkv[:, q_width:q_width + kv_width].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_width + kv_width:].view(tokens, kv_heads, head_dim)
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < blocks * block_size:
            expected[1, 0, :, slot // block_size, slot % block_size] = k[t]
            expected[1, 1, :, slot // block_size, slot % block_size] = v[t]
    assert _fused().store_kv(k, v, cache, slots) is None
    assert torch.equal(pool, expected)


# ---------------------------------------------------------------- store_kv into a quantized pool


FORMATS = list(KV_FORMATS.values())
FORMAT_IDS = list(KV_FORMATS)


def _check_store(fmt, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
    """k [tokens, kv_heads, D] (and v, by default k * 2) stored by the kernel, token t at slot t of a one-block cache:
    both rows' bytes are KVFormat.quantize's."""
    tokens, kv_heads, d = k.shape
    v = k * 2 if v is None else v
    cache = torch.zeros(2, kv_heads, 1, tokens, fmt.row_bytes(d), dtype=torch.uint8, device=DEVICE)
    _fused().store_kv(k.to(DEVICE), v.to(DEVICE), cache, torch.arange(tokens, device=DEVICE), kv_format=fmt)
    assert torch.equal(cache[:, :, 0].transpose(1, 2).cpu(), fmt.quantize(torch.stack((k.cpu(), v.cpu()))))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_store_kv_quantized_writes_the_references_bytes(fmt, dtype):
    """As test_store_kv_writes_one_layer, into a uint8 pool whose rows are padded (nothing past a row is written):
    each row's bytes are KVFormat.quantize's, bit for bit. Rows span 12 decades, with a zero row and a row whose
    scale is an fp32 subnormal; head_dim 40 pads the 8-bit formats' tile, q4's 64 has two groups."""
    gen = torch.Generator().manual_seed(3)
    layers, kv_heads, blocks, block_size, tokens = 3, 2, 4, 5, 9
    head_dim = 64 if fmt.group else 40
    row = fmt.row_bytes(head_dim)
    pool = torch.randint(0, 256, (layers, 2, kv_heads, blocks, block_size, row + 3), generator=gen,
                         dtype=torch.uint8).to(DEVICE)[..., :row]
    expected = pool.clone()
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[2] = slots[6] = -1
    slots[4] = blocks * block_size  # the next layer's first slot in a packed pool: dropped
    kv_width = kv_heads * head_dim
    qkv = torch.randn(tokens, 3 * kv_width, generator=gen) * torch.logspace(-6, 6, tokens).view(-1, 1)
    qkv[1] = 0.0
    qkv[3, kv_width:2 * kv_width] *= 1e-36  # max|x| / limit below fp32's smallest normal
    qkv = qkv.to(dtype).to(DEVICE)
    k = qkv[:, kv_width:2 * kv_width].view(tokens, kv_heads, head_dim)
    v = qkv[:, 2 * kv_width:].view(tokens, kv_heads, head_dim)
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < blocks * block_size:
            expected[1, :, :, slot // block_size, slot % block_size] = fmt.quantize(
                torch.stack((k[t], v[t])).cpu()).to(DEVICE)
    assert _fused().store_kv(k, v, pool[1], slots.to(DEVICE), kv_format=fmt) is None
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("name", ("fp8_e4m3", "fp8_e5m2"))
def test_store_kv_fp8_rounds_as_torch_over_the_whole_range(name):
    """Rows holding the format's largest value (so the scale is exactly 1) and every other value: each finite fp8
    value, each midpoint between neighbours (ties to even, carries into the exponent, subnormals) and the fp32
    values just either side of each midpoint, both signs."""
    fmt = KV_FORMATS[name]
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPES[name]).float()
    values = values[values.isfinite() & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2
    xs = torch.cat((values, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))))
    xs = torch.cat((xs, -xs))
    per_row = 63
    rows = -(-len(xs) // per_row)
    x = torch.zeros(rows * per_row)
    x[:len(xs)] = xs
    x = torch.cat((x.view(rows, per_row), torch.full((rows, 1), fmt.limit)), 1).view(rows, 1, per_row + 1)
    _check_store(fmt, x)


def test_store_kv_int8_and_q4_round_half_to_even():
    """Scales of exactly 1 (int8: 127 in the row; q4: -8 the group's largest in V, -16 in K) and -1 (q4: +8 first,
    and -8 later of the same magnitude: the first of equals sets the sign), every half-integer between the bounds, zero
    groups of either sign (q4's scale keeps the sign of the zero it came from)."""
    halves = torch.arange(-127, 127) + 0.5
    x = torch.cat((halves, torch.full((2,), 127.0))).view(2, 1, 128)
    _check_store(KV_FORMATS["int8"], x)
    halves = torch.arange(-8, 8) + 0.5
    groups = torch.stack((torch.cat((torch.tensor([-8.0]), halves, torch.zeros(15))),
                          torch.cat((torch.tensor([8.0, 3.0, -8.0]), halves, -halves[:13])),
                          torch.zeros(32), torch.full((32,), -0.0)))
    v = torch.cat((groups, groups.flip(0))).view(2, 1, 128)
    halves = torch.arange(-16, 15) + 0.5  # K's 5-bit codes: -16 the group's largest, scale 1
    groups = torch.stack((torch.cat((torch.tensor([-16.0]), halves)),
                          torch.cat((torch.tensor([16.0, 3.0, -16.0]), halves[:29])),
                          torch.zeros(32), torch.full((32,), -0.0)))
    _check_store(KV_FORMATS["q4"], torch.cat((groups, groups.flip(0))).view(2, 1, 128), v)


# ---------------------------------------------------------------- every kernel follows its input


def test_outputs_follow_inputs():
    """Changing one token's input changes that token's output only (no constant or mixed-up rows)."""
    fused, gen = _fused(), torch.Generator().manual_seed(5)
    x, w = _randn(gen, 3, 40), _randn(gen, 40)
    x2 = x.clone()
    x2[1] *= -2.0
    a, b = fused.rms_norm(x, w, 1e-6), fused.rms_norm(x2, w, 1e-6)
    assert torch.equal(a[[0, 2]], b[[0, 2]]) and not torch.equal(a[1], b[1])

    g = _randn(gen, 3, 2 * 9)
    g2 = g.clone()
    g2[2, :9] += 1.0
    a, b = fused.silu_and_mul(g), fused.silu_and_mul(g2)
    assert torch.equal(a[:2], b[:2]) and not torch.equal(a[2], b[2])

    q = _randn(gen, 3, 2, 16)
    cos, sin = _rope(16, torch.tensor([1, 2, 3]), torch.float32)
    cos2, sin2 = _rope(16, torch.tensor([1, 20, 3]), torch.float32)
    a, b = fused.rotary_inplace(q.clone(), cos, sin), fused.rotary_inplace(q.clone(), cos2, sin2)
    assert torch.equal(a[[0, 2]], b[[0, 2]]) and not torch.equal(a[1], b[1]) and not torch.equal(a, q)

    k, v = _randn(gen, 2, 1, 8), _randn(gen, 2, 1, 8)
    slots = torch.tensor([3, 0], device=DEVICE)
    c1, c2 = torch.zeros(2, 1, 2, 2, 8, device=DEVICE), torch.zeros(2, 1, 2, 2, 8, device=DEVICE)
    fused.store_kv(k, v, c1, slots)
    fused.store_kv(k, v * 2, c2, slots)
    assert torch.equal(c1[0], c2[0]) and not torch.equal(c1[1], c2[1]) and c1.abs().sum() > 0


# ---------------------------------------------------------------- bad inputs


BAD_CASES = (
    "rms 1-d x", "rms weight size", "rms int x", "rms residual shape", "rms residual dtype", "rms inplace promotes",
    "rms devices", "silu odd width", "silu int", "rotary 2-d x", "rotary odd head_dim", "rotary table shape",
    "rotary table dtype", "kv shapes", "kv cache dims", "kv cache heads", "kv dtype", "kv slots dtype",
    "kv slots length", "kv uint8 cache without a format", "kv format with a float cache", "kv format row bytes",
    "kv format unknown", "kv q4 head_dim", "kv format int k",
)


def _bad_calls() -> dict:
    """case name -> (a call that must raise ValueError, a piece of its message)."""
    f = _fused()
    x, w = torch.randn(3, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    kv, cache = torch.randn(3, 2, 8, device=DEVICE), torch.zeros(2, 2, 4, 5, 8, device=DEVICE)
    int8, rows = KV_FORMATS["int8"], torch.zeros(2, 2, 4, 5, 10, dtype=torch.uint8, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    cos = torch.randn(3, 1, 8, device=DEVICE)
    return {
        "rms 1-d x": (lambda: f.rms_norm(w, w, 1e-6), "tokens, hidden"),
        "rms weight size": (lambda: f.rms_norm(x, torch.randn(7, device=DEVICE), 1e-6), "weight must be"),
        "rms int x": (lambda: f.rms_norm(x.long(), w, 1e-6), "x must be float16"),
        "rms residual shape": (lambda: f.rms_norm(x, w, 1e-6, x[:2]), "residual must match"),
        "rms residual dtype": (lambda: f.rms_norm(x, w, 1e-6, x.half()), "residual must match"),
        "rms inplace promotes": (lambda: f.rms_norm(x.half(), w, 1e-6, inplace=True), "inplace"),
        "rms devices": (lambda: f.rms_norm(x, w.to("meta"), 1e-6), "one device"),
        "silu odd width": (lambda: f.silu_and_mul(torch.randn(3, 7, device=DEVICE)), "even last dimension"),
        "silu int": (lambda: f.silu_and_mul(torch.ones(3, 8, dtype=torch.int32, device=DEVICE)), "float16"),
        "rotary 2-d x": (lambda: f.rotary_inplace(x, cos, cos), "tokens, heads, head_dim"),
        "rotary odd head_dim": (lambda: f.rotary_inplace(torch.randn(3, 2, 7, device=DEVICE), cos, cos),
                                "even head_dim"),
        "rotary table shape": (lambda: f.rotary_inplace(kv, cos[:2], cos[:2]), "cos must be"),
        "rotary table dtype": (lambda: f.rotary_inplace(kv, cos, cos.half()), "sin must have"),
        "kv shapes": (lambda: f.store_kv(kv, kv[:, :1], cache, slots), "k and v"),
        "kv cache dims": (lambda: f.store_kv(kv, kv, cache[0], slots), "kv_cache must be"),
        "kv cache heads": (lambda: f.store_kv(kv, kv, torch.zeros(2, 3, 4, 5, 8, device=DEVICE), slots),
                           "kv_cache must be"),
        "kv dtype": (lambda: f.store_kv(kv.half(), kv.half(), cache, slots), "share one dtype"),
        "kv slots dtype": (lambda: f.store_kv(kv, kv, cache, slots.float()), "slots must be"),
        "kv slots length": (lambda: f.store_kv(kv, kv, cache, slots[:2]), "slots must be"),
        "kv uint8 cache without a format": (lambda: f.store_kv(kv, kv, cache.to(torch.uint8), slots),
                                            "kv_cache is uint8 .* kv_format is None"),
        "kv format with a float cache": (lambda: f.store_kv(kv, kv, torch.zeros(2, 2, 4, 5, 10, device=DEVICE), slots,
                                                            kv_format=int8), "int8 stores uint8 rows, but kv_cache is"),
        "kv format row bytes": (lambda: f.store_kv(kv, kv, rows[..., :9], slots, kv_format=int8),
                                "int8 stores rows of 10 bytes at head_dim 8, but kv_cache rows have 9"),
        "kv format unknown": (lambda: f.store_kv(kv, kv, rows, slots, kv_format=replace(int8, name="int6")),
                              "read no KV format .*int6"),
        "kv q4 head_dim": (lambda: f.store_kv(kv, kv, rows, slots, kv_format=KV_FORMATS["q4"]), "not a multiple"),
        "kv format int k": (lambda: f.store_kv(kv.long(), kv.long(), rows, slots, kv_format=int8), "k must be float"),
    }


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_inputs_raise(case):
    calls = _bad_calls()
    assert set(calls) == set(BAD_CASES)
    call, message = calls[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors"):
        _fused().silu_and_mul(torch.randn(2, 8))
