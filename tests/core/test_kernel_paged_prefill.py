"""The Triton paged prefill attention kernel against a plain torch reference.

Without CUDA the kernel runs under the Triton interpreter: a module-scoped fixture sets TRITON_INTERPRET=1
for this module's tests only and restores it afterwards (the kernel is jitted at its first launch, so the
setting then decides). Shapes are small: the interpreter runs each tile op in numpy.

Every case fills the cache with garbage first (keys 1e4, values NaN) and writes only the sequences' real
tokens, and points padding block-table columns at such garbage blocks. A kernel that lets a key past a
query's causal limit count gets outputs near 1e4; one that merely loads a value slot past the limit (even
with probability 0) gets NaN, since 0 * NaN is NaN.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvforge.core.kernels.paged_prefill import paged_prefill_attention
from kvforge.core.kv.quant import KV_FORMATS

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
GARBAGE = 1e4


pytestmark = pytest.mark.usefixtures("triton_kernels")  # compiled on a GPU, else interpreted


def _case(chunks, heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=0,
          pad_cols=2, spare_blocks=3):
    """Inputs for sequences `chunks` = [(new tokens, context_len), ...], with shuffled block ids.

    Returns a dict of the kernel's arguments (scale included) plus `keys` / `values`: per sequence, the
    [kv_heads, context_len, head_dim] K and V its tokens hold (what the reference attends over).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in chunks]
    width = max(blocks_per_seq, default=0) + pad_cols
    num_blocks = sum(blocks_per_seq) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    spare = ids[sum(blocks_per_seq):]  # never written: garbage, which padding columns point at
    cache = torch.full((2, kv_heads, num_blocks, block_size, head_dim), GARBAGE)
    cache[1] = float("nan")
    tables = torch.empty(len(chunks), width, dtype=torch.int32)
    keys, values = [], []
    used = 0
    for p, ((_, ctx), nblocks) in enumerate(zip(chunks, blocks_per_seq)):
        own = ids[used:used + nblocks]
        used += nblocks
        tables[p] = torch.tensor(own + [spare[(p + c) % len(spare)] for c in range(width - nblocks)])
        kv = torch.randn(2, kv_heads, ctx, head_dim, generator=gen).to(dtype)
        for t in range(ctx):
            cache[:, :, own[t // block_size], t % block_size] = kv[:, :, t].float()
        keys.append(kv[0])
        values.append(kv[1])
    lens = [n for n, _ in chunks]
    starts = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(int(starts[-1]), heads, head_dim, generator=gen).to(dtype)
    return {
        "q": q.to(DEVICE), "kv_cache": cache.to(dtype).to(DEVICE), "block_tables": tables.to(DEVICE),
        "query_start_loc": starts.to(DEVICE),
        "context_lens": torch.tensor([ctx for _, ctx in chunks], dtype=torch.int32).to(DEVICE),
        "max_query_len": max(lens, default=0), "scale": head_dim ** -0.5,
        "keys": keys, "values": values,
    }


def _reference(case, sliding_window=None, softcap=None, key_limits=None) -> torch.Tensor:
    """fp64 attention, one sequence at a time: causal from each query's position (or up to its `key_limits` entry),
    within the window counted back from its position (scores soft-capped first where `softcap` is given)."""
    q = case["q"].cpu().double()
    heads = q.shape[1]
    out = torch.zeros_like(q)
    starts = case["query_start_loc"].tolist()
    for p, (keys, values) in enumerate(zip(case["keys"], case["values"])):
        start, end = starts[p], starts[p + 1]
        n, ctx = end - start, keys.shape[1]
        group = heads // keys.shape[0]
        k = keys.double().repeat_interleave(group, 0)  # [heads, ctx, head_dim]
        v = values.double().repeat_interleave(group, 0)
        qpos = torch.arange(ctx - n, ctx).unsqueeze(1)
        kpos = torch.arange(ctx).unsqueeze(0)
        visible = kpos <= (qpos if key_limits is None else key_limits[start:end].cpu().long().unsqueeze(1))
        if sliding_window is not None:
            visible &= kpos > qpos - sliding_window
        scores = q[start:end].transpose(0, 1) @ k.transpose(1, 2) * case["scale"]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = (torch.softmax(scores, -1) @ v).transpose(0, 1)
    return out


def _args(case):
    return {key: value for key, value in case.items() if key not in ("keys", "values")}


# bf16: the interpreter's fp32 -> bf16 cast truncates (up to 1 ulp = 2**-7 relative low); compiled, the
# probabilities are rounded to bf16 before p.v. Tolerances allow about 2 ulps of the output dtype.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _check(case, sliding_window=None, softcap=None, **kwargs) -> torch.Tensor:
    out = paged_prefill_attention(**_args(case), sliding_window=sliding_window, softcap=softcap, **kwargs)
    q = case["q"]
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    ref = _reference(case, sliding_window, softcap, kwargs.get("key_limits"))
    atol, rtol = TOL[q.dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)
    return out


# (heads, kv_heads, head_dim, block_size): GQA groups 1, 3 and 4, head dims 64 / 80 / 24, block sizes 16 / 5
SHAPES = [
    pytest.param(2, 2, 64, 16, id="g1-d64-bs16"),
    pytest.param(3, 1, 80, 5, id="g3-d80-bs5"),
    pytest.param(4, 1, 24, 16, id="g4-d24-bs16"),
    pytest.param(6, 2, 64, 5, id="g3-d64-bs5"),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_fresh_prompts(heads, kv_heads, head_dim, block_size):
    """Nothing cached (context_len == n): lengths 1, BS - 1, BS, BS + 1 and one crossing BLOCK_M = 16 rows."""
    lens = [1, block_size - 1, block_size, block_size + 1, 19]
    case = _case([(n, n) for n in lens], heads, kv_heads, head_dim, block_size)
    _check(case)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_chunks_after_cached_prefix(heads, kv_heads, head_dim, block_size):
    """Chunks after a cached prefix, mixed with a fresh prompt and one new token after a long prefix."""
    case = _case([(7, 23), (1, 70), (block_size + 1, 2 * block_size + 3), (5, 5)], heads, kv_heads, head_dim,
                 block_size, seed=1)
    _check(case)


@pytest.mark.parametrize("window", [None, 7])
def test_soft_capping(window):
    """Gemma 2's attention-logit soft-capping (a cap of 0.5 bends every score), fresh and after a cached prefix."""
    case = _case([(7, 23), (1, 70), (19, 19)], 6, 2, 64, 5, seed=3)
    capped = _check(case, sliding_window=window, softcap=0.5)
    assert not torch.allclose(capped, paged_prefill_attention(**_args(case), sliding_window=window), atol=1e-3)


@pytest.mark.parametrize("window", [None, 7])
def test_rows_that_see_past_their_own_position(window):
    """An image's tokens attending to the whole image (Gemma 3): rows with key limits past their position, in a fresh
    chunk and in a chunk whose image began in the cached prefix, across 16-row tiles; the window still counts back
    from each row's own position."""
    case = _case([(40, 40), (20, 50)], heads=4, kv_heads=2, head_dim=32)
    positions = list(range(40)) + list(range(30, 50))
    limits = [25 if 10 <= p <= 25 else p for p in positions[:40]] + [40 if p <= 40 else p for p in positions[40:]]
    key_limits = torch.tensor(limits, dtype=torch.int32, device=DEVICE)
    out = _check(case, sliding_window=window, key_limits=key_limits, block_m=16, block_n=16)
    assert not torch.allclose(out, paged_prefill_attention(**_args(case), sliding_window=window), atol=1e-3)


def test_single_token_after_long_prefix():
    """n = 1 after 150 cached tokens (several key tiles, garbage in the rest of the last block)."""
    case = _case([(1, 150)], heads=8, kv_heads=2, head_dim=64, block_size=16, seed=2)
    _check(case)


def test_small_tiles_split_token_groups():
    """BLOCK_M = BLOCK_N = 16 with G = 3: M tiles start mid-token (16 % 3 != 0), many key tiles per program,
    and a window whose start moves inside a tile."""
    case = _case([(13, 13), (11, 40), (3, 29)], heads=6, kv_heads=2, head_dim=32, block_size=5, seed=3)
    _check(case, block_m=16, block_n=16)
    _check(case, sliding_window=9, block_m=16, block_n=16)


def test_window_leaves_rows_without_keys_in_a_tile():
    """64 query rows, 16-key tiles, window 3: for later rows the first key tiles hold no visible key (the
    online softmax must not turn their running max of -inf into NaN)."""
    case = _case([(40, 40), (30, 45)], heads=1, kv_heads=1, head_dim=16, block_size=5, seed=10)
    _check(case, sliding_window=3, block_m=64, block_n=16)


def test_empty_chunk_among_others():
    """A sequence with no query rows this step (query_start_loc repeats) is skipped."""
    case = _case([(4, 9), (0, 6), (3, 3)], heads=2, kv_heads=1, head_dim=16, block_size=4, seed=4)
    _check(case)


@pytest.mark.parametrize("window", [1, 4, 7, 16])
@pytest.mark.parametrize("block_size", [5, 16])
def test_sliding_window(window, block_size):
    """Windows smaller than the context, crossing block boundaries; fresh prompt and cached prefixes."""
    case = _case([(12, 12), (6, 40), (1, 33)], heads=4, kv_heads=2, head_dim=32, block_size=block_size,
                 seed=5 + window)
    _check(case, sliding_window=window)


def test_window_larger_than_context_is_plain_causal():
    case = _case([(9, 20), (5, 5)], heads=2, kv_heads=1, head_dim=32, block_size=5, seed=6)
    plain = paged_prefill_attention(**_args(case))
    torch.testing.assert_close(_check(case, sliding_window=64), plain, atol=0, rtol=0)


def test_out_given_and_strided_views():
    """q, out and kv_cache as non-contiguous views (q and out inside wider tensors, the cache one layer
    of a pool with head_dim padded): out is written in place and returned."""
    case = _case([(6, 14), (9, 9)], heads=4, kv_heads=2, head_dim=24, block_size=5, seed=7)
    tokens, heads, d = case["q"].shape
    q_wide = torch.randn(heads, tokens, d + 8, device=DEVICE)
    q_wide[..., :d] = case["q"].transpose(0, 1)
    pool = torch.full((3, *case["kv_cache"].shape[:-1], d + 4), float("nan"), device=DEVICE)  # NaN if read
    pool[1, ..., :d] = case["kv_cache"]
    strided = {**case, "q": q_wide.transpose(0, 1)[..., :d], "kv_cache": pool[1, ..., :d]}
    assert not strided["q"].is_contiguous() and not strided["kv_cache"].is_contiguous()
    out_wide = torch.full((tokens, heads, d + 3), -7.0, device=DEVICE)
    out = out_wide[..., :d]
    returned = _check(strided, out=out)
    assert returned is out
    torch.testing.assert_close(out, _reference(case).float().to(DEVICE), atol=1e-5, rtol=1e-5)
    assert bool((out_wide[..., d:] == -7.0).all())  # nothing written beside the view


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_half_precision(dtype):
    case = _case([(7, 23), (17, 17), (1, 40)], heads=6, kv_heads=2, head_dim=64, block_size=5, dtype=dtype,
                 seed=8)
    _check(case)
    _check(case, sliding_window=6)


def test_causal_dependence_on_cached_key():
    """Changing the key at position k changes exactly the queries at positions >= k (bit-identical rows before)."""
    n, ctx, changed = 12, 20, 13  # queries sit at positions 8..19; position 13 is query row 5
    case = _case([(n, ctx)], heads=2, kv_heads=1, head_dim=32, block_size=5, seed=9)
    before = paged_prefill_attention(**_args(case))
    block = int(case["block_tables"][0, changed // 5])
    case["kv_cache"][0, :, block, changed % 5] += 3.0
    after = paged_prefill_attention(**_args(case))
    row = changed - (ctx - n)
    assert torch.equal(before[:row], after[:row])
    assert bool(((before[row:] - after[row:]).abs().amax(dim=(1, 2)) > 1e-4).all())


def test_nothing_to_do():
    case = _case([(0, 5)], heads=2, kv_heads=1, head_dim=16, block_size=4)
    out = paged_prefill_attention(**_args(case))
    assert out.shape == (0, 2, 16)


# ---------------------------------------------------------------- a quantized cache


FORMATS = list(KV_FORMATS.values())
FORMAT_IDS = list(KV_FORMATS)


def _quantized(case, fmt) -> dict:
    """The case with its cache quantized by KVFormat.quantize into a uint8 pool (a strided view: rows padded by 3
    bytes), and its keys / values dequantized by KVFormat.dequantize (fp32): what the kernel must attend over. The
    garbage is quantized too: keys of 1e4, and values whose NaN scales dequantize to NaN."""
    rows = fmt.quantize(case["kv_cache"].cpu())
    pool = torch.zeros(*rows.shape[:-1], rows.shape[-1] + 3, dtype=torch.uint8)
    pool[..., :rows.shape[-1]] = rows
    head_dim = case["q"].shape[-1]

    stored = [fmt.dequantize(fmt.quantize(torch.stack(kv)), head_dim) for kv in zip(case["keys"], case["values"])]
    return {**case, "kv_cache": pool.to(DEVICE)[..., :rows.shape[-1]], "keys": [kv[0] for kv in stored],
            "values": [kv[1] for kv in stored]}


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_quantized_cache_reads_as_its_dequantized_values(fmt):
    """GQA (3 query heads a KV head), blocks of 5 over scattered tables: chunks after a cached prefix, a fresh
    prompt and one token after a long prefix; then a sliding window with soft-capping, 16 x 16 tiles, and a bf16
    query (the cache is the same bytes whatever q's dtype)."""
    case = _quantized(_case([(7, 23), (1, 70), (19, 19), (6, 13)], 6, 2, 64, 5, seed=11), fmt)
    _check(case, kv_format=fmt)
    _check(case, sliding_window=7, softcap=0.5, kv_format=fmt, block_m=16, block_n=16)
    _check({**case, "q": case["q"].bfloat16()}, kv_format=fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_quantized_cache_other_shapes(fmt):
    """Head_dim 32 (q4: a single group) with 16-token blocks and a group of 4; the 8-bit formats at head_dim 24 too
    (a padded tile)."""
    for head_dim in (32,) if fmt.group else (32, 24):
        case = _quantized(_case([(12, 12), (5, 40)], 4, 1, head_dim, 16, seed=head_dim), fmt)
        _check(case, sliding_window=9, kv_format=fmt)


def test_quantized_cache_and_format_must_match():
    """Each mismatch names the cache and the format: a uint8 cache without a format, a format with a float cache,
    rows of the wrong size, a format no kernel reads, q4 at a head_dim that is no multiple of 32."""
    case = _case([(2, 5), (3, 3)], heads=4, kv_heads=2, head_dim=32, block_size=4)
    args = _args(case)
    int8, q4 = KV_FORMATS["int8"], KV_FORMATS["q4"]
    rows = int8.quantize(args["kv_cache"].cpu()).to(DEVICE)
    for change, message in (
        ({"kv_cache": rows}, "kv_cache is uint8 .* kv_format is None"),
        ({"kv_format": q4}, "kv_format q4 stores uint8 rows, but kv_cache is torch.float32"),
        ({"kv_cache": rows[..., :33], "kv_format": int8},
         "kv_format int8 stores rows of 34 bytes at head_dim 32, but kv_cache rows have 33"),
        ({"kv_cache": rows, "kv_format": replace(q4, group=16)}, "the kernels read no KV format .*group=16"),
        ({"q": args["q"][..., :16], "kv_cache": rows[..., :10], "kv_format": q4},
         "q4 KV stores groups of 32 values; the model.s head_dim 16 is not a multiple"),
    ):
        with pytest.raises(ValueError, match=f"paged_prefill_attention: {message}"):
            paged_prefill_attention(**{**args, **change})


def _bad(name: str, **change):
    return pytest.param(change, id=name)


@pytest.mark.parametrize("change", [
    _bad("q-2d", q=torch.randn(5, 64)),
    _bad("cache-4d", kv_cache=torch.randn(2, 2, 3, 64)),
    _bad("cache-not-kv", kv_cache=torch.randn(3, 2, 3, 4, 64)),
    _bad("head-dim-differs", kv_cache=torch.randn(2, 2, 3, 4, 32)),
    _bad("heads-not-multiple", kv_cache=torch.randn(2, 3, 3, 4, 64)),
    _bad("q-int", q=torch.ones(5, 4, 64, dtype=torch.int32)),
    _bad("dtype-differs", kv_cache=torch.randn(2, 2, 3, 4, 64, dtype=torch.float16)),
    _bad("block-tables-int64", block_tables=torch.zeros(2, 3, dtype=torch.int64)),
    _bad("block-tables-1d", block_tables=torch.zeros(3, dtype=torch.int32)),
    _bad("query-start-loc-int64", query_start_loc=torch.tensor([0, 2, 5])),
    _bad("query-start-loc-length", query_start_loc=torch.tensor([0, 5], dtype=torch.int32)),
    _bad("context-lens-length", context_lens=torch.tensor([4], dtype=torch.int32)),
    _bad("context-lens-float", context_lens=torch.tensor([4.0, 5.0])),
    _bad("window-zero", sliding_window=0),
    _bad("out-shape", out=torch.empty(5, 4, 32)),
    _bad("out-dtype", out=torch.empty(5, 4, 64, dtype=torch.float16)),
    _bad("block-m-small", block_m=8),
    _bad("block-n-not-pow2", block_n=48),
])
def test_bad_inputs(change):
    args = {
        "q": torch.randn(5, 4, 64), "kv_cache": torch.randn(2, 2, 3, 4, 64),
        "block_tables": torch.zeros(2, 3, dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 2, 5], dtype=torch.int32),
        "context_lens": torch.tensor([4, 5], dtype=torch.int32), "max_query_len": 3, "scale": 0.125,
    }
    args.update(change)
    args = {key: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for key, value in args.items()}
    with pytest.raises(ValueError):
        paged_prefill_attention(**args)


@pytest.mark.skipif(ON_CUDA, reason="checks the CPU path without the interpreter")
def test_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = _case([(2, 2)], heads=2, kv_heads=1, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="CUDA"):
        paged_prefill_attention(**_args(case))
