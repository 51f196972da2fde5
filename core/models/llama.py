"""The Llama family on the paged KV cache: Llama 2/3 (rope scaling), Mistral (sliding window),
Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm) and Phi-3 / Phi-4-mini (checkpoints with q/k/v and gate/up already
fused, long-rope scaling, a partial rotary dimension, a sliding window on every layer); tied or separate embeddings.
Their mixture-of-experts kin share the attention and swap the MLP for core/layers/moe.py's block: Qwen2-MoE (a
shared expert), Qwen3-MoE, Mixtral (its checkpoint names `block_sparse_moe`, `w1` / `w3` / `w2` read as `mlp`,
`gate_proj` / `up_proj` / `down_proj`) and OLMoE (q/k RMSNorm over the whole projection, optional q/k/v clipping).

Parameter names follow the HF checkpoints, except that q/k/v and gate/up are fused; the loader
uses `packed_modules_mapping` to route each checkpoint tensor to its shard (a fused checkpoint tensor is split by
the layer itself). Each linear layer gets its
quant method from the QuantConfig by its dotted name (`prefix`).
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.core.distributed import pool_layer, stage_layers
from kvforge.core.layers.activation import SiluAndMul
from kvforge.core.layers.attention import Attention
from kvforge.core.layers.backend import use_triton
from kvforge.core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvforge.core.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvforge.core.layers.moe import SparseMoeBlock, is_sparse_layer
from kvforge.core.layers.norm import RMSNorm, SplitRMSNorm
from kvforge.core.layers.rotary import RotaryEmbedding, rotary_dim_of, rotate
from kvforge.core.models.causal_lm import CausalLM, OtherStage, StageCarry
from kvforge.core.quant_config import QuantConfig


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer_idx: int) -> int | None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
    if config.model_type in ("mistral", "phi3", "mixtral"):  # every layer (as transformers' Mistral, Phi-3, Mixtral)
        return getattr(config, "sliding_window", None)
    return None


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, quant: QuantConfig, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=attention_bias or config.model_type == "qwen2" or bool(getattr(config, "qkv_bias", False)),
            params_dtype=dtype, quant_config=quant,
            prefix=f"{prefix}.qkv_proj")
        heads = self.qkv_proj.heads  # this rank's query and KV heads
        self.num_heads, self.num_kv_heads = heads.q_count, heads.kv_count
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=attention_bias, params_dtype=dtype,
                                        input_shard=(heads.q_first * self.head_dim, heads.q_count * self.head_dim),
                                        quant_config=quant, prefix=f"{prefix}.o_proj")
        # q/k RMSNorm: per head (Qwen3), or over the whole projection (OLMoE)
        self.qk_norm = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "projection"}.get(config.model_type)
        if self.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        elif self.qk_norm == "projection":  # every rank's heads are normalised together: this rank's slice
            d, kv_heads = self.head_dim, config.num_key_value_heads
            self.q_norm = SplitRMSNorm(config.num_attention_heads * d, heads.q_first * d, heads.q_count * d,
                                       config.rms_norm_eps, dtype)
            self.k_norm = SplitRMSNorm(kv_heads * d, heads.kv_first * d, heads.kv_count * d, config.rms_norm_eps,
                                       dtype, replicas=max(1, self.qkv_proj.tp_size // kv_heads))
        self.clip_qkv = getattr(config, "clip_qkv", None)  # OLMoE's: q, k (after the norm) and v clamped
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                              sliding_window_of(config, layer_idx),
                              layer_index=pool_layer(layer_idx, config))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rotate = rotate
        # the Triton kernel rotates whole heads in place, in one pass
        if use_triton() and rotary_dim_of(config, self.head_dim) == self.head_dim:
            from kvforge.core.kernels.fused import rotary_inplace

            self.rotate = rotary_inplace

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        tokens, heads = qkv.shape[0], self.num_heads
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "projection":
            q = self.q_norm(qkv[:, : self.q_size].contiguous())
            k = self.k_norm(qkv[:, self.q_size: self.q_size + self.kv_size].contiguous())
            if self.clip_qkv is not None:
                q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
            q = self.rotate(q.view(tokens, heads, self.head_dim), *rope)
            k = self.rotate(k.view(tokens, -1, self.head_dim), *rope)
        elif self.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].reshape(tokens, heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size: self.q_size + self.kv_size].reshape(tokens, -1, self.head_dim))
            q, k = self.rotate(q, *rope), self.rotate(k, *rope)
        else:  # q and k sit side by side in the fused output: rotate both in one pass
            qk = self.rotate(qkv[:, : self.q_size + self.kv_size].view(tokens, -1, self.head_dim), *rope)
            q, k = qk[:, :heads], qk[:, heads:]
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config, quant: QuantConfig, dtype: torch.dtype, prefix: str,
                 intermediate_size: int | None = None, reduce_results: bool = True) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        size = intermediate_size or config.intermediate_size  # an expert's own (core/layers/moe.py)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size] * 2, bias=bias, params_dtype=dtype, quant_config=quant,
            prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, params_dtype=dtype,
                                           quant_config=quant, prefix=f"{prefix}.down_proj",
                                           reduce_results=reduce_results)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"activation {config.hidden_act!r} is not supported (silu only)")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, quant: QuantConfig, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, quant, dtype, f"{prefix}.self_attn")
        if is_sparse_layer(config, layer_idx):
            self.mlp = SparseMoeBlock(config, dtype, f"{prefix}.mlp", lambda size, name: LlamaMLP(
                config, quant, dtype, name, intermediate_size=size, reduce_results=False))
        else:
            self.mlp = LlamaMLP(config, quant, dtype, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, rope, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, quant: QuantConfig, dtype: torch.dtype, prefix: str = "model",
                 context_len: int | None = None) -> None:
        super().__init__()
        self.stage = stage_layers(config)  # a pipeline stage builds only its own layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype) \
            if self.stage.is_first else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, quant, dtype, f"{prefix}.layers.{i}") if i in self.stage else OtherStage()
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if self.stage.is_last else None
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config), context_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None,
                carried: StageCarry | None = None) -> torch.Tensor | StageCarry:
        """`num_layers`: run only the first layers (a draft made of the model itself), then the final norm.
        A pipeline stage after the first starts from the previous stage's `carried` hidden states; one before the
        last returns its own."""
        if carried is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = carried.hidden, carried.residual
        rope = self.rotary_emb(positions, hidden.dtype)
        last = self.stage.last if num_layers is None else num_layers
        for layer in self.layers[self.stage.first:last]:
            hidden, residual = layer(rope, hidden, residual)
        if not self.stage.is_last:
            return StageCarry(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    def __init__(self, config, quant: QuantConfig, dtype: torch.dtype, context_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        quant = quant.with_packed_modules(self.packed_modules_mapping)
        self.model = LlamaModel(config, quant, dtype, context_len=context_len)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype, quant_config=quant) \
            if self.model.stage.is_first else None  # the first stage: the last one's hidden states come back
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if config.model_type == "mixtral":  # its checkpoints' names for the MoE block and an expert's projections
            self.checkpoint_renames = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                                       ".w2.": ".down_proj."}
