"""HF `architectures` name -> our model class."""

from __future__ import annotations

from torch import nn

from kvforge.core.models.gemma import GemmaForCausalLM
from kvforge.core.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def model_class_for(config) -> type[nn.Module]:
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    names = getattr(config, "architectures", None) or [config.model_type]
    raise ValueError(f"unsupported architecture {', '.join(names)}; supported: {', '.join(MODEL_CLASSES)}")
