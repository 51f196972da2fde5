"""The vision bench's model: random weights of SmolVLM-256M-Instruct's shape (SigLIP-base tower on 512-pixel tiles of
16-pixel patches, pixel shuffle 4 into 64 rows a tile, SmolLM2-135M's decoder) with the embedded tokenizer plus
Idefics3's image tokens and SmolVLM's chat template, as a safetensors checkpoint (HF transformers reads it) and as
llama.cpp's GGUF pair (hf_to_gguf.py): written once into the shapes cache, and a random 1024 x 768 picture (12 tiles
and the global view: 832 image tokens)."""

from __future__ import annotations

import io
from pathlib import Path

FORMAT_VERSION = "1"  # bump when what the files hold changes: the cache then writes new ones

# SmolVLM-256M-Instruct's chat template (content parts: its text, "<image>" for each picture)
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                   *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
TEXT = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512,
              patch_size=16)


def smolvlm_tokenizer(embedded_path: Path):
    """The embedded model's tokenizer with Idefics3's image tokens and SmolVLM's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_path)
    tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
    tokenizer.chat_template = SMOLVLM_TEMPLATE
    return tokenizer


def smolvlm_shape(root: Path, log=None) -> tuple[Path, Path, Path]:
    """(the safetensors checkpoint directory, the GGUF text file, its mmproj beside it) under `root`, written on first
    use (seeded: the same weights every time)."""
    out = root / f"smolvlm-256m-shape-v{FORMAT_VERSION}"
    checkpoint, pair = out / "checkpoint", out / "gguf"
    text, mmproj = pair / "SmolVLM-256M-shape-F32.gguf", pair / "mmproj-SmolVLM-256M-shape-F16.gguf"
    if not mmproj.exists():
        if log:
            log(f"writing a SmolVLM-256M-shaped random model to {out} (once)")
        _write(checkpoint, pair, text.name, mmproj.name)
    return checkpoint, text, mmproj


def _write(checkpoint: Path, pair: Path, text_name: str, mmproj_name: str) -> None:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from kvforge.app.bench.hf_to_gguf import write_smolvlm_gguf_pair
    from kvforge.core.loader import resolve_model

    tokenizer = smolvlm_tokenizer(resolve_model(None))
    config = Idefics3Config(vision_config=VISION, text_config=TEXT | {"vocab_size": len(tokenizer)}, scale_factor=4,
                            tie_word_embeddings=True, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    processor = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(
        size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}), tokenizer=tokenizer, image_seq_len=64,
        chat_template=SMOLVLM_TEMPLATE)
    checkpoint.mkdir(parents=True, exist_ok=True)
    pair.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(checkpoint)
    processor.save_pretrained(checkpoint)
    write_smolvlm_gguf_pair(model, processor, pair, text_name, mmproj_name, mmproj_f16=True)


def random_picture(path: Path, width: int = 1024, height: int = 768) -> Path:
    """A random RGB PNG (noise: nothing a codec shrinks), written once."""
    if not path.exists():
        import numpy as np
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
            buffer, format="PNG")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buffer.getvalue())
    return path
