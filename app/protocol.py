"""OpenAI-compatible request bodies (pydantic) and their translation into SamplingParams.

Unknown fields are ignored (clients send many); known ones are validated, and any error becomes an
HTTP 400 in OpenAI's error shape naming the field. Numbers must be finite; what a request can make the
server hold or repeat is capped: messages per request, stop strings (number and length), a stored
system prompt. The bounds of sampling fields are SamplingParams' (core/sampling.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvforge.core.sampling import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
)

MAX_MESSAGES = 2048  # per request
MAX_SYSTEM_PROMPT_CHARS = 100_000  # a conversation's stored system prompt
STRICT_NUMBERS = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = ""

    @field_validator("content")
    @classmethod
    def _text_parts_are_strings(cls, content):
        for part in content if isinstance(content, list) else ():
            if part.get("type") == "text" and not isinstance(part.get("text", ""), str):
                raise ValueError("a text content part's 'text' must be a string")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


StopStrings = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI names, plus extras)."""

    model_config = STRICT_NUMBERS
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: StopStrings | Annotated[list[StopStrings], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed takes
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    # extras beyond OpenAI's schema (vLLM-style)
    top_k: int = Field(default=0, ge=-1, le=2**63 - 1)  # the sampler holds it in an int64 tensor
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False

    def sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed,
            max_tokens=self.requested_max_tokens() or default_max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, ignore_eos=self.ignore_eos, logprobs=logprobs)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class LoadModelRequest(BaseModel):
    """POST /admin/models/load: a model in the models directory (or the embedded default) and options."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    quant: str = "none"
    quant_options: dict[str, Any] = Field(default_factory=dict)
    served_model_name: str | None = None
    kv_cache_gb: float | None = Field(default=None, ge=1 / 1024, le=4096)  # at least 1 MiB
    decoding: str = "none"  # a speculative decoding plugin
    decoding_options: dict[str, Any] = Field(default_factory=dict)
    tp: int | None = Field(default=None, ge=1)  # tensor-parallel ranks; None: the server's --tp


class SessionSettings(BaseModel):
    """A conversation's own settings: its system prompt and sampling defaults (SamplingFields names)."""

    model_config = ConfigDict(extra="forbid")
    system_prompt: str | None = Field(default=None, max_length=MAX_SYSTEM_PROMPT_CHARS)
    sampling: dict[str, Any] = Field(default_factory=dict)

    @field_validator("sampling")
    @classmethod
    def _known_valid_sampling(cls, sampling: dict[str, Any]) -> dict[str, Any]:
        return check_sampling(sampling)


def check_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """A conversation's sampling settings: SamplingFields names with the same bounds as a request's."""
    allowed = set(SamplingFields.model_fields) - {"model", "stream", "stream_options", "n"}
    unknown = sorted(set(sampling) - allowed)
    if unknown:
        raise ValueError(f"unknown sampling settings {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")
    fields = SamplingFields.model_validate(sampling)
    # and SamplingParams' own checks (non-empty stop strings, min_tokens <= max_tokens), or every message
    # of the session would be rejected; a max_tokens left to each reply's default is not checked here
    fields.sampling_params(max(1, fields.min_tokens), None)
    return sampling


class SessionCreateRequest(SessionSettings):
    title: str = Field(default="New chat", min_length=1, max_length=200)


class SessionUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str | None = Field(default=None, min_length=1, max_length=200)
    system_prompt: str | None = Field(default=None, max_length=MAX_SYSTEM_PROMPT_CHARS)
    sampling: dict[str, Any] | None = None

    @field_validator("sampling")
    @classmethod
    def _valid_sampling(cls, sampling: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if sampling is None else check_sampling(sampling)


class SessionMessageRequest(SamplingFields):
    """POST /v1/sessions/{id}/messages: the user's message; fields given here override the
    conversation's sampling settings for this reply. Streams by default."""

    content: str = Field(min_length=1)
    stream: bool = True
