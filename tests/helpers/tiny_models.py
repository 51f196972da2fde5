"""Tiny random-weight models of each architecture (Llama 3 rope scaling, Mistral sliding window, Qwen2 qkv
bias, Qwen3 q/k norms), built from configs and saved with the embedded model's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-6)


def tiny_configs() -> dict:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama3": LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, tie_word_embeddings=False),
        "mistral": MistralConfig(**COMMON, sliding_window=16, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
    }


def save_tiny_model(name: str, path: Path, embedded_path: Path, seed: int):
    """Build the `name` model with random weights (seeded), save it with the embedded tokenizer to `path`;
    returns the HF model (fp32, eval) as the reference."""
    from transformers import AutoModelForCausalLM

    config = tiny_configs()[name]
    config.vocab_size = 49152
    config.architectures = [config.__class__.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_path / file, path / file)
    return model


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]
