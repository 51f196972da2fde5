"""The model's HF tokenizer and chat template, and an incremental detokenizer.

Streaming text must never carry half of a UTF-8 character (an emoji or CJK character can span
several byte-fallback tokens): tokenizers' DecodeStream buffers such tokens until they form
valid text, which is exactly the job, so we use it rather than re-implementing offsets.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from tokenizers.decoders import DecodeStream

from kvforge.core.images import ImagePrompt
from kvforge.core.sandbox.pool import render_template


class Tokenizer:
    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(path)
        self.eos_token_ids = self._eos_ids(path)
        self.path = path
        config = path / "config.json"
        # a vision-language model's: its processor expands each picture's placeholder into the image's tokens
        self.takes_images = config.exists() and "vision_config" in json.loads(config.read_text())

    def _eos_ids(self, path: Path) -> set[int]:
        ids: set[int] = set()
        generation_config = path / "generation_config.json"
        if generation_config.exists():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        return ids

    def fingerprint(self) -> str:
        """Identifies the vocabulary, normalisation and chat template (part of the KV hash root)."""
        content = self.hf.backend_tokenizer.to_str() + (self.hf.chat_template or "")
        return hashlib.sha256(content.encode()).hexdigest()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token in characters (added tokens included): a text longer than N times this cannot
        be fewer than N tokens, so an over-long prompt is refused before it is tokenized. A vocabulary entry
        never decodes to more characters than it has (byte-level and SentencePiece pieces map one character
        to at most one character)."""
        pieces = list(self.hf.get_vocab()) + [str(t) for t in self.hf.added_tokens_decoder.values()]
        return max(map(len, pieces), default=1)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    @functools.cached_property
    def processor(self):
        """The model's HF processor (tokenizer and image processor; PIL's image processing: no torchvision needed)."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(self.path, backend="pil")

    def encode_with_images(self, text: str, pictures: list, digests: list[bytes]) -> ImagePrompt:
        """A rendered prompt with one image placeholder per picture (PIL images, in order), tokenized by the model's
        processor: each placeholder expanded into its image's tokens, each picture's ImageInput (core/images.py)."""
        from kvforge.core.models.registry import vision_family

        if not self.takes_images:
            raise ValueError("this model takes no images (it has no vision tower)")
        architectures = json.loads((self.path / "config.json").read_text()).get("architectures")
        return vision_family(architectures).image_prompt(self.processor, text, pictures, digests)

    @property
    def image_placeholder(self) -> str | None:
        """What a chat template writes where a picture goes (None: the model takes no images)."""
        return self.processor.image_token if self.takes_images else None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None,
                            add_special_tokens: bool = False) -> list[int]:
        """`tools`: OpenAI's tool definitions, for templates that render them; `template_kwargs`: more variables
        for the template (e.g. enable_thinking)."""
        text = self.chat_text(messages, add_generation_prompt, tools, template_kwargs)
        # The rendered template already holds every special token it needs (unless asked, none are added).
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                  template_kwargs: dict | None = None) -> str:
        """The chat template's rendering, as text (apply_chat_template's ids are its encoding): the text HF's
        apply_chat_template renders, in a sandbox worker with bounded work (core/sandbox/templates.py); ValueError
        (SandboxRefused) when the template refuses the conversation or runs past a limit."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        # the variables HF's apply_chat_template gives the template, in its order of precedence
        context = {**self.hf.special_tokens_map, **(template_kwargs or {}), "messages": template_messages(messages),
                   "tools": tools, "documents": None, "add_generation_prompt": add_generation_prompt}
        return render_template(self.hf.get_chat_template(None, tools), context)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # HF's names for a message's reasoning


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as HF's apply_chat_template hands them to a template: keys whose value is None dropped (templates
    handle a missing key, not a None), the reasoning under every name templates read (reasoning_content, and
    thinking for gpt-oss's)."""
    shown = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        shown.append(message)
    return shown


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text deltas that are always valid UTF-8."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.hf.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def step(self, token_id: int) -> str:
        delta = self._stream.step(self._backend, token_id) or ""
        self.text += delta
        return delta
