"""An HF vision-language model (Idefics3 / SmolVLM, Gemma 3) as the two GGUF files llama.cpp runs it from, as its
convert_hf_to_gguf.py writes them. Gemma 3: the text model `Gemma3Model` (architecture gemma3, every norm stored as
1 + weight, the head tied), the projector `Gemma3VisionModel` (projector type gemma3, its soft_emb_norm stored as
1 + weight, the pooling scale written where it is not 4). SmolVLM: the text model: `LlamaModel` (architecture llama;
SmolVLM's `text_model.` prefix dropped, Q / K rows permuted, a `rope_freqs` tensor for llama3 rope scaling,
`_set_vocab_gpt2`'s tokenizer: the embedded model's fields with the added tokens appended, special ones CONTROL) plus
the chat template and <end_of_utterance> (the generation config's eos) as eos. The projector (`--mmproj`):
`SmolVLMModel(MmprojModel)` (architecture clip, projector type idefics3, the vision tower and connector under gguf's
TensorNameMap names, the embeddings F32, the rest F32 or F16).

transformers' GGUF reader ignores `rope_freqs`: compare logits through it with a plain rope
(`save_tiny_idefics3(..., plain_rope=True)`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from gguf import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    GGUFType,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    TokenType,
    VisionProjectorType,
    get_tensor_name_map,
)

SUFFIXES = (".weight", ".bias")


def add_decoder_fields(writer: GGUFWriter, config) -> None:
    """The shape fields convert_hf_to_gguf.py writes for any decoder, from an HF config."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def permute_qk(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's two rotary halves interleaved."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def write_smolvlm_gguf_pair(model, processor, directory: Path, text_name: str = "SmolVLM-tiny-F32.gguf",
                            mmproj_name: str = "mmproj-SmolVLM-tiny-F32.gguf",
                            mmproj_f16: bool = False) -> tuple[Path, Path]:
    """`model` (a tiny HF Idefics3ForConditionalGeneration) and its `processor` as `directory / text_name` (llama) and
    `directory / mmproj_name` (clip; its matrices F16 with `mmproj_f16`, the embeddings and vectors always F32)."""
    return (_write_text(model, processor, Path(directory) / text_name),
            _write_mmproj(model, processor, Path(directory) / mmproj_name, mmproj_f16))


def write_gemma3_gguf_pair(model, processor, gemma_gguf: Path, directory: Path,
                           text_name: str = "gemma-3-tiny-F32.gguf",
                           mmproj_name: str = "mmproj-gemma-3-tiny-F16.gguf") -> tuple[Path, Path]:
    """`model` (a tiny HF Gemma3ForConditionalGeneration from save_tiny_gemma3_vision with `gemma_gguf`'s tokenizer)
    and its `processor` as `directory / text_name` (gemma3, F32, `gemma_gguf`'s tokenizer fields) and
    `directory / mmproj_name` (clip, its matrices F16)."""
    return (_write_gemma3_text(model, processor, gemma_gguf, Path(directory) / text_name),
            _write_mmproj(model, processor, Path(directory) / mmproj_name, True))


def _write_gemma3_text(model, processor, gemma_gguf: Path, path: Path) -> Path:
    config = model.config.text_config
    writer = GGUFWriter(str(path), MODEL_ARCH_NAMES[MODEL_ARCH.GEMMA3])
    writer.add_type(GGUFType.MODEL)
    rope = dict(config.rope_parameters["full_attention"])
    add_decoder_fields(writer, SimpleNamespace(**config.to_dict() | {"rope_parameters": rope}))  # the global base
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_vocab_size(config.vocab_size)
    for key, value, kind, sub in _tokenizer_fields(model, processor, gemma_gguf):
        writer.add_key_value(key, value, GGUFValueType(kind), GGUFValueType(sub) if sub is not None else None)
    names = get_tensor_name_map(MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if not name.startswith("model.language_model."):  # the tower, the projector and the tied head
            continue
        name = name.replace("model.language_model.", "model.")
        values = tensor.detach().float().numpy()
        if name.endswith("norm.weight"):  # Gemma3Model.modify_tensors: llama.cpp multiplies by the weight itself
            values = values + 1
        writer.add_tensor(names.get_name(name, try_suffixes=SUFFIXES), np.ascontiguousarray(values))
    return _close(writer, path)


def _write_text(model, processor, path: Path) -> Path:
    config = model.config.text_config
    writer = GGUFWriter(str(path), MODEL_ARCH_NAMES[MODEL_ARCH.LLAMA])
    writer.add_type(GGUFType.MODEL)
    add_decoder_fields(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    for key, value, kind, sub in _tokenizer_fields(model, processor):
        writer.add_key_value(key, value, GGUFValueType(kind), GGUFValueType(sub) if sub is not None else None)
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if "vision_model" in name or "model.connector" in name:
            continue
        name = name.replace("text_model.", "")  # LlamaModel.filter_tensors, for SmolVLM
        values = tensor.detach().float().numpy()
        if name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
            values = permute_qk(values, config.num_attention_heads if "q_proj" in name else config.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=SUFFIXES), np.ascontiguousarray(values))
    if config.rope_parameters.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors: plain / scaled
        rotary = model.model.text_model.rotary_emb
        plain = 1.0 / config.rope_parameters["rope_theta"] ** (
            torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
        writer.add_tensor("rope_freqs.weight", (plain / rotary.inv_freq.float()).numpy())
    return _close(writer, path)


def _tokenizer_fields(model, processor, source: Path | None = None) -> list[tuple[str, object, int, int | None]]:
    """The tokenizer fields of `source` (a GGUF; None: the embedded model's), the tokens past its vocabulary appended
    as get_vocab_base marks them (special added tokens CONTROL, other added ones USER_DEFINED, ids with no token
    UNUSED `[PAD<id>]`; a SentencePiece vocabulary's scores -1000); eos the generation config's, the processor's
    chat template (where it has one)."""
    from kvforge.app.bench.real_shapes import tokenizer_fields
    from kvforge.core.loader import embedded_gguf_path

    tokenizer = processor.tokenizer
    eos = model.generation_config.eos_token_id
    replaced = {"tokenizer.ggml.eos_token_id": eos[0] if isinstance(eos, list) else eos}
    if processor.chat_template or tokenizer.chat_template:
        replaced["tokenizer.chat_template"] = processor.chat_template or tokenizer.chat_template
    fields = [(key, replaced.get(key, value), kind, sub) for key, value, kind, sub in tokenizer_fields(
        source or embedded_gguf_path())]
    tokens = next(value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens")
    types = next(value for key, value, _, _ in fields if key == "tokenizer.ggml.token_type")
    scores = next((value for key, value, _, _ in fields if key == "tokenizer.ggml.scores"), None)
    for i in range(len(tokens), model.config.text_config.vocab_size):
        added = tokenizer.added_tokens_decoder.get(i)
        tokens.append(added.content if added else f"[PAD{i}]")
        types.append(TokenType.UNUSED if added is None else TokenType.CONTROL if added.special
                     else TokenType.USER_DEFINED)
        if scores is not None:
            scores.append(-1000.0)
    return fields


def _write_mmproj(model, processor, path: Path, f16: bool) -> Path:
    vision, images = model.config.vision_config, processor.image_processor
    gemma = model.config.model_type == "gemma3"
    writer = GGUFWriter(str(path), MODEL_ARCH_NAMES[MODEL_ARCH.MMPROJ])
    writer.add_type(GGUFType.MMPROJ)
    writer.add_file_type(LlamaFileType.MOSTLY_F16 if f16 else LlamaFileType.ALL_F32)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(model.config.text_config.hidden_size)
    writer.add_vision_image_size(vision.image_size)
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    writer.add_vision_block_count(vision.num_hidden_layers)
    writer.add_vision_head_count(vision.num_attention_heads)
    writer.add_vision_image_mean([float(v) for v in images.image_mean])
    writer.add_vision_image_std([float(v) for v in images.image_std])
    writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
    writer.add_vision_use_gelu(True)
    if gemma:
        writer.add_clip_projector_type(VisionProjectorType.GEMMA3)
        scale = vision.image_size // vision.patch_size // int(model.config.mm_tokens_per_image ** 0.5)
        if scale != 4:  # Gemma3VisionModel.set_gguf_parameters: 4 is the default
            writer.add_vision_projector_scale_factor(scale)
    else:
        writer.add_clip_projector_type(VisionProjectorType.IDEFICS3)
        writer.add_vision_projector_scale_factor(model.config.scale_factor)
        writer.add_vision_preproc_image_size(images.size.get("longest_edge", vision.image_size))
    names = get_tensor_name_map(MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if gemma:
            if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
                continue
            # Gemma3VisionModel.modify_tensors: transformers 4's names, _weight as .weight, the norm as 1 + weight
            name = name.replace("model.vision_tower.", "vision_tower.vision_model.").replace(
                "model.multi_modal_projector.", "multi_modal_projector.").replace("_weight", ".weight")
        elif "vision_model" not in name and "model.connector" not in name:
            continue
        values = tensor.detach().float().numpy()
        if "soft_emb_norm" in name:
            values = values + 1
        if f16 and values.ndim > 1 and ".embeddings." not in name:  # tensor_force_quant: the matrices F16
            values = values.astype(np.float16)
        writer.add_tensor(names.get_name(name, try_suffixes=SUFFIXES), np.ascontiguousarray(values))
    return _close(writer, path)


def _close(writer: GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

