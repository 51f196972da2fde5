"""Attention over the paged KV cache: the portable torch path (below) or the Triton kernels
(core/kernels: on CUDA, and on CPU under TRITON_INTERPRET=1 in tests), chosen when the layer is built.

The cache is head-major and paged: [2 (K, V), kv_heads, num_blocks, block_size, head_dim] per
layer, so a gathered context comes out as [2, kv_heads, tokens, head_dim], the layout the matmuls
want, and gathering copies whole blocks (see context.py). The layer first writes the step's new K/V.
Prefill chunks attend one sequence at a time over their context (SDPA). Decode tokens attend in
groups of similar context length (layers/decode_attention.py: fp32 batched matmuls or SDPA, whichever is
faster on this machine), so the number of operations per layer does not grow with the number of sequences.
With the "paged" variant (a C kernel reading the blocks in place) the decode rows attend in one call, and so does
every row of a step whose prefill chunks are all short (SHORT_CHUNK); longer chunks still take SDPA.
A quantized pool (StepContext.kv_format, core/kv/quant.py) is written through the same store step, each new row
quantized; the paged C kernel and the Triton kernels dequantize it in registers, and the paths that gather a context
(SDPA prefill, the short-chunk math, the gathering decode variants) dequantize what they gathered, where they would
otherwise convert it to fp32.
`softcap` (Gemma 2's attention-logit soft-capping) is applied by every
path: the decode variants that offer it, the Triton kernels, and on the torch path prefill chunks attend through
the same fp32 math as short chunks (torch's SDPA has no hook for it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core import cpu_kernels
from kvforge.core.context import KernelBatch, PrefillSeq, StepContext, get_context
from kvforge.core.kv.quant import KVFormat, hadamard
from kvforge.core.layers.backend import use_triton
from kvforge.core.layers.decode_attention import DECODE_VARIANTS, masked_scores


def _rotated(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., head_dim] times the Hadamard matrix, or its inverse (both exact), in fp32 and rounded once to x's dtype:
    for a decode step's few rows torch's fp32 matmul and the two conversions took 7 us, a bf16 matmul 14 (Zen 5)."""
    return torch.matmul(x.float(), hadamard(x.shape[-1], device=x.device, inverse=inverse)).to(x.dtype)


def _heads_contiguous(*tensors: torch.Tensor) -> bool:
    """Each [tokens, heads, head_dim] with its heads side by side in a row (any row stride)."""
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in tensors)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, layer_index: int = 0, softcap: float | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index  # which layer of the step's KV pool (StepContext.kv_cache) is ours
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap  # scores -> softcap * tanh(scores / softcap) before the mask; None: none
        self.use_decode_variant("bmm")  # the stock one until the runner times the others (core/kernel_choice.py)
        self.triton = use_triton()
        if self.triton:  # bound once here, not per call; imported only with the Triton kernels (triton is optional)
            from kvforge.core.kernels.fused import store_kv
            from kvforge.core.kernels.paged_decode import paged_decode_attention
            from kvforge.core.kernels.paged_prefill import paged_prefill_attention

            self.store_kv, self.decode_kernel, self.prefill_kernel = (store_kv, paged_decode_attention,
                                                                      paged_prefill_attention)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, heads * head_dim]."""
        ctx = get_context()
        cache = ctx.kv_cache[self.layer_index]  # [2, kv_heads, blocks, block_size, head_dim]
        if ctx.kv_format is not None and ctx.kv_format.rotate:  # q4's rows hold rotated K / V (core/kv/quant.py)
            if self._c_store(cache, k, v) and self.decode.mask is None and self._paged_rows_only(ctx):
                return self._attend(ctx, cache, q, k, v, rotate=True)  # the C kernels rotate as they store and read
            out = self._attend(ctx, cache, _rotated(q, inverse=True), _rotated(k), _rotated(v))
            return _rotated(out.view(-1, self.num_heads, self.head_dim), inverse=True).view(out.shape)
        return self._attend(ctx, cache, q, k, v)

    def _c_store(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the C kernel stores the step's K / V (one pass: ~18 us a layer less per decode step)."""
        return (not self.triton and cache.device.type == "cpu" and _heads_contiguous(k, v)
                and cpu_kernels.unavailable() is None)

    def _paged_rows_only(self, ctx: StepContext) -> bool:
        """Whether every row of the step goes through decode_rows: a decode step, or the paged kernel with only
        short prefill chunks."""
        return not ctx.prefills or (self.decode.mask is None and all(
            seq.end - seq.start <= SHORT_CHUNK and seq.key_limits is None for seq in ctx.prefills))

    def _attend(self, ctx: StepContext, cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, rotate: bool = False) -> torch.Tensor:
        """`rotate`: q, k, v and the output are the model's own; the C kernels multiply by the Hadamard matrix."""
        if self.triton:
            return self._forward_kernels(ctx.kernel, ctx.kv_format, cache, q, k, v)
        if self._c_store(cache, k, v):
            cpu_kernels.store_kv(k, v, cache, ctx.write_rows, ctx.kv_format, rotate=rotate)
        else:
            new_kv = torch.stack((k, v))  # K and V together: a format may quantize them as a pair (q4)
            if ctx.kv_format is not None:
                new_kv = ctx.kv_format.quantize(new_kv)
            rows = new_kv.view(-1, cache.shape[-1])  # (K/V, token, head), the order of write_rows
            cache.view(-1, cache.shape[-1]).index_copy_(0, ctx.write_rows, rows)
        if self._paged_rows_only(ctx):
            return self.decode_rows(ctx, cache, q, rotate)  # a decode step, or the paged kernel: every row in one call
        # prefill chunks through SDPA (or the short-chunk math) even where the paged kernel attends decode rows: it
        # attends row by row, re-reading the context per query (Zen 2, 32 heads: 420 new tokens over a 2725-token
        # context 1005 ms a layer against SDPA's 119 with the gather; a fresh 113-token prompt 3.7 against 1.9)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for i, seq in enumerate(ctx.prefills):
            out[seq.start:seq.end] = self._prefill(ctx, cache, i, seq, q, k, v)
        decodes = ctx.prefills[0].start  # decode rows come first
        if decodes:
            out[:decodes] = self.decode_rows(ctx, cache, q[:decodes])
        return out

    def decode_rows(self, ctx: StepContext, cache: torch.Tensor, q: torch.Tensor, rotate: bool = False) -> torch.Tensor:
        """The step's decode rows (the first rows of the flat batch, one new token each; q holds only them, or with
        the paged kernel every row of the step), attended by the decode variant chosen for this machine
        (layers/decode_attention.py) -> [rows, heads * d]."""
        if self.decode.mask is None:  # reads the paged cache in place (prefill rows too, when q holds them)
            rows = q.shape[0]
            out = q.new_empty(rows, self.num_heads * self.head_dim)
            self.decode.run(q, cache, ctx.block_tables, ctx.row_lens[:rows], self.scale, self.sliding_window, out,
                            None if ctx.row_seqs is None else ctx.row_seqs[:rows], softcap=self.softcap,
                            kv_format=ctx.kv_format, rotate=rotate)
            return out
        if len(ctx.decode_groups) == 1:
            return self._decode(ctx, cache, 0, q)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for i, group in enumerate(ctx.decode_groups):
            out[group.start:group.end] = self._decode(ctx, cache, i, q)
        return out

    def _forward_kernels(self, batch: KernelBatch, kv_format: KVFormat | None, cache: torch.Tensor, q, k,
                         v) -> torch.Tensor:
        """Store the new K/V, then decode rows through the split-context decode kernel and prefill chunks
        through the varlen prefill kernel, both reading the paged cache (cached context and new tokens)."""
        self.store_kv(k, v, cache, batch.slots, kv_format=kv_format)
        out = q.new_empty(q.shape)  # contiguous (q is a view into the fused qkv output)
        d = batch.num_decodes
        if d:
            self.decode_kernel(q[:d], cache, batch.decode_block_tables, batch.decode_context_lens, self.scale,
                               self.sliding_window, out=out[:d], softcap=self.softcap, kv_format=kv_format)
        if d < q.shape[0]:
            self.prefill_kernel(q[d:], cache, batch.prefill_block_tables, batch.query_start_loc,
                                batch.prefill_context_lens, batch.max_query_len, self.scale,
                                self.sliding_window, out=out[d:], softcap=self.softcap, kv_format=kv_format,
                                key_limits=batch.prefill_key_limits)
        return out.view(q.shape[0], -1)

    def _prefill(self, ctx: StepContext, cache: torch.Tensor, i: int, seq: PrefillSeq, q, k, v) -> torch.Tensor:
        new = seq.end - seq.start
        if self.softcap is not None or (seq.gather_rows is not None and new <= SHORT_CHUNK):
            return self._math_chunk(ctx, cache, i, seq, q, k, v)
        if seq.context_len == new:  # nothing cached before this chunk: use the fresh K/V (as stored)
            keys, values = k[seq.start:seq.end].transpose(0, 1), v[seq.start:seq.end].transpose(0, 1)
            if ctx.kv_format is not None:
                keys, values = self._as_stored(ctx, torch.stack((keys, values))).unbind(0)
        else:
            gathered = self._gather(cache, seq.gather_rows, 1)[:, 0, :, : seq.context_len]
            keys, values = self._values(ctx, gathered, torch.float32).unbind(0)
        mask = prefill_mask(ctx, i, seq, self.sliding_window)
        queries = q[seq.start:seq.end].transpose(0, 1)
        if q.dtype != torch.float32:  # fp32 attention math, as decode's and the short chunk's: a conversation
            # continued from cached KV gives what the same prompt sent fresh gives (bf16 flash rounds the
            # weights: 34% of outputs differ); the upcast is cheap, and fp32 flash was the faster on Zen 5
            queries, keys, values = queries.float(), keys.float(), values.float()
        # 4-D (a batch of one): torch runs its fused flash kernel on CPU only for 4-D inputs; 3-D ones take the
        # math path, which materialises every score (measured 1.2x slower at 110 tokens, 8x at 2048)
        return F.scaled_dot_product_attention(
            queries[None], keys[None], values[None],
            attn_mask=None if mask is CAUSAL else mask, is_causal=mask is CAUSAL, scale=self.scale,
            enable_gqa=True,
        )[0].transpose(0, 1).flatten(1).to(q.dtype)

    def _math_chunk(self, ctx: StepContext, cache: torch.Tensor, i: int, seq: PrefillSeq, q, k, v) -> torch.Tensor:
        """A chunk attended with decode's batched fp32 math, the new tokens' queries side by side per KV head: a few
        new tokens after a cached context (speculative verification of 1 + k tokens, a short last chunk: several
        times faster here than SDPA's masked path, and the same arithmetic as decoding each token), and every chunk
        of a soft-capped layer, MATH_TOKENS queries at a time (bounding the scores' memory)."""
        new, length, kv_heads, head_dim = seq.end - seq.start, seq.context_len, self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        dtype = q.dtype
        if seq.gather_rows is None:  # nothing cached before this chunk: its fresh K/V (as stored) are the context
            kv = self._as_stored(ctx, torch.stack((k[seq.start:seq.end], v[seq.start:seq.end]))).transpose(1, 2)
        else:
            kv = self._values(ctx, self._gather(cache, seq.gather_rows, 1)[:, 0, :, :length], torch.float32)
        if dtype != torch.float32:
            kv = kv.float()
        keys, values = kv.unbind(0)  # [kv_heads, length, head_dim]
        mask = short_chunk_mask(ctx, i, seq, self.sliding_window, group)  # [1, new * group, length]
        out = q.new_empty(new, self.num_heads * head_dim)
        for first in range(0, new, MATH_TOKENS):
            last = min(first + MATH_TOKENS, new)
            queries = (q[seq.start + first:seq.start + last].float() * self.scale).view(last - first, kv_heads,
                                                                                          group, head_dim)
            queries = queries.transpose(0, 1).reshape(kv_heads, (last - first) * group, head_dim)
            scores = masked_scores(queries, keys, mask[:, first * group:last * group], self.softcap)
            attended = torch.bmm(torch.softmax(scores, dim=-1), values)  # [kv_heads, tokens * group, head_dim]
            out[first:last] = attended.view(kv_heads, last - first, group * head_dim).transpose(0, 1).reshape(
                last - first, -1)
        return out

    def _gather(self, cache: torch.Tensor, rows: torch.Tensor, seqs: int) -> torch.Tensor:
        """K and V of the given blocks as stored: [2, seqs, kv_heads, blocks * block_size, head_dim (or a quantized
        format's row bytes)]."""
        row = cache.shape[4]
        gathered = cache.view(-1, cache.shape[3] * row).index_select(0, rows)
        return gathered.view(2, seqs, self.num_kv_heads, -1, row)

    @staticmethod
    def _as_stored(ctx: StepContext, kv: torch.Tensor) -> torch.Tensor:
        """Fresh K and V [2, ..., head_dim] as a quantized pool holds them (fp32: its dequantized rows), so a chunk
        attends to what every later read of the same tokens sees -- a prompt sent again, continued from the prefix
        cache, or decoded; a full-precision pool's as they are."""
        fmt = ctx.kv_format
        return kv if fmt is None else fmt.dequantize(fmt.quantize(kv), kv.shape[-1])

    def _values(self, ctx: StepContext, gathered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered K / V as values: a quantized pool's rows dequantized into `dtype`, a full-precision pool's as
        they are (the caller converts them where it needs to)."""
        return gathered if ctx.kv_format is None else ctx.kv_format.dequantize(gathered, self.head_dim, dtype)

    def _decode(self, ctx: StepContext, cache: torch.Tensor, i: int, q: torch.Tensor) -> torch.Tensor:
        """One new token per sequence of the group, attended over its gathered context by a gathering decode
        variant; the group's mask is built once per step."""
        group = ctx.decode_groups[i]
        g = group.end - group.start
        key = (self.decode_variant, i, self.sliding_window)
        if key not in ctx.masks:
            mask = self.decode.mask(group.lengths, group.padded_len, self.sliding_window, self.num_kv_heads,
                                    self.num_heads // self.num_kv_heads)
            ctx.masks[key] = None if mask is None else mask.to(ctx.kv_cache.device)
        kv = self._values(ctx, self._gather(cache, group.gather_rows, g),
                          torch.float32 if self.decode.fp32_math else q.dtype)
        return self.decode.run(q[group.start:group.end], kv, ctx.masks[key], self.scale, self.softcap)

    def use_decode_variant(self, name: str, device: torch.device | None = None) -> None:
        """Attend decode rows with the named variant (ValueError naming why, where it cannot run on `device`)."""
        reason = DECODE_VARIANTS[name].unavailable(device or torch.device("cpu"))
        if reason is None and self.softcap is not None and not DECODE_VARIANTS[name].soft_caps:
            reason = "it has no attention-logit soft-capping, which this model needs"
        if reason is not None:
            raise ValueError(f"decode_attention={name!r} cannot run here: {reason}")
        self.decode_variant, self.decode = name, DECODE_VARIANTS[name]


SHORT_CHUNK = 16  # chunks of at most this many tokens after a cached context attend like decode tokens
MATH_TOKENS = 256  # a soft-capped chunk's queries per batched matmul: scores of at most heads * 256 * context

CAUSAL = object()  # mask marker: a fresh prompt chunk with no cached context; causal is all it needs


def prefill_mask(ctx: StepContext, i: int, seq: PrefillSeq, window: int | None):
    key = ("prefill", i, window)
    if key not in ctx.masks:
        new, length = seq.end - seq.start, seq.context_len
        if new == length and (window is None or length <= window) and seq.key_limits is None:
            ctx.masks[key] = CAUSAL
        else:
            ctx.masks[key] = visible_keys(new, length, window, limits=seq.key_limits).to(ctx.kv_cache.device)
    return ctx.masks[key]


def visible_keys(new: int, length: int, window: int | None, repeat: int = 1,
                 limits: torch.Tensor | None = None) -> torch.Tensor:
    """[new * repeat, length] bool: the keys each of the last `new` tokens of a `length`-token context sees
    (causal -- or up to its `limits` entry, the last key position it sees -- and within the sliding window, which
    counts back from the token's own position), each token's row repeated `repeat` times."""
    query_pos = torch.arange(length - new, length).repeat_interleave(repeat).unsqueeze(1)
    key_pos = torch.arange(length).unsqueeze(0)
    upper = query_pos if limits is None else limits.repeat_interleave(repeat).unsqueeze(1)
    visible = key_pos <= upper
    if window is not None:
        visible &= key_pos > query_pos - window
    return visible


def short_chunk_mask(ctx: StepContext, i: int, seq: PrefillSeq, window: int | None, group: int) -> torch.Tensor:
    """Additive causal mask [1, new * group, context] for `_math_chunk` (query rows token-major)."""
    key = ("short", i, window)
    if key not in ctx.masks:
        visible = visible_keys(seq.end - seq.start, seq.context_len, window, repeat=group, limits=seq.key_limits)
        additive = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).unsqueeze(0)
        ctx.masks[key] = additive.to(ctx.kv_cache.device)
    return ctx.masks[key]
