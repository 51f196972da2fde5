"""Memory estimates before loading: weights by parameter count (projections at the quant method's
bits per weight), KV by the seed formula (2 x layers x kv_heads x head_dim x tokens x dtype bytes)."""

from __future__ import annotations

import torch

from kvforge.core.config import DTYPES, kv_bytes_per_token
from kvforge.core.distributed import heads_of_rank
from kvforge.core.models.llama import head_dim_of


def linear_parameter_count(hf_config) -> int:
    """Weights of the attention and MLP projections: what a quant method stores (no biases)."""
    c = hf_config
    head_dim = head_dim_of(c)
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    return c.num_hidden_layers * (attention + 3 * c.hidden_size * c.intermediate_size)


def parameter_count(hf_config) -> int:
    """Parameters of a Llama-family model from its config (embeddings, attention, MLP, norms, head)."""
    c = hf_config
    hidden, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    head_dim = head_dim_of(c)
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    biases = q + 2 * kv if getattr(c, "attention_bias", False) or c.model_type == "qwen2" else 0
    per_layer_rest = biases + 2 * hidden + (2 * head_dim if c.model_type == "qwen3" else 0)
    head = 0 if getattr(c, "tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + linear_parameter_count(c) + layers * per_layer_rest + hidden + head


def estimate_memory(hf_config, dtype: str, context_tokens: int, bits_per_weight: float | None = None,
                    tp_size: int = 1) -> dict:
    """Bytes of weights and of the KV cache for `context_tokens` tokens. The projections take
    `bits_per_weight` (a quant method's figure, scales included) or the dtype's size; embeddings,
    norms and the LM head stay in `dtype` (a tied head is held twice: the embedding and the head's packed
copy), and so does the KV cache."""
    torch_dtype = DTYPES[dtype]
    element = torch.empty((), dtype=torch_dtype).element_size()
    params, linear = parameter_count(hf_config), linear_parameter_count(hf_config)
    projection_bytes = linear * (bits_per_weight / 8 if bits_per_weight else element)
    weights = (params - linear) * element + projection_bytes
    if getattr(hf_config, "tie_word_embeddings", False):  # the LM head keeps its own prepacked copy (speed)
        weights += hf_config.vocab_size * hf_config.hidden_size * element
    kv = context_tokens * kv_bytes_per_token(hf_config.num_hidden_layers, hf_config.num_key_value_heads,
                                             head_dim_of(hf_config), torch_dtype)
    estimate = {"parameters": params, "weights_bytes": int(weights), "kv_bytes": int(kv),
                "total_bytes": int(weights) + int(kv)}
    if tp_size > 1:  # rank 0 holds the largest share (heads split unevenly give it the extra)
        heads = heads_of_rank(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp_size, 0)
        c, head_dim = hf_config, head_dim_of(hf_config)
        rank_linear = c.num_hidden_layers * (c.hidden_size * (2 * heads.q_count + 2 * heads.kv_count) * head_dim
                                             + 3 * c.hidden_size * c.intermediate_size // tp_size)
        # the projections by this rank's share; embeddings and head split evenly (norms are noise)
        rank_weights = (weights - projection_bytes) / tp_size + projection_bytes * rank_linear / linear
        rank_kv = kv * heads.kv_count / hf_config.num_key_value_heads
        estimate |= {"rank_weights_bytes": int(rank_weights), "rank_kv_bytes": int(rank_kv),
                     "rank_total_bytes": int(rank_weights) + int(rank_kv)}
    return estimate
