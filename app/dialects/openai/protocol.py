"""OpenAI-compatible request bodies (pydantic) and their translation into SamplingParams.

No field is silently ignored: every field of OpenAI's chat-completions and completions requests is honoured
or refused with a 400 naming it and saying why; a field that is neither OpenAI's nor one of our documented
extras is refused as unknown (extra="forbid"). Known fields are validated, and any error becomes an HTTP 400
in OpenAI's error shape naming the field. Numbers must be finite; what a request can make the server hold or
repeat is capped: messages per request, tools, stop strings (number and length), logit_bias entries, a stored
system prompt. The defaults and bounds of sampling fields are SamplingParams' (core/sampling.py: BOUNDS),
read from there; the API narrows only temperature (OpenAI's [0, 2]). What only SamplingParams can check
(e.g. min_tokens <= max_tokens) is checked as it is built, and its ValueError becomes the 400 too.

POST /v1/chat/completions, field by field (OpenAI's CompletionCreateParams, openai 3.60):

    messages, model, stream                          honoured
    temperature, top_p, n, seed, stop                honoured
    frequency_penalty, presence_penalty              honoured
    max_tokens, max_completion_tokens                honoured (max_completion_tokens first)
    logprobs, top_logprobs                           honoured (top_logprobs > 0 needs logprobs: true)
    logit_bias                                       honoured (token id strings -> bias in [-100, 100])
    stream_options                                   include_usage honoured; include_obfuscation: true refused
    response_format, tools, tool_choice,             honoured (constrained decoding, the chat template)
      parallel_tool_calls
    modalities                                       ["text"] only
    user, metadata, store, service_tier,             accepted, no effect: metadata for OpenAI's own
      prompt_cache_key, safety_identifier,           bookkeeping; the prefix cache here is automatic and
      prompt_cache_retention, prompt_cache_options   needs no hint
    functions, function_call                         refused: deprecated, use tools / tool_choice
    audio                                            refused: a text-only model
    prediction                                       refused: no predicted outputs
    web_search_options                               refused: no web search
    reasoning_effort                                 refused: thinking is switched by chat_template_kwargs
    verbosity                                        refused: no verbosity control
    moderation                                       refused: no moderation model
    extras (vLLM's names): top_k, min_p, repetition_penalty, min_tokens, ignore_eos, chat_template_kwargs,
      structured_outputs (one of json / regex / choice / grammar; not with response_format); ours:
      repetition_guard (end a reply stuck in a loop: finish_reason "repetition"; core/repetition.py)

A sampling field left out takes the served model's default (core/generation_defaults.py: its
generation_config.json, its family's recommendation, or the settings file's), else SamplingParams'.

POST /v1/completions (openai's completion_create_params):

    prompt                      a string or a list of token ids; a batch of prompts is refused
    echo                        honoured (the prompt's text starts each choice); with logprobs refused
    best_of                     accepted when 1 or equal to n (that is what runs), else refused
    suffix                      refused: no fill-in-the-middle
    logit_bias, logprobs, user  honoured / accepted as above; the sampling fields and extras as for chat
    structured_outputs          honoured, as for chat

A refused field sent as null is the same as absent (clients fill optional fields with null).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvforge.core.config import DTYPE_NAMES, engine_default
from kvforge.core.constraint import Constraint
from kvforge.core.sampling import (
    BOUNDS,
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)

MAX_MESSAGES = 2048  # per request
MAX_TOOLS = 128  # per request (OpenAI's own limit)
MAX_SYSTEM_PROMPT_CHARS = 100_000  # a conversation's stored system prompt
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's, for function and response-format names
FORBID = ConfigDict(extra="forbid")
STRICT_NUMBERS = ConfigDict(extra="forbid", allow_inf_nan=False)
TEXT_ONLY = "this server serves a text-only model"
MEDIA_PARTS = {kind: TEXT_ONLY for kind in ("image_url", "input_audio", "file")}


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


class StreamOptions(BaseModel):
    model_config = FORBID
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI pads deltas against a network side channel; we send none

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("stream obfuscation is not supported (set it false or leave it out)")
        return value


# --- messages ----------------------------------------------------------------------------------------


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


ContentPart = Annotated[ChatCompletionContentPartText | ChatCompletionContentPartRefusal, Field(discriminator="type")]


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
    def _text_only(cls, content: Any) -> Any:
        return refuse_kinds(content, MEDIA_PARTS)

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        assistant_only = [f for f in ("tool_calls", "reasoning_content", "refusal") if getattr(self, f) is not None]
        if self.role != "assistant" and assistant_only:
            raise ValueError(f"{', '.join(assistant_only)}: only on assistant messages, not on a {self.role} message")
        if self.role != "assistant" and any(p.type == "refusal" for p in self.parts()):
            raise ValueError("refusal content parts are only for assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"tool_call_id: only on tool messages, not on a {self.role} message")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.content is None and not (self.tool_calls or self.refusal is not None):
            raise ValueError("an assistant message needs content, tool_calls or a refusal")
        return self

    def parts(self) -> list[ChatCompletionContentPartText | ChatCompletionContentPartRefusal]:
        return self.content if isinstance(self.content, list) else []

    def text(self) -> str:
        """The message's text: its string, or its parts' text joined (an assistant's refusal parts too);
        an assistant's `refusal` when it has no other content."""
        if isinstance(self.content, list):
            text = "".join(p.text if p.type == "text" else p.refusal for p in self.content)
        else:
            text = self.content or ""
        return text or (self.refusal or "")

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (OpenAI's shape): developer becomes system, content is text,
        and name, tool_calls (plain dicts, arguments as the JSON text sent), tool_call_id and reasoning_content
        appear when set."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


# --- tools and response formats ------------------------------------------------------------------------


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


# --- sampling fields and the two OpenAI requests --------------------------------------------------------


StopStrings = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0)]
LogitBias = Annotated[
    dict[TokenId, Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]],
    Field(max_length=MAX_LOGIT_BIAS_TOKENS)]


def sampling_field(name: str, default: Any = ..., bounds: str | None = None, **narrower: float) -> Any:
    """A request field with SamplingParams' default and the bounds of BOUNDS[`bounds` or `name`];
    `narrower`: the API's own tighter limits."""
    default = SamplingParams.default(name) if default is ... else default
    return Field(default=default, **{**BOUNDS[bounds or name].limits(), **narrower})


class SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI names, plus extras); also a
    conversation's sampling settings (check_sampling)."""

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
    logit_bias: LogitBias | None = None  # OpenAI sends token ids as JSON object keys (strings)
    # extras beyond OpenAI's schema (vLLM-style)
    top_k: int = sampling_field("top_k")
    min_p: float = sampling_field("min_p")
    repetition_penalty: float = sampling_field("repetition_penalty")
    min_tokens: int = sampling_field("min_tokens")
    ignore_eos: bool = False
    repetition_guard: bool = False  # our extra: end a reply stuck in a loop, finish_reason "repetition"

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, bias: Any) -> Any:
        for key in bias if isinstance(bias, dict) else ():
            if not (isinstance(key, int) or (isinstance(key, str) and key.isascii() and key.isdigit())):
                raise ValueError(f"keys must be token ids (non-negative integers, as strings), got {key!r}")
        return bias

    def sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed,
            max_tokens=self.requested_max_tokens() or default_max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, ignore_eos=self.ignore_eos, logprobs=logprobs, logit_bias=self.logit_bias,
            repetition_guard=self.repetition_guard)

    def over_defaults(self, defaults: dict[str, Any]) -> SamplingFields:
        """These fields over a model's sampling defaults (core/generation_defaults.py): a field this request left
        out takes the model's default; its max_tokens only through requested_max_tokens (see submit)."""
        missing = {k: v for k, v in defaults.items() if k not in self.model_fields_set and k != "max_tokens"}
        return self.model_copy(update=missing) if missing else self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(ToolFields, SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = sampling_field("max_tokens", None)
    logprobs: bool = False
    top_logprobs: int | None = sampling_field("logprobs", None)
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template (enable_thinking)
    structured_outputs: StructuredOutputs | None = None  # vLLM's extra: regex, choice, grammar or JSON schema
    modalities: list[Literal["text"]] | None = None
    # metadata: accepted, no effect (see the module's table)
    user: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # refused (see the module's table)
    functions: None = refused("deprecated, use tools")
    function_call: None = refused("deprecated, use tool_choice")
    audio: None = refused("this server serves a text-only model")
    prediction: None = refused("no predicted outputs here")
    web_search_options: None = refused("this server has no web search")
    reasoning_effort: None = refused("no effort levels here; switch thinking with chat_template_kwargs "
                                     "(e.g. enable_thinking) where the model's template has it")
    verbosity: None = refused("no verbosity levels here")
    moderation: None = refused("this server has no moderation model")

    @field_validator("functions", "function_call", "audio", "prediction", "web_search_options", "reasoning_effort",
                     "verbosity", "moderation", mode="before")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        refuse_given(value, info, cls)
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_variables(kwargs)

    @field_validator("modalities", mode="before")
    @classmethod
    def _text_modality(cls, modalities: Any) -> Any:
        if modalities is not None and modalities != ["text"]:
            raise ValueError(f"only ['text'] (this server serves a text-only model), got {modalities!r}")
        return modalities

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and info.data.get("logprobs") is False:
            raise ValueError("needs logprobs: true")
        return top

    @field_validator("structured_outputs")
    @classmethod
    def _one_output_format(cls, value: StructuredOutputs | None, info: ValidationInfo) -> StructuredOutputs | None:
        if value is not None and info.data.get("response_format") is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None



class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] = Field(min_length=1)
    logprobs: int | None = sampling_field("logprobs")
    echo: bool = False
    best_of: int | None = None
    user: str | None = None  # metadata: accepted, no effect
    structured_outputs: StructuredOutputs | None = None  # vLLM's extra: regex, choice, grammar or JSON schema
    suffix: None = refused("no fill-in-the-middle here")

    @field_validator("suffix", mode="before")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        refuse_given(value, info, cls)
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and any(isinstance(p, str | list) for p in prompt):
            raise ValueError("a batch of prompts is not supported: send one prompt (a string or a list of token ids) "
                             "per request")
        return prompt

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, echo: bool, info: ValidationInfo) -> bool:
        if echo and info.data.get("logprobs") is not None:
            raise ValueError("not supported together with logprobs (the prompt's logprobs are not computed)")
        return echo

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n")
        if best_of is not None and n is not None and best_of not in (1, n):  # n None: n itself was refused
            raise ValueError(f"must be 1 or equal to n ({n}): candidates are not ranked here, "
                             "ask for n choices instead")
        return best_of


# --- tokenizer routes (vLLM's shapes) -------------------------------------------------------------------


class TokenizeRequest(BaseModel):
    """POST /v1/tokenize: a `prompt` as text, or chat `messages` rendered by the chat template (exactly one).
    add_special_tokens defaults to true for a prompt and to false for messages (the template writes its own)."""

    model_config = FORBID
    model: str | None = None
    prompt: str | None = Field(default=None, min_length=1)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    # messages only
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionFunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)

    @field_validator("messages")
    @classmethod
    def _not_both(cls, messages: list[ChatMessage] | None, info: ValidationInfo) -> list[ChatMessage] | None:
        if messages is not None and info.data.get("prompt") is not None:
            raise ValueError("give either prompt or messages, not both")
        return messages

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        return function_tools_only(tools)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_variables(kwargs)

    @field_validator("add_generation_prompt", "chat_template_kwargs", "tools")
    @classmethod
    def _messages_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("messages", []) is None:  # absent there: messages itself failed
            raise ValueError("applies to messages only, not to a prompt")
        return value

    def with_special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(BaseModel):
    """POST /v1/detokenize: token ids back to text."""

    model_config = FORBID
    model: str | None = None
    tokens: list[TokenId]


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: one text or a batch (texts, or token-id lists), embedded by the served model."""

    model_config = FORBID
    model: str | None = None
    input: str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)] | Annotated[
        list[TokenId], Field(min_length=1)] | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # accepted when it is the model's size: shortening is not supported
    user: str | None = None  # metadata

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a batch: one text, or one token-id list, is a batch of one."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return self.input


# --- admin and sessions ---------------------------------------------------------------------------------


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


class SessionSettings(ToolFields):
    """A conversation's own settings: its system prompt, sampling defaults (SamplingFields names), and the tools
    its replies may call (ToolFields: checked as a chat request's)."""

    model_config = ConfigDict(extra="forbid")
    system_prompt: str | None = Field(default=None, max_length=MAX_SYSTEM_PROMPT_CHARS)
    sampling: dict[str, Any] = Field(default_factory=dict)

    @field_validator("sampling")
    @classmethod
    def _known_valid_sampling(cls, sampling: dict[str, Any]) -> dict[str, Any]:
        return check_sampling(sampling)

    def stored(self) -> dict[str, Any]:
        """The settings as a conversation keeps them: the system prompt and sampling always, the tool fields only
        where set (a conversation without tools keeps none)."""
        tool_fields = set(ToolFields.model_fields) & self.model_fields_set
        return {"system_prompt": self.system_prompt, "sampling": self.sampling,
                **self.model_dump(include=tool_fields, exclude_none=True)}


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


NOT_SETTINGS = frozenset({"title", "current_message_id"})  # what a PATCH changes besides the settings


class SessionUpdateRequest(BaseModel):
    """PATCH /v1/sessions/{id}: the fields given change (null clears a system prompt or the tools); the settings
    they make are checked together (a tool_choice must name one of the tools)."""

    model_config = ConfigDict(extra="forbid")
    title: str | None = Field(default=None, min_length=1, max_length=200)
    system_prompt: str | None = Field(default=None, max_length=MAX_SYSTEM_PROMPT_CHARS)
    sampling: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # checked with the rest, as SessionSettings
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # show another branch: the one through this message, down to its most recent reply (Conversations.switch)
    current_message_id: int | None = None

    @field_validator("current_message_id")
    @classmethod
    def _a_message(cls, message_id: int | None) -> int:
        if message_id is None:  # only a given null gets here: a branch is shown through a message
            raise ValueError("must be the id of one of the session's messages, not null")
        return message_id

    def changes_settings(self) -> bool:
        return bool(self.model_fields_set - NOT_SETTINGS)

    def settings(self, current: dict[str, Any]) -> SessionSettings:
        """`current` with this request's changes; pydantic's ValidationError for settings that do not hold."""
        changed = self.model_dump(include=self.model_fields_set - NOT_SETTINGS)
        if changed.get("sampling") is None:
            changed.pop("sampling", None)
        merged = {k: v for k, v in {**current, **changed}.items() if v is not None or k == "system_prompt"}
        return SessionSettings.model_validate(merged)


# a session reply's fields that are not sampling overrides
NOT_SAMPLING = frozenset({"role", "content", "tool_call_id", "tool_choice", "stream", "model", "parent_id"})


class SessionReplyFields(SamplingFields):
    """What a session reply takes: fields given here override the conversation's sampling settings (and
    tool_choice) for this reply. Streams by default."""

    # this reply's, instead of the conversation's (e.g. "required" to start, "auto" once the results are in)
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = True

    def overrides(self) -> dict[str, Any]:
        """The sampling fields this request sets."""
        return self.model_dump(include=self.model_fields_set - NOT_SAMPLING)


class SessionRegenerateRequest(SessionReplyFields):
    """POST /v1/sessions/{id}/messages/{message_id}/regenerate: another reply to a stored message (the body may
    be empty)."""


class SessionMessageRequest(SessionReplyFields):
    """POST /v1/sessions/{id}/messages: the user's message, or a tool's result (role "tool", with the id of the
    call it answers), after `parent_id` when given (null: a new first message; absent: the last message shown)."""

    role: Literal["user", "tool"] = "user"
    content: str = Field(min_length=1)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=200, validate_default=True)
    parent_id: int | None = None  # edit a message: post the new text after the message the old one followed

    @field_validator("tool_call_id")
    @classmethod
    def _on_tool_results_only(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role == "tool" and call_id is None:
            raise ValueError("a tool message needs the id of the call it answers")
        if role == "user" and call_id is not None:
            raise ValueError("only on tool messages (role 'tool')")
        return call_id
