"""What shapes a chat reply besides sampling: tools and tool_choice (ToolFields, shared by the chat request and a
conversation's settings), response_format and vLLM's structured_outputs (the constraint they compile to), and the
chat template's extra variables."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvforge.app.dialects.openai.fields import (
    FORBID,
    MAX_TOOLS,
    NAME_PATTERN,
)
from kvforge.core.constraint import Constraint


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra (chat and completions): the output held to exactly one of a JSON schema,
    a regular expression, a choice among strings or a Lark grammar (llguidance's dialect)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    grammar: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar")
        return self

    def constraint(self) -> Constraint:
        if self.json_ is not None:
            return Constraint.json_schema(self.json_)
        if self.regex is not None:
            return Constraint.regex(self.regex)
        return Constraint.choice(self.choice) if self.choice is not None else Constraint.grammar(self.grammar)


class FunctionDefinition(BaseModel):
    model_config = FORBID
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments; None: no arguments
    strict: bool | None = None  # the arguments always follow `parameters` here (constrained decoding)


class ChatCompletionFunctionTool(BaseModel):
    model_config = FORBID
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = FORBID
    name: str


class ChatCompletionNamedToolChoice(BaseModel):
    model_config = FORBID
    type: Literal["function"]
    function: ToolChoiceFunction


class JSONSchema(BaseModel):
    """response_format's json_schema: `schema_` is sent and documented as "schema" (pydantic's BaseModel has
    a `schema` method)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON
    strict: bool | None = None  # the output always follows the schema here (constrained decoding)


class ResponseFormatText(BaseModel):
    model_config = FORBID
    type: Literal["text"]


class ResponseFormatJSONObject(BaseModel):
    model_config = FORBID
    type: Literal["json_object"]


class ResponseFormatJSONSchema(BaseModel):
    model_config = FORBID
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
                           Field(discriminator="type")]


# apply_chat_template's own parameters and the variables it sets: chat_template_kwargs cannot override them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs: more variables for the template (enable_thinking), none of the reserved names."""
    taken = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise ValueError(f"{', '.join(taken)}: set by the server (or by the request's own fields), not here")
    return kwargs


def function_tools_only(tools: Any) -> Any:
    """A clear refusal for OpenAI's custom (free-text) tools, before the list is validated as function tools."""
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(tool, dict) and tool.get("type") == "custom":
            raise ValueError(f"tool {i}: custom tools are not supported, only type 'function'")
    return tools


class ToolFields(BaseModel):
    """The tools a model may call and how: a chat-completions request's, and a session's settings (kept for every
    turn of the conversation)."""

    model_config = FORBID
    tools: list[ChatCompletionFunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        return function_tools_only(tools)

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[ChatCompletionFunctionTool] | None) -> Any:
        names = [tool.function.name for tool in tools or ()]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(repeated)}")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, choice: Any) -> Any:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "allowed_tools":
            raise ValueError("allowed_tools is not supported: send only the allowed tools in tools")
        if kind == "custom":
            raise ValueError("custom tools are not supported, only type 'function'")
        return choice

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:  # tools itself was refused: that error is the one to report
            return choice
        names = [tool.function.name for tool in info.data["tools"] or ()]
        if not names and choice not in (None, "none"):
            raise ValueError(f"{choice!r} needs tools" if isinstance(choice, str) else "a named function needs tools")
        if isinstance(choice, ChatCompletionNamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"function {choice.function.name!r} is not among tools ({', '.join(names)})")
        return choice

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as chat templates and the call grammar take them (OpenAI's shape, unset fields left out)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    def tool_choice_value(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, ChatCompletionNamedToolChoice) else choice
