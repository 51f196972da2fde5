"""Quantized KV rows (core/kv/quant.py): the reference's error bounds, the C store kernel writing the reference's bytes
bit for bit, and the paged C kernel reading them (SIMD and portable loops) as attention over the dequantized cache."""

from __future__ import annotations

import pytest
import torch

from kvforge.core.cpu_kernels import paged_attention, store_kv, unavailable
from kvforge.core.kv.quant import KV_FORMATS, kv_format
from tests.core.test_cpu_kernels import reference
from tests.helpers.optional_parts import require

FORMATS = list(KV_FORMATS.values())
IDS = list(KV_FORMATS)


@pytest.fixture(scope="module")
def kernels():
    require(unavailable() is None, f"the C kernels cannot be built here: {unavailable()}")


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_round_trip_error_is_bounded_per_format(fmt):
    """K and V rows come back within their format's step: half a code step for int8 (relative to the row's largest
    value); for q4 a step of the group's largest value / 16 for K's 5-bit codes and / 8 for V's 4-bit ones (a value of
    the other sign as large as the largest is clamped to the top code); fp8's relative rounding; zero rows stay zero;
    bytes per row as documented."""
    torch.manual_seed(0)
    x = torch.randn(2, 64, 4, 128) * torch.logspace(-3, 3, 64).view(1, 64, 1, 1)
    x[:, 0, 0] = 0
    back = fmt.dequantize(fmt.quantize(x), 128)
    assert back[:, 0, 0].abs().max() == 0
    size = fmt.group or 128
    grouped_max = x.view(2, 64, 4, -1, size).abs().amax(-1, keepdim=True)
    error = (back - x).view(2, 64, 4, -1, size).abs()
    bound = {"int8": 0.5 / 127 + 1e-3, "q4": 1 / 8 + 1e-3, "fp8_e4m3": 2 ** -4 + 1e-3,
             "fp8_e5m2": 2 ** -3 + 1e-3}[fmt.name]
    if fmt.name.startswith("fp8"):  # relative to each value (above the subnormal range of the scaled format)
        assert bool((error <= bound * x.view(2, 64, 4, -1, size).abs() + grouped_max * 2 ** -12).all())
    elif fmt.key_bits:
        assert bool((error[0] <= (1 / 16 + 1e-3) * grouped_max[0]).all())
        assert bool((error[1] <= bound * grouped_max[1]).all())
        assert error[0].pow(2).mean() < error[1].pow(2).mean() / 3  # a bit more per K value: a quarter the error
    else:
        assert bool((error <= bound * grouped_max).all())
    assert fmt.row_bytes(128) == {"int8": 130, "fp8_e4m3": 130, "fp8_e5m2": 130, "q4": 80}[fmt.name]
    assert fmt.unsupported(128) is None
    with pytest.raises(ValueError, match="K and V stacked"):
        fmt.quantize(x[0])


def test_format_names_and_head_sizes_are_checked():
    assert kv_format("auto") is None
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3, fp8_e5m2, q4"):
        kv_format("q8_0")
    assert "not a multiple" in KV_FORMATS["q4"].unsupported(80)
    assert KV_FORMATS["int8"].unsupported(80) is None


def scattered_rows(tokens: int, kv_heads: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (K/V, token, head)'s row in a [2 * kv_heads * slots] view, tokens at random slots (the runner's order)."""
    chosen = torch.randperm(slots)[:tokens]
    planes = torch.arange(2 * kv_heads).view(2, 1, kv_heads) * slots
    return chosen, (planes + chosen.view(1, -1, 1)).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_the_store_kernel_writes_the_references_bytes(kernels, fmt, dtype):
    """Every row quantized on its own, as the reference does, bit for bit: rows of zeros, a single outlier, tiny
    values (fp8's subnormal codes), ties."""
    torch.manual_seed(1)
    tokens, kv_heads, head_dim, slots = 9, 3, 64, 32
    fused = (torch.randn(tokens, 3 * kv_heads * head_dim) * 3).to(dtype)  # k, v as column ranges of one output
    k = fused[:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = fused[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    k[0, 0] = 0
    k[1, 1, 5] = -500
    k[2, 2] *= 1e-5
    v[3, 0] = torch.arange(head_dim).to(dtype) / 4 - 8  # exact halves: round-half-even ties
    cache = torch.full((2, kv_heads, slots // 16, 16, fmt.row_bytes(head_dim)), 0xAB, dtype=torch.uint8)
    chosen, rows = scattered_rows(tokens, kv_heads, slots)
    store_kv(k, v, cache, rows, fmt)
    written = cache.view(2, kv_heads, slots, -1)[:, :, chosen].transpose(1, 2)  # [2, tokens, heads, row bytes]
    assert torch.equal(written, fmt.quantize(torch.stack((k, v))))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_codes_equal_torchs_conversion_over_the_whole_range(kernels, name):
    """The C conversion (c10's, written out) against torch's .to(float8) on a million values spread over every
    binade the scaled values reach, subnormal codes and the largest value included."""
    fmt = KV_FORMATS[name]
    torch.manual_seed(2)
    magnitudes = torch.exp2(torch.empty(1 << 20).uniform_(-30, 0)) * fmt.limit
    values = magnitudes * torch.where(torch.rand(1 << 20) < 0.5, -1.0, 1.0)
    values[:4] = torch.tensor([fmt.limit, -fmt.limit, 0.0, -0.0])
    rows = values.view(-1, 2, 1, 64)  # as K rows of a single head: each row's scale is its own max / limit
    k, v = rows[:, 0].contiguous(), rows[:, 1].contiguous()
    cache = torch.zeros(2, 1, rows.shape[0] // 16, 16, fmt.row_bytes(64), dtype=torch.uint8)
    chosen, slots = scattered_rows(rows.shape[0], 1, rows.shape[0])
    store_kv(k, v, cache, slots, fmt)
    written = cache.view(2, 1, rows.shape[0], -1)[:, :, chosen].transpose(1, 2)
    assert torch.equal(written, fmt.quantize(torch.stack((k, v))))


def quantized_cache(fmt, kv_heads: int, num_blocks: int, block: int, head_dim: int, seed: int = 0):
    """A random pool layer in `fmt` and its dequantized values ([2, kv_heads, blocks, block, head_dim] fp32)."""
    torch.manual_seed(seed)
    values = torch.randn(2, kv_heads, num_blocks, block, head_dim) * torch.rand(2, kv_heads, num_blocks, block, 1) * 4
    cache = fmt.quantize(values)
    return cache, fmt.dequantize(cache, head_dim)


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window", "softcap"),
                         [(9, 3, 64, None, None),  # SmolLM2-135M
                          (4, 1, 256, 37, 1.5),  # Gemma 3 270M's shape, a sliding window, soft-capped
                          (6, 6, 96, None, None)])  # a head size the SIMD paths do not take whole
def test_paged_attention_reads_each_format_as_its_dequantized_values(kernels, fmt, dtype, heads, kv_heads, head_dim,
                                                                      window, softcap, portable):
    block, num_blocks, batch = 16, 40, 5
    cache, values = quantized_cache(fmt, kv_heads, num_blocks, block, head_dim)
    lens = torch.tensor([1, 0, 17, 95, 161], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks)[:11] for _ in range(batch)]).int()
    q = torch.randn(batch, heads, head_dim).to(dtype)
    out = torch.full((batch, heads * head_dim), float("nan"), dtype=dtype)
    paged_attention(q, cache, tables, lens, head_dim ** -0.5, window, out, portable=portable, softcap=softcap,
                    kv_format=fmt)
    expected = reference(q, values, tables, lens, head_dim ** -0.5, window, softcap)
    error = (out.double() - expected).abs().max().item()
    # fp32 math over the dequantized values; one rounding of the output in bf16
    assert error < (5e-6 if dtype == torch.float32 else 2 ** -8) * expected.abs().max().item(), error
    assert out[1].abs().max().item() == 0


def test_a_cache_and_format_that_do_not_match_are_refused(kernels):
    fmt = KV_FORMATS["int8"]
    q, out = torch.zeros(1, 2, 64), torch.zeros(1, 128)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_format int8 stores uint8 rows, but kv_cache is torch.float32"):
        paged_attention(q, torch.zeros(2, 1, 4, 16, 64), tables, lens, 0.1, None, out, kv_format=fmt)
    with pytest.raises(ValueError, match="kv_format int8 stores rows of 66 bytes at head_dim 64, but kv_cache rows "
                                         "have 36"):
        paged_attention(q, torch.zeros(2, 1, 4, 16, 36, dtype=torch.uint8), tables, lens, 0.1, None, out,
                        kv_format=fmt)
    with pytest.raises(ValueError, match=r"kv_cache is uint8 \(a quantized pool\) but kv_format is None"):
        paged_attention(q, torch.zeros(2, 1, 4, 16, 66, dtype=torch.uint8), tables, lens, 0.1, None, out)


def half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half a unit in the last place of each of x's values in `dtype` (bf16 / fp16): the rounding of an exact result."""
    mantissa = 8 if dtype == torch.bfloat16 else 11
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - mantissa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 256)])
def test_the_integer_and_bf16_paths_stay_within_their_tolerance(kernels, fmt, dtype, heads, kv_heads, head_dim):
    """The paged kernel's SIMD paths for bf16 / fp16 activations (core/cpu_kernels/paged_attention.c): int8 and q4 with
    q and the weights as int16 codes, fp8 as bf16 (subnormal codes read as 0). Against fp64 attention over the
    dequantized cache, beyond the output's own rounding (half an ulp): int8 / q4 within 2^-9 of the largest output
    (measured 8e-4 at peaked scores: q's int16 rounding, <= max|q| / 65534, moves a score by up to ~1e-3), fp8 within
    2^-12 (measured 1e-6; rows with subnormal codes included). Contexts cross the 256-key blocks of the weights'
    scales, with odd lengths; q scaled up gives peaked softmaxes."""
    torch.manual_seed(3)
    block, num_blocks, batch = 16, 80, 4
    values = torch.randn(2, kv_heads, num_blocks, block, head_dim) * torch.rand(2, kv_heads, num_blocks, block, 1) * 4
    values[:, :, ::3, :, ::2] *= 1e-5  # fp8: codes below the normal range (e4m3 subnormals) in every third block
    cache = fmt.quantize(values)
    dequantized = fmt.dequantize(cache, head_dim)
    lens = torch.tensor([1, 255, 513, 1100], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks)[:70] for _ in range(batch)]).int()
    tolerance = 2 ** -9 if fmt.name in ("int8", "q4") else 2 ** -12
    for q_scale in (1.0, 8.0):
        q = (torch.randn(batch, heads, head_dim) * q_scale).to(dtype)
        out = torch.empty(batch, heads * head_dim, dtype=dtype)
        paged_attention(q, cache, tables, lens, head_dim ** -0.5, None, out, kv_format=fmt)
        expected = reference(q, dequantized, tables, lens, head_dim ** -0.5, None)
        beyond = (out.double() - expected).abs() - half_ulp(expected, dtype)
        assert beyond.max().item() <= tolerance * expected.abs().max().item(), (q_scale, beyond.max().item())


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_a_quantized_rows_result_does_not_depend_on_the_batch(kernels, fmt):
    """Each row alone and the same rows in one call (two threads): the same bits, in every format's SIMD path."""
    torch.manual_seed(4)
    cache, _ = quantized_cache(fmt, 3, 60, 16, 64)
    lens = torch.tensor([300, 1, 77, 512, 129], dtype=torch.int32)
    tables = torch.stack([torch.randperm(60)[:40] for _ in range(len(lens))]).int()
    q = torch.randn(len(lens), 9, 64).bfloat16()
    together = torch.empty(len(lens), 9 * 64, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        paged_attention(q, cache, tables, lens, 0.125, None, together, kv_format=fmt)
    finally:
        torch.set_num_threads(threads)
    for r in range(len(lens)):
        alone = torch.empty(1, 9 * 64, dtype=torch.bfloat16)
        paged_attention(q[r:r + 1], cache, tables[r:r + 1].contiguous(), lens[r:r + 1], 0.125, None, alone,
                        kv_format=fmt)
        assert torch.equal(alone[0], together[r]), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["q4", "int8"])
def test_the_store_kernel_rotates_as_the_attention_layers_torch_rotation(kernels, name, dtype):
    """store_kv(rotate=True) writes the bytes of the attention layer's torch rotation (layers/attention.py
    _rotated: times the Hadamard matrix in fp32, rounded to k's dtype) stored without it. Values of a few bits make
    every sum exact in fp32, so the fast transform and the matmul agree bit for bit (their rounding to bf16 then too);
    a format that does not rotate (int8) may still be asked to."""
    from kvforge.core.layers.attention import _rotated

    fmt = KV_FORMATS[name]
    torch.manual_seed(5)
    tokens, kv_heads, head_dim, slots = 7, 3, 64, 32
    k, v = (torch.randint(-64, 64, (2, tokens, kv_heads, head_dim)) / 16).to(dtype).unbind(0)
    chosen, rows = scattered_rows(tokens, kv_heads, slots)
    fused = torch.zeros(2, kv_heads, slots // 16, 16, fmt.row_bytes(head_dim), dtype=torch.uint8)
    store_kv(k, v, fused, rows, fmt, rotate=True)
    rotated = torch.zeros_like(fused)
    store_kv(_rotated(k), _rotated(v), rotated, rows, fmt)
    assert torch.equal(fused, rotated)
    assert not torch.equal(fused, torch.zeros_like(fused))
    with pytest.raises(ValueError, match="power-of-two head_dim, not 96"):
        store_kv(k[..., :48].repeat(1, 1, 2), v[..., :48].repeat(1, 1, 2),
                 torch.zeros(2, kv_heads, 2, 16, fmt.row_bytes(96), dtype=torch.uint8), rows, fmt, rotate=True)


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 256)])
def test_paged_attention_rotates_q_and_the_output_itself(kernels, heads, kv_heads, head_dim, dtype, portable):
    """On a q4 pool (rows of rotated K / V), paged_attention(rotate=True) takes the model's q and gives the model's
    output: what the attention layer computes by rotating q (H^-1, rounded to q's dtype), attending, and rotating
    the output back in torch. The kernel rotates the output before its one rounding where torch rounds twice: within
    an ulp of the largest output in bf16, 1e-6 of it in fp32."""
    from kvforge.core.layers.attention import _rotated

    fmt = KV_FORMATS["q4"]
    block, num_blocks, batch = 16, 40, 4
    cache, _ = quantized_cache(fmt, kv_heads, num_blocks, block, head_dim, seed=6)
    lens = torch.tensor([1, 0, 95, 300], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks)[:20] for _ in range(batch)]).int()
    q = torch.randn(batch, heads, head_dim).to(dtype)
    fused = torch.empty(batch, heads * head_dim, dtype=dtype)
    paged_attention(q, cache, tables, lens, head_dim ** -0.5, None, fused, portable=portable, kv_format=fmt,
                    rotate=True)
    rotated = torch.empty_like(fused)
    paged_attention(_rotated(q, inverse=True), cache, tables, lens, head_dim ** -0.5, None, rotated,
                    portable=portable, kv_format=fmt)
    expected = _rotated(rotated.view(batch, heads, head_dim).float(), inverse=True).view(batch, -1)
    largest = expected.abs().max().item()
    error = (fused.float() - expected).abs().max().item()
    assert error <= (1e-6 if dtype == torch.float32 else 2 ** -7) * largest, error
    assert fused[1].abs().max().item() == 0  # a padding row stays zero
