"""What every OpenAI-shaped request body shares: the caps on what a request can make the server hold (messages,
tools, a stored system prompt, embedding inputs), strict model configs (unknown fields refused, numbers finite), and
the refusal of a field or content kind this server does not implement (a 400 naming it, never ignored)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo

MAX_MESSAGES = 2048  # per request
MAX_TOOLS = 128  # per request (OpenAI's own limit)
MAX_SYSTEM_PROMPT_CHARS = 100_000  # a conversation's stored system prompt
MAX_COMPLETION_PROMPTS = 256  # a completions batch: each prompt is its own engine request (lm-eval sends batches)
MAX_RERANK_DOCUMENTS = 1000  # Cohere's limit on one rerank request's documents
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs (its embeddings API, Ollama's /api/embed)
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's, for function and response-format names
FORBID = ConfigDict(extra="forbid")
STRICT_NUMBERS = ConfigDict(extra="forbid", allow_inf_nan=False)
MEDIA_PARTS = {"input_audio": "this server takes no audio", "file": "this server takes no files"}


def refuse_kinds(items: Any, refused_kinds: dict[str, str], what: str = "content part") -> Any:
    """A clear refusal, before the list is validated, of a content list's items of a kind this server does not take
    (an image to a text-only model): ValueError "content part 2 is 'image_url': <why>"; else `items` unchanged."""
    for i, item in enumerate(items if isinstance(items, list) else ()):
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind in refused_kinds:
            raise ValueError(f"{what} {i} is {kind!r}: {refused_kinds[kind]}")
    return items


def refused(reason: str) -> Any:
    """An OpenAI field this server does not serve, typed None: null is the same as absent, anything else a
    400 naming it that says `reason` (read back from the schema's description by `refuse_given`)."""
    return Field(default=None, description=f"Not supported: {reason}.")


def refuse_given(value: Any, info: ValidationInfo, model: type[BaseModel]) -> None:
    """The check behind `refused` fields, run by a field validator in mode="before" (before the None type
    check, whose own message would not say why)."""
    if value is not None:
        reason = model.model_fields[info.field_name].description or "Not supported."
        raise ValueError(reason[0].lower() + reason[1:].rstrip("."))
