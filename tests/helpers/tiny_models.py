"""Tiny random-weight models of each architecture (Llama 3 rope scaling, Mistral sliding window, Qwen2 qkv
bias, Qwen3 q/k norms, Gemma 2 soft-capping (caps small enough to bend every score), Gemma 3's alternating
windows, Phi-3 / Phi-4-mini's fused checkpoint tensors, long-rope and partial rotary dimension; the mixture-of-experts
families: Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE renormalising its top-k, Mixtral, OLMoE with
its whole-projection q/k norms and q/k/v clipping), built from configs and saved with the embedded model's
tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kvforge.app.bench.vision_shapes import smolvlm_tokenizer
from kvforge.core.gguf_mmproj import GEMMA3_TOKENS

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-6)


def tiny_configs() -> dict:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    # untied: with the tied head and sqrt(hidden)-scaled embeddings a random Gemma repeats its last input token
    gemma = dict(COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                 hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False)

    return {
        "llama3": LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, tie_word_embeddings=False),
        "mistral": MistralConfig(**COMMON, sliding_window=16, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
        "gemma2": Gemma2Config(**gemma, attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
        "gemma3": Gemma3TextConfig(**gemma, layer_types=["sliding_attention", "full_attention"], rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
        "phi3": phi3_config(original_context=COMMON["max_position_embeddings"]),
        **moe_configs(Qwen2MoeConfig, Qwen3MoeConfig, MixtralConfig, OlmoeConfig),
    }


MOE_NAMES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")


def moe_configs(qwen2_moe, qwen3_moe, mixtral, olmoe) -> dict:
    """8 experts (Mixtral 4), 2 a token, experts narrower than the dense MLP; Qwen2-MoE's second layer dense."""
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    return {
        "qwen2_moe": qwen2_moe(**COMMON, **experts, shared_expert_intermediate_size=48, mlp_only_layers=[1],
                               qkv_bias=True, tie_word_embeddings=False),
        "qwen3_moe": qwen3_moe(**COMMON, **experts, head_dim=32, norm_topk_prob=True, tie_word_embeddings=False),
        "mixtral": mixtral(**dict(COMMON, intermediate_size=32), num_local_experts=4, num_experts_per_tok=2,
                           tie_word_embeddings=False),
        "olmoe": olmoe(**dict(COMMON, intermediate_size=32), num_experts=8, num_experts_per_tok=2, clip_qkv=3.0,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    }


def phi3_config(original_context: int):
    """Phi-4-mini's shape in small: 3/4 of each head turns, long-rope factors (short and long differ), a window on
    every layer, tied embeddings. With `original_context` below max_position_embeddings the long factors apply
    past it (and an attention factor from the ratio); at max_position_embeddings only the short ones ever do, as
    transformers chooses them, so a prompt of any length compares with it exactly (the explicit attention factor
    is then the scaling under test)."""
    from transformers import Phi3Config

    turned = int(COMMON["hidden_size"] // COMMON["num_attention_heads"] * 0.75) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": original_context,
            "short_factor": [1.0 + 0.1 * i for i in range(turned)],
            "long_factor": [2.0 + 0.5 * i for i in range(turned)]}
    if original_context == COMMON["max_position_embeddings"]:
        rope["attention_factor"] = 1.19
    return Phi3Config(**COMMON, rope_parameters=rope, original_max_position_embeddings=original_context,
                      sliding_window=32, tie_word_embeddings=True)


# the reference's attention: transformers' SDPA path drops Gemma 2's soft-capping (eager applies it)
ATTENTION = {"gemma2": "eager"}


def save_tiny_model(name: str, path: Path, embedded_path: Path, seed: int, config=None, chat_template: bool = False):
    """Build the `name` model (or `config`'s) with random weights (seeded), save it with the embedded tokenizer (and,
    with `chat_template`, the embedded chat template: a model served to chat clients) to `path`; returns the HF
    model (fp32, eval) as the reference."""
    from transformers import AutoModelForCausalLM

    config = config or tiny_configs()[name]
    config.vocab_size = 49152
    config.architectures = [config.__class__.__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation=ATTENTION.get(name, "sdpa")).eval()
    model.save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json") + (("chat_template.jinja",) if chat_template else ()):
        shutil.copy(embedded_path / file, path / file)
    return model


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def save_tiny_embedding_model(path: Path, embedded_path: Path, seed: int, pooling: str = "pooling_mode_lasttoken",
                              normalize: bool = True):
    """A sentence-transformers embedding checkpoint as Qwen3-Embedding ships one: the bare Qwen3 model (no head,
    `architectures: ["Qwen3Model"]`, random weights, seeded), modules.json and 1_Pooling/config.json with `pooling`
    (and a Normalize module when `normalize`), the embedded tokenizer. Returns the HF model (fp32, eval)."""
    from transformers import AutoModel

    config = tiny_configs()["qwen3"]
    config.vocab_size = 49152
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_path / file, path / file)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": config.hidden_size, pooling: True, "include_prompt": True}))
    return model


def save_tiny_idefics3(path: Path, embedded_path: Path, seed: int, plain_rope: bool = False):
    """A tiny random Idefics3 / SmolVLM (a 2-layer SigLIP tower on 32-pixel tiles of 8-pixel patches, pixel shuffle 2:
    4 rows a tile; the tiny Llama decoder) saved with the embedded tokenizer plus Idefics3's image tokens and an HF
    processor (PIL image processor: pictures up to 64 pixels split into 32-pixel tiles and a global view). Returns
    the HF model (fp32, eval) and the processor. SmolVLM's chat template, and <end_of_utterance> ends a reply.
    `plain_rope`: the decoder's rope without Llama 3's scaling (a GGUF read back by transformers ignores rope_freqs)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = smolvlm_tokenizer(embedded_path)
    text = tiny_configs()["llama3"].to_dict() | {"vocab_size": len(tokenizer)}
    if plain_rope:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8, initializer_range=0.3)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2, tie_word_embeddings=False,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    model.save_pretrained(path)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}),
        tokenizer=tokenizer, image_seq_len=4, chat_template=tokenizer.chat_template)
    processor.save_pretrained(path)
    return model, processor


# Gemma 3's chat template in short (content parts: its text, "<start_of_image>" for each picture; "model" turns)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def save_tiny_gemma3_vision(path: Path, embedded_path: Path, seed: int, gemma_gguf: Path | None = None):
    """A tiny random Gemma 3 vision-language model (a 2-layer SigLIP tower on 64-pixel squares of 8-pixel patches,
    average-pooled 2 x 2 into 16 soft tokens a picture; the tiny Gemma 3 decoder with its 16-token sliding window)
    saved with the embedded tokenizer plus Gemma 3's image and turn tokens and an HF processor (PIL image processor).
    Returns the HF model (fp32, eval) and the processor. A Gemma 3 chat template; <end_of_turn> ends a reply.
    `gemma_gguf` (a Gemma 3 GGUF file): its tokenizer instead (Gemma's own vocabulary and chat template, the image soft
    token added past it as transformers' Gemma 3 tokenizer has it), and the decoder as a Gemma 3 GGUF can describe it
    (transformers' reader takes the rest from Gemma 3's defaults): a tied head, query_pre_attn_scalar 256, both
    layers sliding (the full one is every 6th)."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    if gemma_gguf is None:
        tokenizer = AutoTokenizer.from_pretrained(embedded_path, extra_special_tokens=GEMMA3_TOKENS)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
        tokenizer.chat_template = GEMMA3_TEMPLATE
    else:
        from kvforge.core.loader import resolve_model

        # the tokenizer of the file's index (written once per file version; transformers' own GGUF conversion of
        # Gemma's 262k tokens takes half a minute)
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(str(gemma_gguf)),
                                                  extra_special_tokens=GEMMA3_TOKENS)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    gguf_shape = gemma_gguf is not None
    text = tiny_configs()["gemma3"].to_dict() | {"vocab_size": len(tokenizer)}
    if gguf_shape:
        text |= {"query_pre_attn_scalar": 256, "layer_types": ["sliding_attention"] * 2, "tie_word_embeddings": True}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=8, initializer_range=0.3, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                          boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                          image_token_index=tokenizer.image_token_id, tie_word_embeddings=gguf_shape)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # a projector weight of the reference's scale (its init is zeros: every picture alike)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)
        model.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0, 0.3)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    model.save_pretrained(path)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 64, "width": 64}),
                                tokenizer=tokenizer, image_seq_length=16, chat_template=tokenizer.chat_template)
    processor.save_pretrained(path)
    return model, processor
