"""OpenAI's Responses API request (as the `openai` SDK sends it, openai 3.60) and its translation into the chat
request the rest of the server runs (app/dialects/openai/protocol.py): the same template, tools, constraints,
reasoning and
sampling checks. Nothing is stored: a conversation comes whole in `input` (the SDK's `input + response.output`
works), or lives in the sessions API (/v1/sessions).

No field is silently ignored:

    model, input, instructions, stream, temperature, top_p, max_output_tokens     honoured
    tools (function tools), tool_choice (auto / none / required / a function),     honoured
      parallel_tool_calls, text.format (text / json_object / json_schema)
    input items: messages (input_text / output_text / refusal parts),             honoured
      function_call, function_call_output, reasoning (its text goes back to the
      template as the next assistant message's reasoning_content)
    truncation                                                                    honoured: "auto" leaves out
                                                                                    the oldest whole turns of an
                                                                                    input too long for the context
                                                                                    (app/generate/context_fit.py);
                                                                                    "disabled" (the default) refuses
                                                                                    it (400)
    num_ctx (our extra, Ollama's option)                                          the request's context window
    metadata, user, safety_identifier, service_tier, prompt_cache_key,            accepted, no effect
      prompt_cache_retention, include [], store false
    store true, previous_response_id, conversation                                refused: nothing is stored here
    background, prompt, reasoning (effort / summary),                             refused
      include (any), top_logprobs, max_tool_calls, text.verbosity, other tools,
      file / audio parts, item_reference
    input_image parts (a data URL image_url, on user messages)                    honoured, for a vision model
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvforge.app.dialects.openai.fields import FORBID, refuse_given, refuse_kinds, refused
from kvforge.app.dialects.openai.protocol import ChatCompletionRequest
from kvforge.app.http.errors import validated

MEDIA = {"input_file": "this server takes no files", "input_audio": "this server takes no audio"}


class TextPart(BaseModel):
    model_config = FORBID
    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # an earlier output's (empty here)
    logprobs: list[Any] | None = None

    def content(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class ImagePart(BaseModel):
    model_config = FORBID
    type: Literal["input_image"]
    image_url: str  # a data URL (app/generate/pictures.py); file ids are refused (no Files API here)
    detail: Literal["auto", "high"] | None = None  # the model's own resolution ("low" is not implemented)
    file_id: None = refused("no Files API here: send the picture as a data URL in image_url")

    @field_validator("file_id", mode="before")
    @classmethod
    def _refused(cls, value: Any, info) -> Any:
        refuse_given(value, info, cls)
        return value


class MessageItem(BaseModel):
    model_config = FORBID
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return refuse_kinds(content, MEDIA)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.content() for p in self.content if isinstance(p, TextPart))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """Its content as a chat message's: text, or text and image parts in order where it has pictures."""
        if isinstance(self.content, str) or not any(isinstance(p, ImagePart) for p in self.content):
            return self.text()
        return [{"type": "image_url", "image_url": {"url": p.image_url}} if isinstance(p, ImagePart)
                else {"type": "text", "text": p.content()} for p in self.content]


class FunctionCallItem(BaseModel):
    model_config = FORBID
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=200)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = FORBID
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=200)
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.content() for p in self.output)


class ReasoningText(BaseModel):
    model_config = FORBID
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    model_config = FORBID
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(BaseModel):
    model_config = FORBID
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow the schema when a call is forced (constrained)

    def openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class NamedFunction(BaseModel):
    model_config = FORBID
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name or "output", "schema": self.schema_ or {}}}


class TextConfig(BaseModel):
    model_config = FORBID
    format: TextFormat | None = None
    verbosity: None = refused("no verbosity levels here")

    @field_validator("verbosity", mode="before")
    @classmethod
    def _refused(cls, value: Any, info) -> Any:
        refuse_given(value, info, cls)
        return value


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None  # None: "disabled", OpenAI's default
    num_ctx: int | None = Field(default=None, ge=1)  # our extra, Ollama's option: the request's context window
    include: list[Any] | None = Field(default=None, max_length=0)
    store: Literal[False] | None = None
    # accepted, no effect
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # refused (see the module's table)
    previous_response_id: None = refused("nothing is stored here: send the whole conversation in input, or use the "
                                         "sessions API (/v1/sessions)")
    conversation: None = refused("nothing is stored here: send the whole conversation in input, or use the "
                                 "sessions API (/v1/sessions)")
    background: None = refused("responses run in the foreground here")
    prompt: None = refused("no stored prompts here")
    reasoning: None = refused("no effort levels or summaries here; a reasoning model's thinking comes back as a "
                              "reasoning item")
    top_logprobs: None = refused("no logprobs in this API here (the chat completions API has them)")
    max_tool_calls: None = refused("not implemented")
    stream_options: None = refused("not implemented")

    @field_validator("previous_response_id", "conversation", "background", "prompt", "reasoning", "top_logprobs",
                     "max_tool_calls", "stream_options", mode="before")
    @classmethod
    def _refused(cls, value: Any, info) -> Any:
        refuse_given(value, info, cls)
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _messages_typed(cls, items: Any) -> Any:
        """A message may leave out its type (the SDK's EasyInputMessage): the discriminator needs it."""
        if isinstance(items, list):
            return [{"type": "message", **item} if isinstance(item, dict) and "type" not in item and "role" in item
                    else item for item in items]
        return items

    @field_validator("store", mode="before")
    @classmethod
    def _not_stored(cls, store: Any) -> Any:
        if store is True:
            raise ValueError("nothing is stored here (send store: false, or leave it out): send the whole "
                             "conversation in input, or use the sessions API (/v1/sessions)")
        return store

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tool {i} is {kind!r}: only function tools here")
        return tools

    def chat_request(self) -> ChatCompletionRequest:
        """The same request in OpenAI's chat shape."""
        choice = self.tool_choice
        data = {"model": self.model, "messages": chat_messages(self), "stream": self.stream,
                "temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_output_tokens,
                "tools": [t.openai() for t in self.tools] if self.tools else None,
                "tool_choice": {"type": "function", "function": {"name": choice.name}}
                if isinstance(choice, NamedFunction) else choice,
                "parallel_tool_calls": self.parallel_tool_calls,
                "response_format": self.text.format.response_format() if self.text and self.text.format else None}
        return validated(ChatCompletionRequest, data)


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The instructions and input items as chat messages: an assistant's message, reasoning and function calls in a
    row are one assistant message; each function_call_output a tool message."""
    out: list[dict[str, Any]] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    assistant: dict[str, Any] | None = None  # the assistant message being built from consecutive items

    def open_assistant() -> dict[str, Any]:
        nonlocal assistant
        if assistant is None:
            assistant = {"role": "assistant", "content": ""}
            out.append(assistant)
        return assistant

    for item in items:
        if isinstance(item, MessageItem) and item.role == "assistant":
            open_assistant()["content"] += item.text()
        elif isinstance(item, ReasoningItem):
            message = open_assistant()
            message["reasoning_content"] = message.get("reasoning_content", "") + item.text()
        elif isinstance(item, FunctionCallItem):
            open_assistant().setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        else:
            assistant = None
            if isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            else:
                out.append({"role": item.role, "content": item.chat_content()})
    return out


# chat field -> the Responses field an error about it names
RESPONSES_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
