"""The paged decode attention C kernel (core/cpu_kernels): built here with the system compiler, checked against an
fp64 reference computed per sequence over its own visible keys, gathered from a scattered block table."""

from __future__ import annotations

import pytest
import torch

from kvforge.core.cpu_kernels import moe_combine, moe_group, paged_attention, unavailable
from tests.helpers.optional_parts import require


@pytest.fixture(autouse=True, scope="module")
def built():
    require(unavailable() is None, f"the paged C kernel cannot be built here: {unavailable()}")


def reference(q, cache, tables, lens, scale, window, softcap=None) -> torch.Tensor:
    """fp64 attention of each row over keys [max(0, L - window), L) of its blocks (scores soft-capped first where
    `softcap` is given); zeros for L == 0."""
    batch, heads, head_dim = q.shape
    kv_heads, block = cache.shape[1], cache.shape[3]
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        length = int(lens[b])
        positions = torch.arange(0 if window is None else max(0, length - window), length)
        blocks, slots = tables[b][positions // block].long(), positions % block
        for h in range(heads):
            kv = cache[:, h // (heads // kv_heads), blocks, slots].double()  # [2, n, d]
            if length:
                scores = kv[0] @ q[b, h].double() * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                out[b, h] = torch.softmax(scores, dim=0) @ kv[1]
    return out.view(batch, -1)


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block", "window", "softcap"),
                         [(9, 3, 64, 16, None, None),  # SmolLM2-135M
                          (4, 1, 256, 16, 37, None),  # Gemma 3 270M, a sliding-window layer
                          (8, 4, 256, 16, 37, 1.5),  # Gemma 2 2B's shape, soft-capped (a cap that bends every score)
                          (6, 6, 80, 5, None, None)])  # no GQA, a head size and a block size with no special case
def test_matches_an_fp64_reference(dtype, heads, kv_heads, head_dim, block, window, softcap, portable):
    torch.manual_seed(0)
    batch, num_blocks = 7, 120
    cache = torch.randn(2, kv_heads, num_blocks, block, head_dim).to(dtype)
    lens = torch.tensor([1, 0, 17, block, 95, 3 * block + 1, 160], dtype=torch.int32)  # 0: a padding row
    width = -(-int(lens.max()) // block)
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in range(batch)]).int()
    fused = torch.randn(batch, heads + 2 * kv_heads, head_dim).to(dtype)  # q as the attention gets it: strided rows
    q = fused[:, :heads]
    out = torch.full((batch, heads * head_dim), float("nan"), dtype=dtype)
    paged_attention(q, cache, tables, lens, head_dim ** -0.5, window, out, portable=portable, softcap=softcap)
    expected = reference(q, cache, tables, lens, head_dim ** -0.5, window, softcap)
    error = (out.double() - expected).abs().max().item()
    # fp32 math: fp32 rounding in fp32; one rounding to the storage type in bf16 / fp16
    assert error < {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype], error
    assert out[1].abs().max().item() == 0  # the padding row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_of_prefill_rows_equals_each_token_decoded_alone(dtype):
    """Rows of prefill chunks (each token a row, over its own sequence's blocks by row_seqs) attend as the same
    tokens decoded one at a time do, bit for bit, and as the reference."""
    torch.manual_seed(1)
    heads, kv_heads, head_dim, block, num_blocks = 9, 3, 64, 16, 40
    cache = torch.randn(2, kv_heads, num_blocks, block, head_dim).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks)[:6] for _ in range(2)]).int()  # two sequences
    chunks = [(0, 30, 37), (1, 0, 70)]  # (sequence, cached tokens, context after the chunk)
    row_seqs = torch.tensor([s for s, cached, end in chunks for _ in range(cached, end)], dtype=torch.int32)
    lens = torch.tensor([t + 1 for _, cached, end in chunks for t in range(cached, end)], dtype=torch.int32)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    together = torch.empty(len(lens), heads * head_dim, dtype=dtype)
    paged_attention(q, cache, tables, lens, 0.125, None, together, row_seqs)
    for r in range(len(lens)):
        alone = torch.empty(1, heads * head_dim, dtype=dtype)
        paged_attention(q[r:r + 1], cache, tables[row_seqs[r]:row_seqs[r] + 1].contiguous(), lens[r:r + 1], 0.125,
                        None, alone)
        assert torch.equal(alone[0], together[r]), r
    expected = reference(q, cache, tables[row_seqs.long()], lens, 0.125, None)
    assert (together.double() - expected).abs().max().item() < (2e-6 if dtype == torch.float32 else 8e-3)


def test_refuses_mixed_dtypes_and_handles_an_empty_batch():
    cache = torch.zeros(2, 1, 4, 16, 32)
    tables, lens = torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    paged_attention(torch.zeros(0, 2, 32), cache, tables, lens, 0.1, None, torch.zeros(0, 64))
    with pytest.raises(ValueError, match="must be one of float32 / bfloat16 / float16, the same"):
        paged_attention(torch.zeros(1, 2, 32, dtype=torch.bfloat16), cache, tables[:1], lens[:1], 0.1, None,
                               torch.zeros(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="int32"):
        paged_attention(torch.zeros(1, 2, 32), cache, tables.long(), lens, 0.1, None, torch.zeros(1, 64))


def test_fused_elementwise_kernels_equal_torchs_ops_bit_for_bit_in_bf16():
    """SiLU-and-mul, residual add + RMSNorm and rotary: the layers take the C kernels in bf16 on CPU, with torch's
    roundings, so their outputs equal the torch ops they replace (the same code path in fp32)."""
    import torch.nn.functional as F

    from kvforge.core.cpu_kernels import fused_elementwise_for
    from kvforge.core.layers.activation import SiluAndMul
    from kvforge.core.layers.norm import RMSNorm
    from kvforge.core.layers.rotary import apply_rotary, rotate

    torch.manual_seed(2)
    gate_up = (torch.randn(37, 2 * 160) * 4).bfloat16()
    assert fused_elementwise_for(gate_up) and not fused_elementwise_for(gate_up.float())
    assert torch.equal(SiluAndMul()(gate_up), F.silu(gate_up[:, :160]) * gate_up[:, 160:])

    norm = RMSNorm(96, 1e-5, torch.bfloat16)
    norm.weight.copy_(torch.rand(96) + 0.5)
    x, residual = torch.randn(37, 96).bfloat16(), torch.randn(37, 96).bfloat16()
    total = x + residual
    expected = norm.weight * F.rms_norm(total.float(), (96,), None, 1e-5).bfloat16()
    out, summed = norm(x, residual)
    assert torch.equal(summed, total) and torch.equal(out, expected)
    assert torch.equal(norm(x), norm.weight * F.rms_norm(x.float(), (96,), None, 1e-5).bfloat16())

    fused_qkv = torch.randn(37, 15, 64).bfloat16()  # q and k heads side by side, then v: strided rows
    cos, sin = torch.randn(37, 1, 64).bfloat16(), torch.randn(37, 1, 64).bfloat16()
    expected = apply_rotary(fused_qkv[:, :12].clone(), cos, sin)
    v = fused_qkv[:, 12:].clone()
    assert torch.equal(rotate(fused_qkv[:, :12], cos, sin), expected)
    assert torch.equal(fused_qkv[:, :12], expected) and torch.equal(fused_qkv[:, 12:], v)  # in place, v untouched


def test_fp32_rotary_equals_torchs_bit_for_bit_and_silu_norm_take_fp32_only_where_linears_are_inexact():
    """fp32: rotary takes the C kernel on every model (its products and sum round as torch's do: equal bits over
    many values, where an FMA would differ); SiLU and RMSNorm take theirs only in layers built with
    exact_fp32=False (a quant method whose linears are not the dense model's), within a few ulps of torch's."""
    import torch.nn.functional as F

    from kvforge.core.layers.activation import SiluAndMul
    from kvforge.core.layers.backend import kernel_backend
    from kvforge.core.layers.norm import RMSNorm
    from kvforge.core.layers.rotary import apply_rotary, rotate

    torch.manual_seed(3)
    fused_qkv = torch.randn(41, 15, 64) * 5
    cos, sin = torch.randn(41, 1, 64), torch.randn(41, 1, 64)
    expected = apply_rotary(fused_qkv[:, :12].clone(), cos, sin)
    v = fused_qkv[:, 12:].clone()
    assert torch.equal(rotate(fused_qkv[:, :12], cos, sin), expected)
    assert torch.equal(fused_qkv[:, :12], expected) and torch.equal(fused_qkv[:, 12:], v)

    gate_up, x, residual = torch.randn(37, 2 * 160) * 4, torch.randn(37, 96), torch.randn(37, 96)
    weight = torch.rand(96) + 0.5
    silu = F.silu(gate_up[:, :160]) * gate_up[:, 160:]
    norm_out = F.rms_norm(x + residual, (96,), weight, 1e-5)
    for exact in (True, False):
        with kernel_backend("torch", exact_fp32=exact):
            act, norm = SiluAndMul(), RMSNorm(96, 1e-5)
        norm.weight.copy_(weight)
        out, total = norm(x, residual)
        assert torch.equal(total, x + residual)
        if exact:  # torch's own ops
            assert torch.equal(act(gate_up), silu) and torch.equal(out, norm_out)
        else:  # the kernels: the exp and the sum order differ in the last bits, not more
            assert not torch.equal(act(gate_up), silu) or not torch.equal(out, norm_out)
            torch.testing.assert_close(act(gate_up), silu, rtol=2e-6, atol=1e-6)
            torch.testing.assert_close(out, norm_out, rtol=2e-6, atol=1e-6)
            torch.testing.assert_close(norm(x), F.rms_norm(x, (96,), weight, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_writes_what_stack_and_index_copy_write(dtype):
    """The new K / V of a step, read from a fused qkv output's columns (strided rows) and from a separate tensor,
    land in the cache rows torch's stack + index_copy_ fills; nothing else changes."""
    from kvforge.core.cpu_kernels import store_kv

    torch.manual_seed(4)
    tokens, kv_heads, head_dim, slots = 3, 4, 32, 40
    qkv = torch.randn(tokens, (8 + 2 * kv_heads) * head_dim).to(dtype)
    k = qkv[:, 8 * head_dim: (8 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (8 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim).clone()  # its own row stride
    cache = torch.randn(2, kv_heads, slots // 8, 8, head_dim).to(dtype)
    planes = torch.arange(2 * kv_heads).view(2, 1, kv_heads, 1) * slots
    rows = (planes + torch.tensor([5, 17, 39]).view(1, -1, 1, 1)).view(-1)
    expected = cache.clone()
    expected.view(-1, head_dim).index_copy_(0, rows, torch.stack((k, v)).view(-1, head_dim))
    store_kv(k, v, cache, rows)
    assert torch.equal(cache, expected)
    with pytest.raises(ValueError, match="store_kv"):
        store_kv(k, v.float() if dtype != torch.float32 else v.half(), cache, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_moe_grouping_and_weighted_sum_are_torchs_bits(dtype):
    """A MoE step's bookkeeping in C (core/layers/moe.py): the (token, slot) pairs grouped by expert exactly as torch's
    stable argsort and bincount group them, and the weighted sum the bits of transformers' loop (`index_add_` of
    `y * w` once per expert, in expert order: each product and each token's running sum rounded to the dtype; one
    `index_add_` over every pair would sum in fp32 and round once); experts with no pairs; ids outside the range
    refused."""
    generator = torch.Generator().manual_seed(0)
    tokens_count, k, experts_count, hidden = 7, 3, 30, 96
    experts = torch.stack([torch.randperm(experts_count, generator=generator)[:k] for _ in range(tokens_count)])
    weights = torch.rand(tokens_count, k, generator=generator).to(dtype)
    tokens, sorted_weights, starts, widest = moe_group(experts, weights, experts_count)
    flat = experts.flatten()
    order, counts = torch.argsort(flat, stable=True), torch.bincount(flat, minlength=experts_count)
    assert torch.equal(tokens, order // k) and torch.equal(sorted_weights, weights.flatten()[order])
    assert torch.equal(starts, torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))
    assert widest == int(counts.max()) and (counts == 0).any()
    y = (torch.randn(tokens_count * k, hidden, generator=generator) * 4).to(dtype)
    expected = torch.zeros(tokens_count, hidden, dtype=dtype)
    for first, last in zip(starts[:-1].tolist(), starts[1:].tolist()):
        expected.index_add_(0, tokens[first:last], y[first:last] * sorted_weights[first:last].unsqueeze(1))
    assert torch.equal(moe_combine(y, sorted_weights, tokens, tokens_count), expected)
    with pytest.raises(ValueError, match="expert ids"):
        moe_group(experts + experts_count, weights, experts_count)
    with pytest.raises(ValueError, match="tokens outside"):
        moe_combine(y, sorted_weights, tokens + tokens_count, tokens_count)
