"""HF `architectures` name -> our model class."""

from __future__ import annotations

from types import ModuleType

from torch import nn

from kvforge.core.models import gemma3_vision, idefics3
from kvforge.core.models.gemma import GemmaForCausalLM
from kvforge.core.models.gemma3_vision import Gemma3ForConditionalGeneration
from kvforge.core.models.idefics3 import Idefics3ForConditionalGeneration
from kvforge.core.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "OlmoeForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,  # SmolVLM (1), Idefics3
    "SmolVLMForConditionalGeneration": Idefics3ForConditionalGeneration,  # SmolVLM2: the same model, its own name
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # Gemma 3 4B / 12B / 27B (pictures)
}
# a vision-language family's module: its processor's output as an ImagePrompt (`image_prompt`) and the tower's size
# (`vision_parameter_count`), read where no model is built (the tokenizer, the memory estimate)
VISION_FAMILIES: dict[str, ModuleType] = {
    "Idefics3ForConditionalGeneration": idefics3, "SmolVLMForConditionalGeneration": idefics3,
    "Gemma3ForConditionalGeneration": gemma3_vision,
}
# checkpoints of the bare model without its language-model head, as embedding models ship (Qwen3-Embedding,
# gte-Qwen2, e5-mistral): served with the head tied to the embedding table (see core/loader.py build_model)
BASE_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaModel": LlamaForCausalLM, "MistralModel": LlamaForCausalLM, "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
}


def is_base_model(config) -> bool:
    """A checkpoint of the bare model (no language-model head): `architectures` names only base classes."""
    names = getattr(config, "architectures", None) or []
    return bool(names) and all(name in BASE_MODEL_CLASSES for name in names)


def model_class_for(config) -> type[nn.Module]:
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODEL_CLASSES or arch in BASE_MODEL_CLASSES:
            return MODEL_CLASSES.get(arch) or BASE_MODEL_CLASSES[arch]
    names = getattr(config, "architectures", None) or [config.model_type]
    raise ValueError(f"unsupported architecture {', '.join(names)}; supported: {', '.join(MODEL_CLASSES)}")


def vision_family(architectures: list[str] | None) -> ModuleType:
    for arch in architectures or []:
        if arch in VISION_FAMILIES:
            return VISION_FAMILIES[arch]
    raise ValueError(f"no vision-language family for {', '.join(architectures or []) or 'this model'}; supported: "
                     f"{', '.join(VISION_FAMILIES)}")
