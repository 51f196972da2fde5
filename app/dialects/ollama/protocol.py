"""Ollama's request bodies (its REST API as the `ollama` client sends it, ollama 0.6) and their translation into the
OpenAI-shaped requests the rest of the server runs (app/dialects/openai/protocol.py), so a request means the same
through either
API: the same template, tools, constraints, reasoning and sampling checks. An error found after translation names
the Ollama field (`options.num_predict`, not `max_tokens`).

No field is silently ignored:

    model, stream, format, tools, think, logprobs, top_logprobs       honoured (stream defaults to true, as Ollama)
    messages[].role / content / thinking / tool_calls / tool_name      honoured
    messages[].images (base64)                                         honoured on user messages, for a vision model
                                                                         (placed before the message's text)
    /api/generate: prompt, system, raw, context, images                honoured (images: not with raw)
    /api/generate: suffix, template                                    refused (no fill-in-the-middle, the model's
                                                                         template is the one used)
    keep_alive                                                         honoured for models loaded on demand (the
                                                                         server's own model stays loaded)
    /api/embed: input, truncate, options.num_ctx, dimensions           honoured (dimensions: the model's own only)
    /api/pull: model, stream                                           honoured (Hub ids; insecure refused)
    options: num_ctx, num_predict, temperature, top_p, top_k, min_p,   honoured (repeat_penalty is vLLM's
      seed, stop, repeat_penalty, presence_penalty, frequency_penalty    repetition_penalty, over the whole text)
    options: num_gpu, num_thread, num_batch, main_gpu, low_vram, numa, refused: load-time settings (`kvforge serve`
      use_mmap, use_mlock, vocab_only, logits_all, embedding_only        flags), not a request's
    options: num_keep, repeat_last_n, typical_p, tfs_z, mirostat,      refused: not implemented
      mirostat_tau, mirostat_eta, penalize_newline

Left out, options take the served model's defaults, the same as the OpenAI API's (core/generation_defaults.py:
its generation_config.json or its family's recommendation; not Ollama's built-in 0.8 / 40 / 0.9);
num_predict -1 or -2 generates to the end of the context window.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from kvforge.app.dialects.openai.fields import FORBID, MAX_EMBEDDING_INPUTS
from kvforge.app.dialects.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvforge.app.generate.pictures import with_pictures
from kvforge.app.http.errors import APIError, validated
from kvforge.app.models.keep_alive import parse_keep_alive

# Ollama's option -> the OpenAI-shaped field it sets
OPTION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                 "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "num_predict": "max_tokens"}
LOAD_OPTIONS = frozenset({"num_gpu", "num_thread", "num_batch", "main_gpu", "low_vram", "numa", "use_mmap",
                          "use_mlock", "vocab_only", "logits_all", "embedding_only", "f16_kv"})
UNSUPPORTED_OPTIONS = frozenset({"num_keep", "repeat_last_n", "typical_p", "tfs_z", "mirostat", "mirostat_tau",
                                 "mirostat_eta", "penalize_newline"})
FILL_CONTEXT = 2**31  # num_predict -1 / -2: as many tokens as the context window leaves


def check_options(options: dict[str, Any] | None) -> dict[str, Any] | None:
    for name, value in (options or {}).items():
        if name in LOAD_OPTIONS:
            raise ValueError(f"{name!r} is a load-time setting: kvforge sets it when it loads the model "
                             "(`kvforge serve` flags), not per request")
        if name in UNSUPPORTED_OPTIONS:
            raise ValueError(f"{name!r} is not supported by this server")
        if name not in OPTION_FIELDS and name != "num_ctx":
            raise ValueError(f"unknown option {name!r}")
        if name == "num_ctx" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"num_ctx must be an integer >= 1, got {value!r}")
        if name == "num_predict" and (isinstance(value, bool) or not isinstance(value, int) or value == 0
                                      or value < -2):
            raise ValueError(f"num_predict must be an integer >= 1, or -1 / -2 (to the end of the context), "
                             f"got {value!r}")
    return options


class OllamaFunctionCall(BaseModel):
    model_config = FORBID
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None  # Ollama's own replies carry it


class OllamaToolCall(BaseModel):
    model_config = FORBID
    id: str | None = None
    function: OllamaFunctionCall


class OllamaMessage(BaseModel):
    model_config = FORBID
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # assistant: its reasoning
    images: list[str] | None = None  # base64 pictures (a vision model's; app/generate/pictures.py)
    tool_calls: list[OllamaToolCall] | None = None  # assistant
    tool_name: str | None = None  # tool: the function whose result this is

    @field_validator("images")
    @classmethod
    def _on_user_messages(cls, images: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if images and info.data.get("role") != "user":
            raise ValueError(f"pictures go on user messages, not on a {info.data.get('role')} message")
        return images


def check_keep_alive(keep_alive: Any) -> Any:
    parse_keep_alive(keep_alive)  # a ValueError names what it takes
    return keep_alive


class OllamaRequest(BaseModel):
    """What /api/chat and /api/generate share."""

    model_config = FORBID
    model: str = Field(min_length=1)
    stream: bool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    think: bool | Literal["high", "medium", "low"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    keep_alive: float | str | None = None

    @field_validator("options")
    @classmethod
    def _options(cls, options: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_options(options)

    @field_validator("think")
    @classmethod
    def _no_levels(cls, think: Any) -> Any:
        if isinstance(think, str):
            raise ValueError("no effort levels here: true or false")
        return think

    @field_validator("keep_alive", mode="before")  # before: pydantic would take true for 1.0
    @classmethod
    def _stays_loaded(cls, keep_alive: Any) -> Any:
        return check_keep_alive(keep_alive)

    def keep_alive_s(self) -> float | None:
        return parse_keep_alive(self.keep_alive)

    def sampling(self) -> dict[str, Any]:
        """The OpenAI-shaped sampling fields its options set."""
        fields = {OPTION_FIELDS[k]: v for k, v in (self.options or {}).items() if k in OPTION_FIELDS}
        if fields.get("max_tokens") in (-1, -2):
            fields["max_tokens"] = FILL_CONTEXT
        return fields

    def num_ctx(self) -> int | None:
        return (self.options or {}).get("num_ctx")

    def response_format(self) -> dict[str, Any] | None:
        if not self.format:
            return None
        if self.format == "json":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": self.format}}

    def template_kwargs(self) -> dict[str, Any] | None:
        return None if self.think is None else {"enable_thinking": self.think}

    def logprob_fields(self) -> dict[str, Any]:
        return {"logprobs": True, "top_logprobs": self.top_logprobs} if self.logprobs else {}


class OllamaChatRequest(OllamaRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The same request in OpenAI's shape (tool_choice auto, as Ollama reads calls from free replies)."""
        data = {"model": self.model, "messages": openai_messages(self.messages), "stream": self.stream,
                "response_format": self.response_format(), "chat_template_kwargs": self.template_kwargs(),
                **self.sampling(), **self.logprob_fields()}
        if self.tools:
            data["tools"] = self.tools
        return validated(ChatCompletionRequest, data)


class OllamaGenerateRequest(OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[int] | None = None  # an earlier reply's `context`: its prompt and output, continued from
    suffix: None = Field(default=None, description="Not supported: no fill-in-the-middle.")
    template: None = Field(default=None, description="Not supported: the model's own chat template is used.")
    images: list[str] | None = None  # base64 pictures for the prompt (a vision model's), not with raw

    @field_validator("suffix", "template", mode="before")
    @classmethod
    def _refused(cls, value: Any, info) -> Any:
        if value not in (None, "", []):
            reason = cls.model_fields[info.field_name].description.removeprefix("Not supported: ")
            raise ValueError(f"not supported: {reason.rstrip('.')}")
        return None


    def chat_request(self) -> ChatCompletionRequest:
        """A templated prompt: the system text and the prompt as a conversation."""
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": with_pictures(self.prompt, base64_urls(self.images))}]
        data = {"model": self.model, "messages": messages, "stream": self.stream,
                "response_format": self.response_format(), "chat_template_kwargs": self.template_kwargs(),
                **self.sampling(), **self.logprob_fields()}
        return validated(ChatCompletionRequest, data)

    def completion_request(self) -> CompletionRequest:
        """A raw prompt: its text as it is (the sampling fields are all that is checked)."""
        if self.think is not None:
            raise APIError(400, "think: a raw prompt is not templated, so thinking cannot be switched", "think")
        if self.images:
            raise APIError(400, "images: a raw prompt is not templated, so it has no place for pictures", "images")
        data = {"model": self.model, "prompt": self.prompt or self.context, "stream": self.stream, **self.sampling()}
        if self.logprobs:
            data["logprobs"] = self.top_logprobs or 0
        return validated(CompletionRequest, data)


class OllamaEmbedRequest(BaseModel):
    """POST /api/embed: texts embedded by the served model. `truncate` (default true, as Ollama) cuts an input to the
    context's first tokens instead of refusing it; of the options only num_ctx (that context) means anything here."""

    model_config = FORBID
    model: str = Field(min_length=1)
    input: str | list[str] = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    dimensions: int | None = Field(None, ge=1)

    @field_validator("options")
    @classmethod
    def _options(cls, options: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in check_options(options) or {}:
            if name != "num_ctx":
                raise ValueError(f"{name!r} is not used by embeddings (only num_ctx is)")
        return options

    @field_validator("keep_alive", mode="before")  # before: pydantic would take true for 1.0
    @classmethod
    def _stays_loaded(cls, keep_alive: Any) -> Any:
        return check_keep_alive(keep_alive)

    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input

    def keep_alive_s(self) -> float | None:
        return parse_keep_alive(self.keep_alive)

    def num_ctx(self) -> int | None:
        return (self.options or {}).get("num_ctx")


class OllamaPullRequest(BaseModel):
    """POST /api/pull: a Hugging Face Hub model into the models directory (app/models/pull.py names what it takes)."""

    model_config = FORBID
    model: str = Field(min_length=1, max_length=300)
    stream: bool = True
    insecure: Literal[False] = False  # Ollama's plain-HTTP registries; the Hub is reached over HTTPS only


class OllamaModelRequest(BaseModel):
    """POST /api/show. Ollama still takes the model under its older name, `name` (litellm and many small clients
    send it): `model` wins where both are given, as in Ollama's ShowHandler."""

    model_config = FORBID
    model: str = Field(min_length=1)
    verbose: bool = False

    @model_validator(mode="before")
    @classmethod
    def _older_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "name" in data:
            data = dict(data)
            name = data.pop("name")
            data.setdefault("model", name)
        return data


def openai_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: calls' arguments as JSON text with an id each, and each tool result tied to
    the earliest open call of its function (Ollama's results name the function, not the call)."""
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, function name) of the last assistant's calls not yet answered
    for i, message in enumerate(messages):
        if message.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": message.content}
            if message.thinking:
                entry["reasoning_content"] = message.thinking
            if message.tool_calls:
                calls = [{"id": call.id or f"call_{i}_{j}", "type": "function",
                          "function": {"name": call.function.name,
                                       "arguments": json.dumps(call.function.arguments, ensure_ascii=False)}}
                         for j, call in enumerate(message.tool_calls)]
                entry["tool_calls"] = calls
                open_calls = [(call["id"], call["function"]["name"]) for call in calls]
        elif message.role == "tool":
            match = next((c for c in open_calls if message.tool_name in (None, c[1])), None)
            if match is not None:
                open_calls.remove(match)
            entry = {"role": "tool", "content": message.content, "tool_call_id": match[0] if match else f"call_{i}"}
        else:
            entry = {"role": message.role, "content": with_pictures(message.content, base64_urls(message.images))}
        out.append(entry)
    return out


def base64_urls(images: list[str] | None) -> list[str]:
    """Ollama's base64 pictures as data URLs (app/generate/pictures.py reads them)."""
    return [f"data:;base64,{image}" for image in images or ()]


# OpenAI-shaped field -> the Ollama field an error about it names
OLLAMA_NAMES = {openai: f"options.{ollama}" for ollama, openai in OPTION_FIELDS.items()} | {
    "response_format": "format", "chat_template_kwargs": "think", "top_logprobs": "top_logprobs"}
