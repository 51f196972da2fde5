"""The models `kvforge bench gpu` runs: random-weight Llama / Qwen2 models of real shapes, built from configs
on the device (nothing is downloaded), tiny ones for --smoke, and the tokenizer they borrow (the embedded
model's, or a synthetic one when it is missing)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

PROMPT_VOCAB = 49152  # prompt ids stay below this (the embedded tokenizer's vocabulary): they fit every model
FIRST_PROMPT_ID = 3  # and above the special ids 0-2
EOS_ID, BOS_ID = 2, 1  # the embedded tokenizer's, used by every model here


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "embedded" | "llama" | "qwen2"
    shape: dict = field(default_factory=dict)  # config kwargs (random-weight models)
    note: str = ""


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
MODELS = {
    "embedded": ModelSpec("embedded", "embedded", note="SmolLM2-135M, the embedded weights"),
    "qwen2-0.5b": ModelSpec("qwen2-0.5b", "qwen2", dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6), note="Qwen2.5-0.5B shape, random weights"),
    "llama-1b": ModelSpec("llama-1b", "llama", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5), note="Llama-3.2-1B shape, random weights"),
    "qwen2-1.5b": ModelSpec("qwen2-1.5b", "qwen2", dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6), note="Qwen2.5-1.5B shape, random weights"),
}
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=PROMPT_VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-6)
SMOKE_MODELS = {
    "tiny-llama": ModelSpec("tiny-llama", "llama", dict(
        _TINY, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=8.0, original_max_position_embeddings=64)), note="tiny, random"),
    "tiny-qwen2": ModelSpec("tiny-qwen2", "qwen2", dict(_TINY, tie_word_embeddings=True), note="tiny, random"),
}


def tokenizer_files(source: Path) -> list[Path]:
    return [p for p in source.iterdir() if p.is_file() and p.name != "config.json"
            and p.name != "generation_config.json" and not p.name.endswith((".safetensors", ".json.index"))
            and not p.name.startswith("model.safetensors")]


def synthetic_tokenizer(target: Path, vocab: int = PROMPT_VOCAB) -> Path:
    """A word-level tokenizer ("t<id>" words; <unk> <s> </s> at 0 1 2) for when the embedded model is missing:
    the random models then still run (prompts are token ids, so the vocabulary's words do not matter)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = {w: i for i, w in enumerate(specials + [f"t{i}" for i in range(len(specials), vocab)])}
    raw = RawTokenizer(models.WordLevel(words, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    target.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(target)
    return target


def tokenizer_source(workdir: Path) -> Path:
    """The embedded model's directory (its tokenizer files), or a synthetic tokenizer when it is missing."""
    from kvforge.core.loader import ModelNotFoundError, resolve_model

    try:
        return resolve_model(None)
    except ModelNotFoundError as exc:
        print(f"embedded model unavailable ({exc}); random models use a synthetic tokenizer", flush=True)
        return synthetic_tokenizer(workdir / "synthetic-tokenizer")


def hf_config(spec: ModelSpec):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[spec.family]
    config = cls(**spec.shape, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return config


def build_random_model(spec: ModelSpec, target: Path, device: str, dtype: torch.dtype, tokenizer_dir: Path):
    """A random-weight HF model of `spec`'s shape, built on `device` (HF's std-0.02 init, plus random biases and
    norm weights so those paths are exercised too), saved as config.json + model.safetensors + the embedded
    tokenizer's files into `target`. Returns the HF model (left on the device)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = hf_config(spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(device).eval()  # a no-op when from_config honoured the device context
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # HF starts biases at zero: Qwen2's qkv bias would test nothing
                param.normal_(0.0, 0.02)
            elif "norm" in name:  # and norm weights at one
                param.normal_(1.0, 0.1)
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    target.mkdir(parents=True, exist_ok=True)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    del state
    model.config.save_pretrained(target)
    for path in tokenizer_files(tokenizer_dir):
        shutil.copy(path, target / path.name)
    return model
