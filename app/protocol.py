"""OpenAI-compatible request bodies (pydantic) and their translation into SamplingParams.

Unknown fields are ignored (clients send many); known ones are validated, and any error becomes an
HTTP 400 in OpenAI's error shape naming the field. Numbers must be finite; what a request can make the
server hold or repeat is capped: messages per request, stop strings (number and length), a stored
system prompt. The defaults and bounds of sampling fields are SamplingParams' (core/sampling.py: BOUNDS),
read from there; the API narrows only temperature (OpenAI's [0, 2]). What only SamplingParams can check
(e.g. min_tokens <= max_tokens) is checked as it is built, and its ValueError becomes the 400 too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvforge.core.config import DTYPE_NAMES, engine_default
from kvforge.core.sampling import BOUNDS, MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams

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


def sampling_field(name: str, default: Any = ..., bounds: str | None = None, **narrower: float) -> Any:
    """A request field with SamplingParams' default and the bounds of BOUNDS[`bounds` or `name`];
    `narrower`: the API's own tighter limits."""
    default = SamplingParams.default(name) if default is ... else default
    return Field(default=default, **{**BOUNDS[bounds or name].limits(), **narrower})


class SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI names, plus extras)."""

    model_config = STRICT_NUMBERS
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = sampling_field("max_tokens", None)
    temperature: float = sampling_field("temperature", le=2)  # OpenAI's range; the engine takes any >= 0
    top_p: float = sampling_field("top_p")
    n: int = sampling_field("n")
    stop: StopStrings | Annotated[list[StopStrings], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = sampling_field("seed")  # what torch.Generator.manual_seed takes
    presence_penalty: float = sampling_field("presence_penalty")
    frequency_penalty: float = sampling_field("frequency_penalty")
    # extras beyond OpenAI's schema (vLLM-style)
    top_k: int = sampling_field("top_k")
    min_p: float = sampling_field("min_p")
    repetition_penalty: float = sampling_field("repetition_penalty")
    min_tokens: int = sampling_field("min_tokens")
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
    max_completion_tokens: int | None = sampling_field("max_tokens", None)
    logprobs: bool = False
    top_logprobs: int | None = sampling_field("logprobs", None)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = sampling_field("logprobs")
    echo: bool = False


class LoadModelRequest(BaseModel):
    """POST /admin/models/load: a model in the models directory (or the embedded default) and options."""
    # defaults and dtype choices: EngineConfig's (core/config.py)

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    dtype: Literal[DTYPE_NAMES] = engine_default("dtype")
    quant: str = engine_default("quant")
    quant_options: dict[str, Any] = Field(default_factory=dict)
    served_model_name: str | None = None
    kv_cache_gb: float | None = Field(default=None, ge=1 / 1024, le=4096)  # the API's sanity range: 1 MiB to 4 TiB
    decoding: str = engine_default("decoding")  # a speculative decoding plugin
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
