"""A tiny HF mixture-of-experts model written as a GGUF file in llama.cpp's layout, as its convert_hf_to_gguf.py
writes Qwen2-MoE, Qwen3-MoE, Mixtral (architecture llama) and OLMoE: their metadata (the experts' sizes included),
the embedded model's tokenizer fields, each layer's experts stacked per projection, the shared expert's gate as a
vector, Q / K rows permuted for the llama architecture only (llama.cpp's rotary pairs adjacent values there). The
experts F32 or in a type the `gguf` package quantizes: the HF model's experts are then set to the dequantized values,
so it stays the reference for the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from kvforge.app.bench.hf_to_gguf import add_decoder_fields, permute_qk

ARCHS = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}
# HF v5's names within a layer (the experts stacked, as transformers 5 holds them) -> llama.cpp's
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
               "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def write_moe_gguf(model, path: Path, experts: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """`model` (a tiny HF Qwen2-MoE / Qwen3-MoE / Mixtral / OLMoE, every layer sparse) as the GGUF file `path`, its
    experts in
    `experts` (F32 or a type gguf-py quantizes; then `model`'s experts become the dequantized values)."""
    from kvforge.app.bench.real_shapes import tokenizer_fields
    from kvforge.core.loader import embedded_gguf_path

    config = model.config
    writer = GGUFWriter(str(path), ARCHS[config.model_type])
    add_decoder_fields(writer, config)
    writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):  # Qwen's; Mixtral's and OLMoE's experts are feed_forward_length
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if config.model_type == "qwen3_moe":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.model_type == "mixtral":  # LlamaModel's own keys
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    for key, value, kind, sub in tokenizer_fields(embedded_gguf_path()):
        writer.add_key_value(key, value, GGUFValueType(kind), GGUFValueType(sub) if sub is not None else None)
    for name, tensor in model.state_dict().items():
        for gguf_name, values, quantized in _gguf_tensors(name, tensor.detach(), experts, config):
            if quantized is None:
                writer.add_tensor(gguf_name, values)
            else:
                writer.add_tensor(gguf_name, quantized, raw_dtype=experts)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensors(name: str, tensor: torch.Tensor, experts: GGMLQuantizationType, config):
    """(GGUF name, float32 values, blocks or None) for one HF tensor; a stacked expert tensor is quantized and the
    HF tensor set to its dequantized values."""
    if name in TOP_NAMES:
        return [(TOP_NAMES[name], tensor.float().numpy(), None)]
    _, _, layer, rest = name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    if module == "mlp.experts":  # gate_up_proj [E, 2I, H] (gate first), down_proj [E, H, I]
        parts = dict(zip(("gate", "up"), tensor.chunk(2, dim=1))) if suffix == "gate_up_proj" else {"down": tensor}
        out = []
        for part, values in parts.items():
            blocks = None
            if experts != GGMLQuantizationType.F32:
                blocks = quantize(values.float().contiguous().numpy(), experts)
                values.copy_(torch.from_numpy(dequantize(blocks, experts)))  # a view of the model's parameter
            out.append((f"blk.{layer}.ffn_{part}_exps.weight", values.float().numpy(), blocks))
        return out
    values = tensor.float().numpy()
    if module == "mlp.shared_expert_gate":  # llama.cpp stores the [1, H] gate as a vector
        values = values.reshape(-1)
    if config.model_type == "mixtral" and module in ("self_attn.q_proj", "self_attn.k_proj"):
        heads = config.num_attention_heads if module == "self_attn.q_proj" else config.num_key_value_heads
        values = permute_qk(values, heads)
    return [(f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}", np.ascontiguousarray(values), None)]
