"""Decode attention on the torch path: one new token per sequence of a group, over its gathered context
(q [g, heads, head_dim], kv [2, g, kv_heads, padded_len, head_dim]). Three variants; which one runs is timed per
machine at load (core/kernel_choice.py), since which is faster depends on the CPU and the dtype. In a reduced
dtype (bf16, fp16) auto picks only among the fp32-math ones: prefill and the short chunk attend in fp32, so the K/V
a decoded reply leaves is what prefilling the same tokens gives (a conversation continued from cached KV, a
speculative verification, answer as the same prompt sent fresh); the others are there to be chosen by name.
- "bmm" (the stock one): fp32 batched matmuls over (sequence, KV head): scores plus an additive padding mask,
  softmax, weighted values. fp32 because CPU bf16 batched matmuls at these odd shapes are slow where the CPU
  has no native bf16.
- "bmm-native": the same batched matmuls in the model dtype, in HF's eager order (scores in the model dtype,
  scaled, masked, softmax in fp32, cast back, weighted values): no fp32 copy of the context, which is most of
  "bmm"'s cost at large batches where the CPU multiplies bf16 natively.
- "sdpa": torch's fused scaled_dot_product_attention in the model dtype with a boolean mask (GQA native): one
  op per group, no fp32 copy of the context.
- "paged" (CPU): a C kernel (core/cpu_kernels) that reads each sequence's blocks in place, every row of the step
  in one call -- the prefill chunks' tokens too, so a token prefilled and the same token decoded get the same
  attention bit for bit: no gather, no padding, no mask; fp32 math like "bmm". Offered where a C compiler builds it.
The gathered ones build their mask once per step (shared by every layer): None when every gathered key is
visible. Attention-logit soft-capping (Gemma 2: scores -> cap * tanh(scores / cap), before the mask) runs in every
variant but "sdpa" (torch's fused kernel has no hook for it), which is then not offered."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (context lengths [g], padded length, sliding window, kv heads, queries per kv head) -> mask or None
MaskBuilder = Callable[[torch.Tensor, int, "int | None", int, int], "torch.Tensor | None"]


@dataclass(frozen=True)
class DecodeVariant:
    # gathered: (q [g, heads, d], kv, mask, scale, softcap) -> [g, heads * d]; paged (mask None): (q, cache, block
    # tables, context lengths, scale, window, out, row sequences, softcap, kv_format, rotate) writes out
    run: Callable
    mask: MaskBuilder | None  # None: the variant reads the paged cache itself
    fp32_math: bool  # computes in fp32 whatever the model dtype (see above: what auto may pick in bf16 / fp16)
    unavailable: Callable[[torch.device], str | None] = lambda device: None  # why it cannot run there, or None
    soft_caps: bool = True  # can apply attention-logit soft-capping


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap), in place, in the reference's order (transformers' Gemma 2 eager attention)."""
    return scores.div_(cap).tanh_().mul_(cap)


def masked_scores(queries: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None,
                  softcap: float | None) -> torch.Tensor:
    """queries @ keys.T (batched) plus the additive mask (None: none), soft-capped first where `softcap` is given:
    tanh would turn the mask's -inf into -cap."""
    if softcap is None:
        keys_t = keys.transpose(1, 2)
        return torch.bmm(queries, keys_t) if mask is None else torch.baddbmm(mask, queries, keys_t)
    scores = soft_cap(torch.bmm(queries, keys.transpose(1, 2)), softcap)
    return scores if mask is None else scores.add_(mask)


def visible_positions(lengths: torch.Tensor, padded: int, window: int | None) -> torch.Tensor | None:
    """[g, padded] bool: the gathered keys each sequence sees (its context, within the window); None: all."""
    needs_window = window is not None and int(lengths.max()) > window
    if bool((lengths == padded).all()) and not needs_window:
        return None
    pos = torch.arange(padded).unsqueeze(0)
    valid = pos < lengths.unsqueeze(1)
    if needs_window:
        valid &= pos >= lengths.unsqueeze(1) - window
    return valid


def bmm_mask(lengths, padded, window, kv_heads, per_head) -> torch.Tensor | None:
    """Additive [g * kv_heads, queries per kv head, padded] (0 visible, -inf hidden)."""
    valid = visible_positions(lengths, padded, window)
    if valid is None:
        return None
    g = valid.shape[0]
    additive = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
    return additive.view(g, 1, 1, padded).expand(g, kv_heads, per_head, padded).reshape(g * kv_heads, per_head, padded)


def bmm_run(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None = None) -> torch.Tensor:
    g, _, head_dim = q.shape
    kv_heads = kv.shape[2]
    queries = (q.float() * scale).reshape(g * kv_heads, -1, head_dim)
    if kv.dtype != torch.float32:
        kv = kv.float()
    keys, values = kv.view(2, g * kv_heads, -1, head_dim).unbind(0)
    scores = masked_scores(queries, keys, mask, softcap)
    out = torch.bmm(torch.softmax(scores, dim=-1), values)  # [g * kv_heads, queries per kv head, head_dim]
    return out.view(g, -1).to(q.dtype)


def native_bmm_run(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   softcap: float | None = None) -> torch.Tensor:
    g, _, head_dim = q.shape
    kv_heads = kv.shape[2]
    queries = q.reshape(g * kv_heads, -1, head_dim)
    keys, values = kv.view(2, g * kv_heads, -1, head_dim).unbind(0)
    scores = torch.bmm(queries, keys.transpose(1, 2)) * scale
    if softcap is not None:
        soft_cap(scores, softcap)
    if mask is not None:  # the fp32 mask lifts the scores to fp32 (their bf16 values kept exactly)
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(weights, values).view(g, -1)


def sdpa_mask(lengths, padded, window, kv_heads, per_head) -> torch.Tensor | None:
    """Boolean [g, 1, 1, padded] (True: attended), broadcast over heads."""
    valid = visible_positions(lengths, padded, window)
    return None if valid is None else valid.view(valid.shape[0], 1, 1, padded)


def sdpa_run(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, scale: float,
             softcap: float | None = None) -> torch.Tensor:
    keys, values = kv.unbind(0)  # [g, kv_heads, padded, head_dim]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.reshape(q.shape[0], -1)


def paged_run(q, cache, block_tables, context_lens, scale, window, out, row_seqs, softcap=None, kv_format=None,
              rotate=False) -> None:
    from kvforge.core.cpu_kernels import paged_attention

    paged_attention(q, cache, block_tables, context_lens, scale, window, out, row_seqs, softcap=softcap,
                    kv_format=kv_format, rotate=rotate)


def paged_unavailable(device: torch.device) -> str | None:
    if device.type != "cpu":
        return "the paged C kernel runs on CPU tensors"
    from kvforge.core.cpu_kernels import unavailable

    return unavailable()


DECODE_VARIANTS = {"bmm": DecodeVariant(bmm_run, bmm_mask, fp32_math=True),
                   "bmm-native": DecodeVariant(native_bmm_run, bmm_mask, fp32_math=False),
                   "sdpa": DecodeVariant(sdpa_run, sdpa_mask, fp32_math=False, soft_caps=False),
                   "paged": DecodeVariant(paged_run, None, fp32_math=True, unavailable=paged_unavailable)}


def offered_variants(device: torch.device, softcap: bool = False) -> list[str]:
    """The variants that run on `device` here (the stock one first), for layers with soft-capping or not."""
    return [name for name, v in DECODE_VARIANTS.items()
            if v.unavailable(device) is None and (v.soft_caps or not softcap)]


def automatic_variants(dtype: torch.dtype, device: torch.device, softcap: bool = False) -> list[str]:
    """The variants `decode_attention=auto` chooses among for a model in `dtype` on `device`."""
    return [name for name in offered_variants(device, softcap)
            if dtype == torch.float32 or DECODE_VARIANTS[name].fp32_math]
