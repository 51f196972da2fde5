"""The Triton paged decode attention kernel against a plain torch reference.

Without CUDA the kernels run under the Triton interpreter: a module-scoped fixture sets TRITON_INTERPRET=1
for this module's tests only (the kernels are jitted at their first call, see core/kernels/runtime.py).
Every case builds its cache as a strided view into a bigger pool, with shuffled block ids, a query that is
a strided view of a packed qkv tensor, garbage (1e4) in the slots past each sequence's length and in the
spare blocks, and spare block table columns pointing at garbage or other sequences' blocks: reading
anything a sequence should not see would show in the output.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvforge.core.kernels import paged_decode
from kvforge.core.kernels.paged_decode import default_num_splits, paged_decode_attention
from kvforge.core.kernels.runtime import fp32_dots
from kvforge.core.kv.quant import KV_FORMATS

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
GARBAGE = 1e4


pytestmark = pytest.mark.usefixtures("triton_kernels")  # compiled on a GPU, else interpreted


def _case(lengths, kv_heads: int, group: int, head_dim: int, block_size: int, dtype=torch.float32, *,
          spare_cols: int = 2, seed: int = 0) -> dict:
    """Arguments for paged_decode_attention (scale excepted), on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads = len(lengths), kv_heads * group
    used = [-(-length // block_size) for length in lengths]
    spare_blocks = 3
    num_blocks = sum(used) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)  # blocks not in order in the pool
    # two layers, head_dim padded by 3: the layer's cache is a non-contiguous view into the pool
    pool = torch.randn(2, 2, kv_heads, num_blocks, block_size, head_dim + 3, generator=gen).to(dtype)
    cache = pool[1, ..., :head_dim]
    cache[:, :, ids[sum(used):].long()] = GARBAGE
    tables = torch.randint(0, num_blocks, (batch, max(used, default=0) + spare_cols), generator=gen,
                           dtype=torch.int32)  # spare columns: garbage blocks or other sequences' blocks
    first = 0
    for b, (length, n) in enumerate(zip(lengths, used)):
        tables[b, :n] = ids[first:first + n]
        first += n
        if length % block_size:
            cache[:, :, tables[b, n - 1].item(), length % block_size:] = GARBAGE  # slots past L
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    return {"q": qkv[:, :heads * head_dim].view(batch, heads, head_dim),  # row stride of the packed qkv
            "kv_cache": pool.to(DEVICE)[1, ..., :head_dim], "block_tables": tables.to(DEVICE),
            "context_lens": torch.tensor(lengths, dtype=torch.int32, device=DEVICE)}


def _reference(q, kv_cache, block_tables, context_lens, scale, sliding_window=None, softcap=None,
               abs_values: bool = False) -> torch.Tensor:
    """fp64 [B, H, D]: gather each sequence's keys through its block table, softmax over the visible ones
    (scores soft-capped first where `softcap` is given). `abs_values`: sum p * |v| instead (an error bound's
    scale)."""
    q, cache, tables = q.cpu().double(), kv_cache.cpu().double(), block_tables.cpu().long()
    batch, heads, head_dim = q.shape
    kv_heads, block_size = cache.shape[1], cache.shape[3]
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float64)
    for b, length in enumerate(context_lens.tolist()):
        low = 0 if sliding_window is None else max(0, length - sliding_window)
        pos = torch.arange(low, length)
        if not len(pos):
            continue
        blocks, slots = tables[b, pos // block_size], pos % block_size
        keys = cache[0][:, blocks, slots].repeat_interleave(heads // kv_heads, 0)  # [H, n, D]
        values = cache[1][:, blocks, slots].repeat_interleave(heads // kv_heads, 0)
        if abs_values:
            values = values.abs()
        scores = torch.einsum("hd,hnd->hn", q[b], keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,hnd->hd", probs, values)
    return out


def _check(args: dict, scale: float, rtol: float = 1e-5, atol: float = 1e-5, **kwargs) -> torch.Tensor:
    y = paged_decode_attention(**args, scale=scale, **kwargs)
    q = args["q"]
    assert y.shape == q.shape and y.dtype == q.dtype and y.device == q.device
    ref = _reference(**args, scale=scale, sliding_window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"))
    torch.testing.assert_close(y.cpu().double(), ref, rtol=rtol, atol=atol)
    return y


@pytest.mark.parametrize("num_splits", (1, None))
@pytest.mark.parametrize(("kv_heads", "group", "head_dim", "block_size", "lengths"), [
    pytest.param(2, 1, 64, 16, (15, 16, 17, 32, 1, 40), id="g1-d64-bs16"),
    pytest.param(2, 3, 80, 5, (4, 5, 6, 10, 23), id="g3-d80-bs5"),
    pytest.param(1, 4, 64, 8, (7, 8, 9, 16, 33), id="g4-d64-bs8"),
    pytest.param(1, 8, 24, 16, (31, 1, 50), id="g8-d24-bs16"),
    pytest.param(3, 2, 32, 1, (1, 3, 9), id="g2-d32-bs1"),
    pytest.param(1, 2, 256, 16, (17, 40), id="g2-d256-bs16"),  # head_dim 256 takes 16-key tiles
])
def test_matches_reference_fp32(kv_heads, group, head_dim, block_size, lengths, num_splits):
    args = _case(lengths, kv_heads, group, head_dim, block_size)
    _check(args, 2.0 / math.sqrt(head_dim), num_splits=num_splits)  # 2x the usual scale: peakier softmax


@pytest.mark.parametrize("num_splits", (1, 3))
def test_soft_capping(num_splits):
    """Gemma 2's attention-logit soft-capping, with a cap small enough to bend every score, in a window too."""
    args = _case((1, 9, 16, 17, 30, 45), 2, 3, 32, 8)
    capped = _check(args, 2.0, softcap=1.5, num_splits=num_splits)
    _check(args, 2.0, softcap=1.5, sliding_window=13, num_splits=num_splits)
    assert not torch.allclose(capped, paged_decode_attention(**args, scale=2.0, num_splits=num_splits), atol=1e-3)


def test_num_splits_agree():
    """More splits than some sequences have blocks (64 > 6): the empty splits contribute nothing."""
    args = _case((3, 20, 41, 8), 2, 2, 32, 8)
    outputs = [_check(args, 0.3, num_splits=s) for s in (1, 2, 3, 7, 64)]
    for y in outputs[1:]:
        torch.testing.assert_close(y, outputs[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_splits", (1, 3))
@pytest.mark.parametrize("window", (1, 7, 8, 13, 100))  # 7 and 13 cross block boundaries, 8 aligns, 100 > L
def test_sliding_window(window, num_splits):
    args = _case((1, 9, 16, 17, 30, 45), 1, 3, 32, 8)
    _check(args, 0.3, sliding_window=window, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", (1, 3))
def test_zero_length_rows_are_zero(num_splits):
    args = _case((0, 17, 0, 5), 2, 2, 32, 8)
    y = _check(args, 0.3, num_splits=num_splits)
    assert torch.equal(y[0::2].cpu(), torch.zeros(2, 4, 32))  # exactly 0, no NaN
    y = _check(args, 0.3, num_splits=num_splits, sliding_window=4)
    assert torch.equal(y[0::2].cpu(), torch.zeros(2, 4, 32))
    everything_padding = _case((0, 0), 1, 2, 16, 4)
    y = paged_decode_attention(**everything_padding, scale=0.3, num_splits=num_splits)
    assert torch.equal(y.cpu(), torch.zeros(2, 2, 16))


@pytest.mark.parametrize("num_splits", (1, 3))
def test_out_is_written_in_place(num_splits):
    args = _case((5, 19, 12), 2, 2, 32, 8)
    big = torch.full((3, 4, 40), float("nan"), device=DEVICE)
    out = big[..., :32]  # a strided destination, filled with NaN beforehand
    y = paged_decode_attention(**args, scale=0.3, num_splits=num_splits, out=out)
    assert y is out
    torch.testing.assert_close(out.cpu().double(), _reference(**args, scale=0.3), rtol=1e-5, atol=1e-5)
    assert bool(big[..., 32:].isnan().all())  # nothing written outside out


# fp32 math on the rounded inputs, then one rounding to the output dtype: <= 1 ulp <= 2**-7 |y| for bf16
# (the interpreter's cast truncates), half an ulp for fp16; tolerances allow twice that. Compiled (on a GPU),
# p is rounded to v's dtype for the tensor-core p . v dot, as flash-attention does: each term p_i v_i is off by
# up to one unit roundoff u of p_i (2**-9 bf16, 2**-11 fp16), so |error| grows by up to u * sum p_i |v_i|
# (seen on an H200: 1.4e-3 in bf16, 2.3e-4 in fp16, against 1e-4 without that term); twice that is allowed.
@pytest.mark.parametrize("num_splits", (1, 3))
@pytest.mark.parametrize(("dtype", "rtol", "p_roundoff"), [(torch.float16, 2.0**-10, 2.0**-11),
                                                           (torch.bfloat16, 2.0**-6, 2.0**-9)], ids=("fp16", "bf16"))
def test_half_precision(dtype, rtol, p_roundoff, num_splits):
    args = _case((3, 16, 21, 40), 2, 3, 64, 8, dtype=dtype)
    y = paged_decode_attention(**args, scale=0.125, num_splits=num_splits).cpu().double()
    ref = _reference(**args, scale=0.125)
    bound = rtol * ref.abs() + 1e-4
    if not fp32_dots(dtype):  # compiled: p . v on tensor cores in the input dtype
        bound += 2 * p_roundoff * _reference(**args, scale=0.125, abs_values=True)
    excess = (y - ref).abs() - bound
    assert float(excess.max()) <= 0, f"{int((excess > 0).sum())} elements off by up to {float(excess.max()):.2e}"


def test_output_depends_on_the_keys_it_sees():
    args = _case((10, 20), 2, 2, 32, 8)
    cache, tables = args["kv_cache"], args["block_tables"].cpu()

    def run(**kwargs):
        return paged_decode_attention(**args, scale=0.3, num_splits=2, **kwargs).cpu()

    def slot(b, pos):
        return int(tables[b, pos // 8]), pos % 8

    base = run()
    for kv in (0, 1):  # a visible key, then a visible value, of sequence 1, KV head 1: only heads 2, 3 change
        cache[kv, 1, slot(1, 13)[0], slot(1, 13)[1], 5] += 1.0
        changed = run()
        assert not torch.equal(changed[1, 2:], base[1, 2:])
        assert torch.equal(changed[0], base[0]) and torch.equal(changed[1, :2], base[1, :2])
        base = changed
    windowed = run(sliding_window=5)
    cache[:, :, slot(0, 12)[0], slot(0, 12)[1]] = -GARBAGE  # past sequence 0's length (10)
    cache[:, :, slot(1, 3)[0], slot(1, 3)[1]] = -GARBAGE  # outside sequence 1's window of 5 (keys 15..19)
    assert torch.equal(run(sliding_window=5), windowed)
    assert torch.equal(run()[0], base[0])


# ---------------------------------------------------------------- a quantized cache


FORMATS = list(KV_FORMATS.values())
FORMAT_IDS = list(KV_FORMATS)


def _quantized(args: dict, fmt) -> tuple[dict, dict]:
    """(the kernel's arguments, the reference's): the case's cache quantized by KVFormat.quantize into a uint8 pool
    (a strided view: rows padded by 3 bytes, a layer of two; the garbage rows quantized too), and the same cache
    dequantized by KVFormat.dequantize in fp32, which the kernel must attend over."""
    cache = args["kv_cache"]
    rows = fmt.quantize(cache.cpu())
    pool = torch.zeros(2, *rows.shape[:-1], rows.shape[-1] + 3, dtype=torch.uint8)
    pool[1, ..., :rows.shape[-1]] = rows
    quantized = pool.to(DEVICE)[1, ..., :rows.shape[-1]]
    assert not quantized.is_contiguous()
    return ({**args, "kv_cache": quantized, "kv_format": fmt},
            {**args, "kv_cache": fmt.dequantize(rows, cache.shape[-1]).to(DEVICE)})


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_quantized_cache_reads_as_its_dequantized_values(fmt):
    """GQA (3 query heads a KV head), head_dim 64, blocks of 5, six lengths over scattered blocks with garbage past
    them: one split and three, a sliding window with soft-capping, and a bf16 query (fp32 dequantization, q's
    dtype out)."""
    args, ref = _quantized(_case((1, 9, 16, 17, 30, 45), 2, 3, 64, 5), fmt)
    for kwargs in ({"num_splits": 1}, {"num_splits": 3, "sliding_window": 13, "softcap": 1.5}):
        y = paged_decode_attention(**args, scale=0.3, **kwargs)
        assert y.shape == args["q"].shape and y.dtype == torch.float32
        expected = _reference(**ref, scale=0.3, sliding_window=kwargs.get("sliding_window"),
                              softcap=kwargs.get("softcap"))
        torch.testing.assert_close(y.cpu().double(), expected, rtol=1e-5, atol=1e-5)
    q = args["q"].bfloat16()
    y = paged_decode_attention(**{**args, "q": q}, scale=0.3)
    assert y.dtype == torch.bfloat16
    expected = _reference(**{**ref, "q": q}, scale=0.3)
    if fp32_dots(torch.bfloat16):  # fp32 dots on the dequantized values: one rounding of the output to bf16
        torch.testing.assert_close(y.cpu().double(), expected, rtol=2.0**-6, atol=1e-4)
    else:  # compiled: K and V rounded to bf16 for the tensor cores, p too (as test_half_precision allows)
        torch.testing.assert_close(y.cpu().double(), expected, rtol=2.0**-5, atol=2e-2)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_quantized_cache_head_dim_of_other_sizes(fmt):
    """A query group of 8 at head_dim 32 (q4: one group a row) and 16-token blocks; 8-bit formats at head_dim 24
    too (a padded tile). Lengths of 1 and 0 (padding: exactly 0)."""
    for head_dim in (32,) if fmt.group else (32, 24):
        args, ref = _quantized(_case((31, 1, 0, 50), 1, 8, head_dim, 16, seed=head_dim), fmt)
        y = paged_decode_attention(**args, scale=0.4, num_splits=2)
        torch.testing.assert_close(y.cpu().double(), _reference(**ref, scale=0.4), rtol=1e-5, atol=1e-5)
        assert torch.equal(y[2].cpu(), torch.zeros(8, head_dim))


def test_quantized_cache_and_format_must_match():
    """Each mismatch names the cache and the format: a uint8 cache without a format, a format with a float cache,
    rows of the wrong size, a format no kernel reads, q4 at a head_dim that is no multiple of 32."""
    args = {**_case((3, 6), 2, 2, 32, 4), "scale": 0.25}
    int8 = KV_FORMATS["int8"]
    rows = int8.quantize(args["kv_cache"].cpu()).to(DEVICE)
    for change, message in (
        ({"kv_cache": rows}, "kv_cache is uint8 .* kv_format is None"),
        ({"kv_format": int8}, "kv_format int8 stores uint8 rows, but kv_cache is torch.float32"),
        ({"kv_cache": rows[..., :33], "kv_format": int8},
         "kv_format int8 stores rows of 34 bytes at head_dim 32, but kv_cache rows have 33"),
        ({"kv_cache": rows, "kv_format": KV_FORMATS["q4"]}, "kv_format q4 stores rows of 20 bytes .* rows have 34"),
        ({"kv_cache": rows, "kv_format": replace(int8, code=9)}, "the kernels read no KV format .*code=9"),
        ({"q": args["q"][..., :24], "kv_cache": rows[..., :14], "kv_format": KV_FORMATS["q4"]},
         "q4 KV stores groups of 32 values; the model.s head_dim 24 is not a multiple"),
    ):
        with pytest.raises(ValueError, match=f"paged_decode_attention: {message}"):
            paged_decode_attention(**{**args, **change})


def test_empty_batch():
    args = _case((), 2, 2, 16, 4)
    assert paged_decode_attention(**args, scale=0.3).shape == (0, 4, 16)


def _bad(name: str, change):
    return pytest.param(change, id=name)


@pytest.mark.parametrize("change", [
    _bad("heads-not-multiple", lambda a: a.update(q=torch.randn(2, 5, 16, device=DEVICE))),
    _bad("q-2d", lambda a: a.update(q=a["q"][:, 0])),
    _bad("q-int", lambda a: a.update(q=a["q"].to(torch.int32))),
    _bad("q-other-dtype", lambda a: a.update(q=a["q"].half())),
    _bad("head-dim", lambda a: a.update(q=torch.randn(2, 4, 8, device=DEVICE))),
    _bad("cache-4d", lambda a: a.update(kv_cache=a["kv_cache"][0])),
    _bad("cache-not-k-v", lambda a: a.update(kv_cache=torch.cat([a["kv_cache"]] * 2)[:3])),
    _bad("block-tables-int64", lambda a: a.update(block_tables=a["block_tables"].long())),
    _bad("block-tables-batch", lambda a: a.update(block_tables=a["block_tables"][:1])),
    _bad("context-lens-int64", lambda a: a.update(context_lens=a["context_lens"].long())),
    _bad("context-lens-batch", lambda a: a.update(context_lens=a["context_lens"][:1])),
    _bad("window-0", lambda a: a.update(sliding_window=0)),
    _bad("splits-0", lambda a: a.update(num_splits=0)),
    _bad("out-dtype", lambda a: a.update(out=torch.empty(2, 4, 16, dtype=torch.float16, device=DEVICE))),
    _bad("out-shape", lambda a: a.update(out=torch.empty(2, 4, 17, device=DEVICE))),
])
def test_bad_inputs(change):
    args = {**_case((3, 6), 2, 2, 16, 4), "scale": 0.25}
    change(args)
    with pytest.raises(ValueError):
        paged_decode_attention(**args)


@pytest.mark.skipif(ON_CUDA, reason="checks the CPU path without the interpreter")
def test_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        paged_decode_attention(**_case((3,), 1, 1, 16, 4), scale=0.25)


def test_default_num_splits(monkeypatch):
    cpu = torch.device("cpu")
    assert default_num_splits(1, 1, 256, 16, cpu) == paged_decode.CPU_MAX_SPLITS
    assert default_num_splits(1, 1, 4, 16, cpu) == 1  # 64 tokens at most: one split
    monkeypatch.setattr(paged_decode, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert default_num_splits(1, 8, 256, 16, cuda) == 32  # 2 * 132 / 8 programs wanted, capped at 32
    assert default_num_splits(4, 8, 256, 16, cuda) == 9  # cdiv(264, 32)
    assert default_num_splits(64, 8, 256, 16, cuda) == 1  # the batch fills the GPU
    assert default_num_splits(1, 8, 7, 16, cuda) == 2  # 112 tokens: at least 64 per split
    assert default_num_splits(1, 8, 256, 16, cuda, sliding_window=100) == 2  # 115 tokens at most
    assert default_num_splits(1, 8, 0, 16, cuda) == 1
