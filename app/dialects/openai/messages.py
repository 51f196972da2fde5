"""A chat request's messages (OpenAI's shapes): roles, text and image content parts (an audio or file part refused by
name), an assistant's earlier tool calls, refusal and reasoning, a tool's result. An image part is every dialect's
picture (Ollama's images, Anthropic's image blocks and the Responses API's input_image map to it); whether the model
takes images is decided where the conversation is rendered (app/generate/chat_request.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from kvforge.app.dialects.openai.fields import (
    FORBID,
    MAX_TOOLS,
    MEDIA_PARTS,
    refuse_given,
    refuse_kinds,
    refused,
)


class PromptCacheBreakpoint(BaseModel):
    """OpenAI's explicit cache breakpoint on a content part: accepted, no effect (the prefix cache here
    caches every prompt's blocks without being told where)."""

    model_config = FORBID
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class ChatCompletionContentPartText(BaseModel):
    model_config = FORBID
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class ChatCompletionContentPartRefusal(BaseModel):
    """An assistant's earlier refusal, in its content parts."""

    model_config = FORBID
    type: Literal["refusal"]
    refusal: str


class ImageURL(BaseModel):
    model_config = FORBID
    url: str  # a data: URL (base64); a remote address is refused (app/generate/pictures.py)
    # the model's own resolution for every picture ("high" asks for that; "low", a reduced one, is refused by
    # ChatMessage before the parts are read, with a message that says so)
    detail: Literal["auto", "high"] | None = None


class ChatCompletionContentPartImage(BaseModel):
    model_config = FORBID
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[ChatCompletionContentPartText | ChatCompletionContentPartRefusal
                        | ChatCompletionContentPartImage, Field(discriminator="type")]


class ToolCallFunction(BaseModel):
    model_config = FORBID
    name: str
    arguments: str  # JSON text, as the model generated it


class ChatCompletionMessageToolCall(BaseModel):
    """A tool call in an assistant message of the history."""

    model_config = FORBID
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message of the conversation: OpenAI's message shapes, text only. Role-specific fields are refused
    on the other roles (a tool_call_id on a user message would otherwise be ignored)."""

    model_config = FORBID
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = Field(default=None, max_length=MAX_TOOLS)  # assistant
    tool_call_id: str | None = None  # tool: which call this is the result of
    reasoning_content: str | None = None  # assistant: its thinking, for templates that render it
    reasoning: str | None = None  # the same under vLLM's and SGLang's newer name (replayed by their clients)
    refusal: str | None = None  # assistant: an earlier refusal
    audio: None = refused("this server serves a text-only model")
    function_call: None = refused("deprecated, use tool_calls")

    @model_validator(mode="before")
    @classmethod
    def _no_function_role(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") == "function":
            raise ValueError("the function role is deprecated: use role 'tool' with a tool_call_id")
        return data

    @field_validator("audio", "function_call", mode="before")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        refuse_given(value, info, cls)
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _no_audio_or_files(cls, content: Any) -> Any:
        for i, part in enumerate(content if isinstance(content, list) else ()):
            image = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
            if isinstance(image, dict) and image.get("detail") == "low":
                raise ValueError(f"content part {i}: image_url.detail 'low' is not implemented (every picture is read "
                                 "at the model's own resolution: 'auto' or 'high')")
        return refuse_kinds(content, MEDIA_PARTS)

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        assistant_only = [f for f in ("tool_calls", "reasoning_content", "reasoning", "refusal")
                          if getattr(self, f) is not None]
        if self.role != "assistant" and assistant_only:
            raise ValueError(f"{', '.join(assistant_only)}: only on assistant messages, not on a {self.role} message")
        if self.role != "assistant" and any(p.type == "refusal" for p in self.parts()):
            raise ValueError("refusal content parts are only for assistant messages")
        if self.role != "user" and self.image_urls():
            raise ValueError(f"image content parts: only on user messages, not on a {self.role} message")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"tool_call_id: only on tool messages, not on a {self.role} message")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.content is None and not (self.tool_calls or self.refusal is not None):
            raise ValueError("an assistant message needs content, tool_calls or a refusal")
        return self

    def parts(self) -> list[ContentPart]:
        return self.content if isinstance(self.content, list) else []

    def image_urls(self) -> list[str]:
        """Its image parts' URLs, in order."""
        return [p.image_url.url for p in self.parts() if p.type == "image_url"]

    def text(self, image_placeholder: str = "") -> str:
        """The message's text: its string, or its parts' text joined (an assistant's refusal parts too, each image
        as `image_placeholder`); an assistant's `refusal` when it has no other content."""
        if isinstance(self.content, list):
            text = "".join(p.text if p.type == "text" else p.refusal if p.type == "refusal" else image_placeholder
                           for p in self.content)
        else:
            text = self.content or ""
        return text or (self.refusal or "")

    def template_dict(self, image_placeholder: str = "") -> dict[str, Any]:
        """The message as chat templates take it (OpenAI's shape): developer becomes system, content is text (each
        image as `image_placeholder`: app/generate/chat_request.py makes parts of it for a vision model's template),
        and name, tool_calls (plain dicts, arguments as the JSON text sent), tool_call_id and reasoning_content
        appear when set."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.text(image_placeholder)}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None:
            message["reasoning_content"] = thinking
        return message
