"""Anthropic's Messages API request (as the `anthropic` client sends it, anthropic 2.16) and its translation into
the OpenAI-shaped chat request the rest of the server runs (app/dialects/openai/protocol.py): the same template,
tools, constraints,
reasoning and sampling checks. An error found after translation names the Anthropic field.

No field is silently ignored:

    model, max_tokens, messages, system, stream, stop_sequences          honoured
    temperature (0-1), top_p, top_k                                      honoured (older API versions' fields)
    tools (client tools: name, description, input_schema)                honoured; server tools refused
    tool_choice (auto / any / tool / none, disable_parallel_tool_use)    honoured
    thinking (enabled / adaptive / disabled)                             the template's enable_thinking; a reasoning
                                                                           model's thinking comes back as thinking
                                                                           blocks; budget_tokens is checked, not a cap
    output_config.format (json_schema)                                   honoured (constrained decoding)
    metadata, service_tier, cache_control (top level and on blocks)      accepted, no effect (the prefix cache here is
                                                                           automatic)
    context_management (clear_thinking_20251015, clear_tool_uses_...)    honoured (app/dialects/anthropic/
                                                                           context_edits.py)
    content blocks: text, tool_use, tool_result (is_error), thinking     honoured
    content blocks: image on user messages                               honoured, for a vision model (a url source is
                                                                           fetched only from --image-url-hosts:
                                                                           app/generate/pictures.py)
    content blocks: document, search_result, redacted_thinking,          refused (nothing here makes or reads them)
      server tool blocks
    a last assistant message (prefill)                                   refused, as for Anthropic's models without it
    output_config.effort                                                 accepted, no effect (no such control here;
                                                                           Claude Code sends it on every request)
    system messages among the messages (beta mid-conversation-system)    folded into the user turn they follow (or
                                                                           the next one): templates alternate turns
    thinking between_tools / display, container, mcp_servers,            refused
      inference_geo, speed, diagnostics
    num_ctx (our extra, Ollama's option)                                 the request's context window: the reply
                                                                           ends where it does, a conversation
                                                                           longer loses its oldest turns
    count_tokens: num_ctx and max_tokens (our extras)                    what /v1/messages would keep of a long
                                                                           conversation: its window, its reply's room
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvforge.app.dialects.anthropic.context_edits import ContextManagement
from kvforge.app.dialects.openai.fields import FORBID, refuse_kinds
from kvforge.app.dialects.openai.protocol import ChatCompletionRequest
from kvforge.app.generate.request import UNBOUNDED
from kvforge.app.http.errors import validated


class CacheControl(BaseModel):
    model_config = FORBID
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(BaseModel):
    model_config = FORBID
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # a text block we would have to cite from: none here


class ToolUseBlock(BaseModel):
    model_config = FORBID
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=200)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    model_config = FORBID
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=200)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class Base64ImageSource(BaseModel):
    model_config = FORBID
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLImageSource(BaseModel):
    model_config = FORBID
    type: Literal["url"]
    url: str


class ImageBlock(BaseModel):
    model_config = FORBID
    type: Literal["image"]
    source: Base64ImageSource | URLImageSource = Field(discriminator="type")
    cache_control: CacheControl | None = None

    def openai_part(self) -> dict[str, Any]:
        """The picture as OpenAI's image part (a data URL)."""
        source = self.source
        url = source.url if isinstance(source, URLImageSource) else f"data:{source.media_type};base64,{source.data}"
        return {"type": "image_url", "image_url": {"url": url}}


class ThinkingBlock(BaseModel):
    model_config = FORBID
    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # Anthropic's check that the thinking is its own: nothing to check here


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]
REFUSED_BLOCKS = {"document": "this server reads no documents",
                  "search_result": "no search results here", "redacted_thinking": "nothing here redacts thinking",
                  "server_tool_use": "no server tools here", "web_search_tool_result": "no server tools here"}


class AnthropicMessage(BaseModel):
    model_config = FORBID
    role: Literal["user", "assistant", "system"]  # system: mid-conversation instructions (Claude Code's beta)
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content: Any) -> Any:
        return refuse_kinds(content, REFUSED_BLOCKS, "content block")

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> AnthropicMessage:
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else {"text"}
        allowed = {"user": kinds - {"tool_use", "thinking"}, "assistant": kinds - {"tool_result", "image"},
                   "system": kinds & {"text"}}[self.role]
        wrong = kinds - allowed
        if wrong:
            raise ValueError(f"{', '.join(sorted(wrong))} blocks are not for a {self.role} message")
        return self

    def blocks(self) -> list[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class AnthropicTool(BaseModel):
    model_config = FORBID
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise ValueError(f"{kind!r} is a server tool: no server tools here, only client tools (name, "
                             "description, input_schema)")
        return data

    def openai(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(BaseModel):
    model_config = FORBID
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name: given with type 'tool', and only then")
        return self

    def openai(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(BaseModel):
    model_config = FORBID
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1024)

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> Thinking:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("budget_tokens: given with type 'enabled', and only then")
        return self


class OutputFormat(BaseModel):
    model_config = FORBID
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = FORBID
    format: OutputFormat | None = None
    # accepted, no effect: how hard Claude works is not a control these models have (thinking is on or off by
    # `thinking`); Claude Code sends it on every request (beta effort-2025-11-24)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class ConversationFields(BaseModel):
    """What makes the prompt: the fields /v1/messages/count_tokens takes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # accepted, no effect: the prefix cache here is automatic
    context_management: ContextManagement | None = None  # edits of the history (context_edits.py)
    num_ctx: int | None = Field(default=None, ge=1)  # our extra, Ollama's option: the request's context window

    @model_validator(mode="after")
    def _no_prefill(self) -> ConversationFields:
        if self.messages[-1].role == "assistant":
            raise ValueError("messages: the last message is the assistant's (prefill), which this server does not "
                             "continue: end with a user message")
        return self

    @property
    def thinking_on(self) -> bool:
        return self.thinking is not None and self.thinking.type != "disabled"

    def chat_request(self, messages: list[AnthropicMessage] | None = None) -> ChatCompletionRequest:
        """The same request in OpenAI's shape (with `messages`: the conversation as context editing left it)."""
        data = {"model": self.model, "messages": openai_messages(self, messages), **self.generation_fields()}
        if self.tools:
            data["tools"] = [t.openai() for t in self.tools]
        if self.tool_choice is not None:
            data["tool_choice"] = self.tool_choice.openai()
            data["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if self.thinking is not None:
            data["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        if self.output_config is not None and self.output_config.format is not None:
            data["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        return validated(ChatCompletionRequest, data)

    def generation_fields(self) -> dict[str, Any]:
        return {}


class MessagesRequest(ConversationFields):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted, no effect
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted, no effect

    def generation_fields(self) -> dict[str, Any]:
        return {"stream": self.stream, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop_sequences or None}


class CountTokensRequest(ConversationFields):
    """POST /v1/messages/count_tokens: the prompt's fields, and what decides how much of a conversation longer than
    the context /v1/messages would keep: num_ctx, and our extra max_tokens (the reply's room, as /v1/messages'
    max_tokens; Anthropic's count_tokens takes none)."""

    max_tokens: int | None = Field(default=None, ge=1)

    def generation_fields(self) -> dict[str, Any]:
        # none given: any max_tokens the context cuts (Claude Code's 32000), whose reply keeps the most room
        return {"max_tokens": self.max_tokens or UNBOUNDED}


def openai_messages(body: ConversationFields, messages: list[AnthropicMessage] | None = None) -> list[dict[str, Any]]:
    """Anthropic's conversation as OpenAI's messages: the system prompt first; an assistant's text, thinking and
    tool_use blocks one message; a user message's tool_result blocks each a tool message, before its text. A system
    message among the messages (Claude Code's mid-conversation instructions) is folded into the user turn it follows,
    or the next one: chat templates alternate user and assistant turns (Gemma's raise on anything else)."""
    out: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        out.append({"role": "system", "content": system})
    pending: list[str] = []  # system text waiting for the next user turn
    for message in body.messages if messages is None else messages:
        blocks = message.blocks()
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if message.role == "system":
            if out and out[-1]["role"] == "user":
                out[-1]["content"] = f"{out[-1]['content']}\n\n{text}" if out[-1]["content"] else text
            else:
                pending.append(text)
            continue
        lead = ""  # system text that waited for this user turn
        if message.role == "user" and pending:
            lead = "\n\n".join(pending)
            text = "\n\n".join([*pending, text] if text else pending)
            pending = []
        if message.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": text}
            thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            if thinking:
                entry["reasoning_content"] = thinking
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(
                b.input, ensure_ascii=False)}} for b in blocks if isinstance(b, ToolUseBlock)]
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
            continue
        out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                for b in blocks if isinstance(b, ToolResultBlock)]
        images = [b for b in blocks if isinstance(b, ImageBlock)]
        if images:  # text and pictures in their order, any pending system text first
            parts = [b.openai_part() if isinstance(b, ImageBlock) else {"type": "text", "text": b.text}
                     for b in blocks if isinstance(b, (TextBlock, ImageBlock))]
            out.append({"role": "user", "content": ([{"type": "text", "text": lead + "\n\n"}] if lead else []) + parts})
        elif text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": text})
    if pending:  # after the last assistant turn: a user turn of its own
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


# OpenAI-shaped field -> the Anthropic field an error about it names
ANTHROPIC_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format",
                   "chat_template_kwargs": "thinking"}
