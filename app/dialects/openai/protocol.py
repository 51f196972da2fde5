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
      repetition_guard (end a reply stuck in a loop: finish_reason "repetition"; core/repetition.py), num_ctx
      (Ollama's option, which Open WebUI forwards to OpenAI connections: the request's context window, as
      /api/chat's options.num_ctx -- its reply ends where the window does, a chat longer than it loses its oldest
      turns (app/generate/context_fit.py), a single prompt must fit)

A sampling field left out takes the served model's default (core/generation_defaults.py: its
generation_config.json, its family's recommendation, or the settings file's), else SamplingParams'.

POST /v1/completions (openai's completion_create_params):

    prompt                      a string, a list of token ids, or a batch of either (at most 256 prompts;
                                choice i * n + j is prompt i's sample j, as OpenAI's and vLLM's)
    echo                        honoured (the prompt's text starts each choice); with logprobs, the prompt's
                                tokens lead the logprobs (the first one's null), computed in its prefill
    best_of                     accepted when 1 or equal to n (that is what runs), else refused
    suffix                      refused: no fill-in-the-middle
    logit_bias, logprobs, user  honoured / accepted as above; the sampling fields and extras as for chat
    structured_outputs          honoured, as for chat

A refused field sent as null is the same as absent (clients fill optional fields with null).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from kvforge.app.dialects.openai.fields import (
    FORBID,
    MAX_COMPLETION_PROMPTS,
    MAX_MESSAGES,
    STRICT_NUMBERS,
    refuse_given,
    refused,
)
from kvforge.app.dialects.openai.messages import ChatMessage
from kvforge.app.dialects.openai.tools import ResponseFormat, StructuredOutputs, ToolFields, template_variables
from kvforge.core.sampling import (
    BOUNDS,
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)


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


# --- tools and response formats ------------------------------------------------------------------------


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
    num_ctx: int | None = Field(default=None, ge=1)  # Ollama's context window (Open WebUI forwards it): see routes
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
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | Annotated[
        list[str], Field(min_length=1, max_length=MAX_COMPLETION_PROMPTS)] | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_COMPLETION_PROMPTS)]
    logprobs: int | None = sampling_field("logprobs")
    echo: bool = False
    best_of: int | None = None
    user: str | None = None  # metadata: accepted, no effect
    structured_outputs: StructuredOutputs | None = None  # vLLM's extra: regex, choice, grammar or JSON schema
    num_ctx: int | None = Field(default=None, ge=1)  # Ollama's context window, as for chat
    suffix: None = refused("no fill-in-the-middle here")

    @field_validator("suffix", mode="before")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        refuse_given(value, info, cls)
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a batch: one text, or one token-id list, is a batch of one."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n")
        if best_of is not None and n is not None and best_of not in (1, n):  # n None: n itself was refused
            raise ValueError(f"must be 1 or equal to n ({n}): candidates are not ranked here, "
                             "ask for n choices instead")
        return best_of


# --- tokenizer routes (vLLM's shapes) -------------------------------------------------------------------


# --- admin and sessions ---------------------------------------------------------------------------------


