"""A "thinking" variant of the embedded model for the reasoning tests: its weights, a DeepSeek-R1-style template
ending the generation prompt with `<think>\\n`, and `<think>` / `</think>` as single, non-special tokens.

No reasoning model is available offline, so two of SmolLM2's unused added tokens are renamed to the markers. The
weights never learnt `</think>`: a reply closes the block only when a logit bias pushes it."""

from __future__ import annotations

import json
import os
from pathlib import Path

START_ID, END_ID = 6, 5  # SmolLM2's <filename>, <file_sep>: renamed <think>, </think>
TEMPLATE = (  # ChatML; DeepSeek-R1's open think block, or Qwen3's closed empty one when enable_thinking is false
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")


def thinking_model(directory: Path) -> Path:
    """The embedded model's directory with the think markers renamed into its tokenizer and TEMPLATE."""
    from kvforge.core.loader import resolve_model

    source = Path(resolve_model(None))
    directory.mkdir()
    (directory / "config.json").write_text((source / "config.json").read_text())
    (directory / "tokenizer_config.json").write_text((source / "tokenizer_config.json").read_text())
    os.symlink(source / "model.safetensors", directory / "model.safetensors")  # 0.5 GB: not copied
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    renames = {START_ID: "<think>", END_ID: "</think>"}
    for token in tokenizer["added_tokens"]:
        if token["id"] in renames:
            vocab = tokenizer["model"]["vocab"]
            assert vocab.pop(token["content"]) == token["id"]
            token["content"] = renames[token["id"]]
            vocab[token["content"]] = token["id"]
            token["special"] = False  # decoding keeps them: the reader must see `</think>` in the text
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return directory
