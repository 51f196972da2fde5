"""Gemma 2 and Gemma 3 (text) on the paged KV cache, in the Llama family's structure (core/models/llama.py): fused
q/k/v and gate/up projections, the same attention layer and loader seams.

What Gemma does differently, each as transformers' Gemma2ForCausalLM / Gemma3ForCausalLM computes it (the parity
tests' reference):
- RMSNorm scales by (1 + weight) and multiplies in fp32 before casting back (`GemmaRMSNorm`);
- four norms per layer: before and after attention, before and after the MLP (post-norms, then the residual add);
- attention scaled by query_pre_attn_scalar ** -0.5; Gemma 3: per-head q / k RMSNorm before the rotary embedding;
- sliding-window layers and global ones (`layer_types`); Gemma 3 gives each its own rope base (`rope_parameters`
  per layer type: 10k local, 1M global);
- GeGLU MLP (gelu, tanh approximation); embeddings scaled by sqrt(hidden_size) rounded to the model dtype;
- Gemma 2: attention scores soft-capped (attn_logit_softcapping: cap * tanh(s / cap), in every attention path,
  core/layers/attention.py) and the final logits too (final_logit_softcapping; None for Gemma 3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core.distributed import pool_layer, stage_layers
from kvforge.core.layers.attention import Attention
from kvforge.core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvforge.core.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvforge.core.layers.rotary import RotaryEmbedding, rotate
from kvforge.core.models.causal_lm import CausalLM, OtherStage, StageCarry
from kvforge.core.models.llama import head_dim_of, sliding_window_of
from kvforge.core.quant_config import QuantConfig

ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), in fp32, cast to x's dtype at the end. The weight is kept in
    fp32 as 1 + weight (what the reference multiplies by; exact, as the reference adds in fp32 too)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(1.0 + loaded.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), self.weight.shape, None, self.eps) * self.weight).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, quant: QuantConfig, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, params_dtype=dtype,
                                          quant_config=quant, prefix=f"{prefix}.qkv_proj")
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads = heads.q_count, heads.kv_count
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        params_dtype=dtype,
                                        input_shard=(heads.q_first * self.head_dim, heads.q_count * self.head_dim),
                                        quant_config=quant, prefix=f"{prefix}.o_proj")
        self.qk_norm = config.model_type != "gemma2"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, config.query_pre_attn_scalar ** -0.5,
                              sliding_window_of(config, layer_idx),
                              layer_index=pool_layer(layer_idx, config),
                              softcap=getattr(config, "attn_logit_softcapping", None))
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        tokens = qkv.shape[0]
        q = qkv[:, : self.q_size].reshape(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].reshape(tokens, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(rotate(q, *rope), rotate(k, *rope), v))


class GemmaMLP(nn.Module):
    def __init__(self, config, quant: QuantConfig, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       params_dtype=dtype, quant_config=quant,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, params_dtype=dtype,
                                           quant_config=quant, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, quant: QuantConfig, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.sliding = sliding_window_of(config, layer_idx) is not None
        self.self_attn = GemmaAttention(config, layer_idx, quant, dtype, f"{prefix}.self_attn")
        self.mlp = GemmaMLP(config, quant, dtype, f"{prefix}.mlp")
        eps = config.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps), \
            GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps), \
            GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]], hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(ropes[self.sliding],
                                                                       self.input_layernorm(hidden)))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class _LayerTypeConfig:
    """The config as one layer type sees it: its own rope parameters (Gemma 3 keys them by layer type; Gemma 2
    shares one set)."""

    def __init__(self, config, layer_type: str) -> None:
        self._config, self._layer_type = config, layer_type

    def __getattr__(self, name: str):
        value = getattr(self._config, name)
        if name == "rope_parameters" and isinstance(value, dict) and self._layer_type in value:
            return value[self._layer_type]
        return value


class GemmaModel(nn.Module):
    def __init__(self, config, quant: QuantConfig, dtype: torch.dtype, prefix: str = "model") -> None:
        super().__init__()
        self.stage = stage_layers(config)  # a pipeline stage builds only its own layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype) \
            if self.stage.is_first else None
        self.embed_scale = config.hidden_size ** 0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, quant, dtype, f"{prefix}.layers.{i}")
                                    if i in self.stage else OtherStage() for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if self.stage.is_last else None
        head_dim = head_dim_of(config)
        self.rotary = nn.ModuleDict({
            "sliding": RotaryEmbedding(_LayerTypeConfig(config, "sliding_attention"), head_dim),
            "full": RotaryEmbedding(_LayerTypeConfig(config, "full_attention"), head_dim)})

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)  # rounded as the reference does

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None,
                carried: StageCarry | None = None) -> torch.Tensor | StageCarry:
        """As LlamaModel.forward (a pipeline stage's `carried` hidden states in, its own out)."""
        if carried is None:
            hidden = self.embed(input_ids)
        else:
            hidden = carried.hidden
        ropes = {True: self.rotary["sliding"](positions, hidden.dtype),
                 False: self.rotary["full"](positions, hidden.dtype)}
        for layer in self.layers[self.stage.first:self.stage.last if num_layers is None else num_layers]:
            hidden = layer(ropes, hidden)
        return self.norm(hidden) if self.stage.is_last else StageCarry(hidden)


class GemmaForCausalLM(CausalLM):
    def __init__(self, config, quant: QuantConfig, dtype: torch.dtype, context_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        quant = quant.with_packed_modules(self.packed_modules_mapping)
        self.model = GemmaModel(config, quant, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype, quant_config=quant) \
            if self.model.stage.is_first else None  # the first stage: the last one's hidden states come back
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
