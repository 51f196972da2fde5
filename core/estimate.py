"""Memory estimates before loading: weights by parameter count (each projection at the bits per weight its
quant method stores, or dense), KV by the seed formula (2 x layers x kv_heads x head_dim x tokens x dtype
bytes; a quantized KV's format's bytes per row instead of head_dim x dtype bytes)."""

from __future__ import annotations

import torch

from kvforge.core.config import DTYPES, kv_bytes_per_token, resolve_dtype
from kvforge.core.distributed import head_weight_in_layers, heads_of_rank, stage_bounds
from kvforge.core.layers.moe import is_sparse_layer, moe_layout
from kvforge.core.models.llama import LlamaForCausalLM, head_dim_of
from kvforge.core.models.registry import vision_family
from kvforge.core.plugins import QUANT_GROUP, discover
from kvforge.core.quant_config import QuantConfig


def projection_weights(hf_config, tp_size: int = 1, rank: int = 0) -> dict[str, int]:
    """The attention and MLP projections as kvforge's layers name them (q/k/v fused into qkv_proj, gate/up into
    gate_up_proj; a mixture-of-experts layer's experts and shared expert each an MLP of their own) -> the weights
    `rank` of `tp_size` holds of each (no biases): what a quant method stores."""
    c = hf_config
    head_dim = head_dim_of(c)
    heads = heads_of_rank(c.num_attention_heads, c.num_key_value_heads, tp_size, rank)
    q, kv = heads.q_count * head_dim, heads.kv_count * head_dim
    attention = {"self_attn.qkv_proj": c.hidden_size * (q + 2 * kv), "self_attn.o_proj": q * c.hidden_size}

    def mlp(name: str, size: int) -> dict[str, int]:
        return {f"{name}.gate_up_proj": 2 * c.hidden_size * (size // tp_size),
                f"{name}.down_proj": (size // tp_size) * c.hidden_size}

    weights = {}
    for i in range(c.num_hidden_layers):
        layer = dict(attention)
        if is_sparse_layer(c, i):
            experts, _, size = moe_layout(c)
            for e in range(experts):
                layer |= mlp(f"mlp.experts.{e}", size)
            if getattr(c, "shared_expert_intermediate_size", 0):
                layer |= mlp("mlp.shared_expert", c.shared_expert_intermediate_size)
        else:
            layer |= mlp("mlp", c.intermediate_size)
        weights |= {f"model.layers.{i}.{name}": n for name, n in layer.items()}
    return weights


def linear_parameter_count(hf_config) -> int:
    """Weights of the attention and MLP projections: what a quant method stores (no biases)."""
    return sum(projection_weights(hf_config).values())


def parameter_count(hf_config) -> int:
    """Parameters of a Llama-family model from its config (embeddings, attention, MLP, norms, head; a
    mixture-of-experts layer's router and shared-expert gate)."""
    c = hf_config
    hidden, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    head_dim = head_dim_of(c)
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    qkv_bias = getattr(c, "attention_bias", False) or getattr(c, "qkv_bias", False) or c.model_type == "qwen2"
    qk_norms = {"qwen3": 2 * head_dim, "qwen3_moe": 2 * head_dim, "olmoe": q + kv}.get(c.model_type, 0)
    per_layer_rest = (q + 2 * kv if qkv_bias else 0) + 2 * hidden + qk_norms
    routers = 0
    for i in range(layers):
        if is_sparse_layer(c, i):
            routers += moe_layout(c)[0] * hidden + (hidden if getattr(c, "shared_expert_intermediate_size", 0) else 0)
    head = 0 if getattr(c, "tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + linear_parameter_count(c) + layers * per_layer_rest + routers + hidden + head


def _dense_linear_bytes(hf_config, torch_dtype: torch.dtype, quant: QuantConfig | None) -> int | None:
    """Bytes per weight of the dense linears (a dense model's, a quantized one's head and modules kept dense) where
    the dense method keeps a bf16 / fp16 checkpoint's dtype in an fp32 model (plugins/quant/dense.py, `weights: auto`,
    a quantized model's dense layers included; the config's dtype names the checkpoint's); else None."""
    narrow_floats = discover(QUANT_GROUP).get("none").narrow_floats  # the dense method's, found like any plugin
    if torch_dtype != torch.float32 or (quant is not None and quant.method.name == "none" and
                                        quant.options.get("weights", "auto") != "auto"):
        return None
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    stored = DTYPES.get(stored) if isinstance(stored, str) else stored
    return stored.itemsize if stored in narrow_floats else None


def estimate_memory(hf_config, dtype: str, context_tokens: int, quant: QuantConfig | None = None,
                    tp_size: int = 1, kv_cache_dtype: str = "auto", pp_size: int = 1) -> dict:
    """Bytes of weights and of the KV cache for `context_tokens` tokens. Each projection takes the bits per
    weight `quant` stores it in (its method's figure, scales included) or, when `quant` keeps it dense (the
    modules_to_not_convert) or there is no `quant`, the dtype's size (a bf16 / fp16 checkpoint's in an fp32 model that
    keeps them so, as the head too); embeddings and norms stay in `dtype` (a tied head is held twice: the embedding
    and the head's own copy), and so does the KV cache unless `kv_cache_dtype` stores it quantized (its format's
    bytes per row: core/kv/quant.py). A mixture-of-experts model's routed experts are also counted apart
    (`experts_bytes`, part of the weights), and a vision model's tower and connector (`vision_bytes`, part of them
    too). Under pipeline parallelism (`pp_size` > 1) `stages` says what each
    stage's process holds (its rank 0's share under tensor parallelism): its layers [first, last), their weights and
    KV, the first stage's embedding and LM head besides (core/distributed.py's stage_layers split)."""
    torch_dtype = DTYPES[resolve_dtype(dtype)]
    element = torch.empty((), dtype=torch_dtype).element_size()
    linear_element = _dense_linear_bytes(hf_config, torch_dtype, quant) or element
    quant = quant.with_packed_modules(LlamaForCausalLM.packed_modules_mapping) if quant is not None else None

    def projection_bytes(size: int = 1, rank: int = 0, experts_only: bool = False,
                         layers: range | None = None) -> float:
        total = 0.0
        for prefix, count in projection_weights(hf_config, size, rank).items():
            if experts_only and ".mlp.experts." not in prefix:
                continue
            if layers is not None and int(prefix.split(".")[2]) not in layers:  # model.layers.<i>.
                continue
            bits = quant.bits_per_weight(prefix) if quant is not None else None
            total += count * (bits / 8 if bits else linear_element)
        return total

    params, linear, projections = parameter_count(hf_config), linear_parameter_count(hf_config), projection_bytes()
    head = hf_config.vocab_size * hf_config.hidden_size
    tied = getattr(hf_config, "tie_word_embeddings", False)
    # the head at the dense linears' size; a tied head keeps its own copy (prepacked, or the checkpoint's dtype)
    weights = (params - linear - (0 if tied else head)) * element + projections + head * linear_element
    kv = context_tokens * kv_bytes_per_token(hf_config.num_hidden_layers, hf_config.num_key_value_heads,
                                             head_dim_of(hf_config), torch_dtype, kv_cache_dtype)
    # a vision model's tower and connector, in `dtype` (never quantized)
    vision = vision_family(hf_config.architectures).vision_parameter_count(hf_config) \
        if getattr(hf_config, "vision_config", None) is not None else 0
    params, weights = params + vision, weights + vision * element
    estimate = {"parameters": params, "weights_bytes": int(weights), "kv_bytes": int(kv),
                "total_bytes": int(weights) + int(kv)}
    if vision:
        estimate["vision_bytes"] = vision * element
    if moe_layout(hf_config) is not None:  # the routed experts' share: what --cpu-experts keeps in host memory
        estimate["experts_bytes"] = int(projection_bytes(experts_only=True))
    # rank 0 holds the largest share under tensor parallelism (heads split unevenly give it the extra)
    heads = heads_of_rank(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp_size, 0)
    kv_share = heads.kv_count / hf_config.num_key_value_heads
    if tp_size > 1:
        # the projections by this rank's share; embeddings and head split evenly (norms are noise)
        rank_weights = (weights - projections) / tp_size + projection_bytes(tp_size, 0)
        rank_kv = kv * kv_share
        estimate |= {"rank_weights_bytes": int(rank_weights), "rank_kv_bytes": int(rank_kv),
                     "rank_total_bytes": int(rank_weights) + int(rank_kv)}
    if pp_size > 1:
        layers, vocab = hf_config.num_hidden_layers, hf_config.vocab_size * hf_config.hidden_size
        # norms, biases and routers: the weights that are neither projections, embedding, head nor final norm
        rest = (params - linear - vocab - (0 if tied else head) - hf_config.hidden_size) * element / tp_size
        ends = stage_bounds(layers, head_weight_in_layers(hf_config), pp_size)
        estimate["stages"] = []
        for first, last in zip(ends, ends[1:]):
            held = range(first, last)
            stage_weights = projection_bytes(tp_size, 0, layers=held) + rest * len(held) / layers
            if first == 0:  # the embedding and the LM head
                stage_weights += (vocab * element + head * linear_element) / tp_size
            if last == layers:
                stage_weights += hf_config.hidden_size * element
            stage_kv = kv * kv_share * len(held) / layers
            stage = {"layers": [first, last], "weights_bytes": int(stage_weights), "kv_bytes": int(stage_kv),
                     "total_bytes": int(stage_weights) + int(stage_kv)}
            if "experts_bytes" in estimate:
                stage["experts_bytes"] = int(projection_bytes(tp_size, 0, experts_only=True, layers=held))
            estimate["stages"].append(stage)
    return estimate
