"""Memory estimates before loading: weights by parameter count, KV by the seed formula
(2 x layers x kv_heads x head_dim x tokens x dtype bytes)."""

from __future__ import annotations

import torch

from kvforge.core.config import DTYPES, kv_bytes_per_token
from kvforge.core.models.llama import head_dim_of


def parameter_count(hf_config) -> int:
    """Parameters of a Llama-family model from its config (embeddings, attention, MLP, norms, head)."""
    c = hf_config
    hidden, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    head_dim = head_dim_of(c)
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden
    if getattr(c, "attention_bias", False) or c.model_type == "qwen2":
        attention += q + 2 * kv
    mlp = 3 * hidden * c.intermediate_size
    per_layer = attention + mlp + 2 * hidden + (2 * head_dim if c.model_type == "qwen3" else 0)
    head = 0 if getattr(c, "tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + layers * per_layer + hidden + head


def estimate_memory(hf_config, dtype: str, context_tokens: int, bits_per_weight: float | None = None) -> dict:
    """Bytes of weights (dense in `dtype`, or `bits_per_weight` for a quant method that says so) and
    of the KV cache for `context_tokens` tokens."""
    torch_dtype = DTYPES[dtype]
    element = torch.empty((), dtype=torch_dtype).element_size()
    params = parameter_count(hf_config)
    weights = params * (bits_per_weight / 8 if bits_per_weight else element)
    kv = context_tokens * kv_bytes_per_token(hf_config.num_hidden_layers, hf_config.num_key_value_heads,
                                             head_dim_of(hf_config), torch_dtype)
    return {"parameters": params, "weights_bytes": int(weights), "kv_bytes": int(kv),
            "total_bytes": int(weights) + int(kv)}
