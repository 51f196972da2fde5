"""A chat-completions request made ready for the engine: its messages rendered through the model's chat template
(tools and tool history included, or described in a system prompt where the template has no tool syntax), the
constraint its `response_format` or `tool_choice` asks for (opening after the thinking of a reasoning model), and
what its output reader needs (app/generate/chat_output.py).

Decisions, one place each:
- tool_choice "none" (or no tools): no tool is described and no call is parsed; "auto": tools described, calls
  parsed, the output unconstrained (the model may answer in prose); "required" / a named function: the call
  grammar (app/generate/tool_grammar.py) forces a call whose arguments validate against the tool's schema -- a
  named function exactly one, "required" more where parallel_tool_calls allows, the reply ending at the first
  call that repeats an earlier one (the reader drops it and the sample is stopped: app/generate/stream.py).
- response_format json_schema / json_object: a JSON constraint; with a forced tool call the call grammar wins
  (the reply is a call, not an answer).
- a reasoning model (its template or vocabulary has `</think>`): the constraint opens after `</think>`, unless the
  rendered prompt already closed the thinking (e.g. Qwen3 with enable_thinking false).
- a tokenizer that declares its reply format (transformers' `response_template`): that format reads a reply with
  tool_choice "auto" (thinking, content and calls: app/generate/parsers/declared_response.py); a forced call is
  written by the
  call grammar and read by kvforge's parser for `syntax`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.app.dialects.openai.messages import ChatMessage
from kvforge.app.dialects.openai.protocol import ChatCompletionRequest
from kvforge.app.dialects.openai.tools import ToolFields
from kvforge.app.generate.parsers.declared_response import declared_template
from kvforge.app.generate.parsers.reasoning import ReasoningSyntax, detect_reasoning, starts_in_reasoning
from kvforge.app.generate.parsers.tool_calls import ToolSyntax, detect_tool_syntax, tool_names
from kvforge.app.generate.pictures import read_pictures
from kvforge.app.generate.tool_grammar import call_grammar
from kvforge.app.generate.tool_prompts import messages_for_template, render_history_for_default, tools_system_prompt
from kvforge.app.http.errors import APIError
from kvforge.core.constraint import Constraint
from kvforge.core.images import ImageInput
from kvforge.core.tokenizer import Tokenizer


@dataclass
class ChatPlan:
    """What the chat route hands the engine and the output reader."""

    prompt: list[int]
    constraint: Constraint | None
    constraint_field: str | None  # the request field a constraint that does not compile is blamed on
    tool_syntax: ToolSyntax
    tool_names: list[str] | None  # parse tool calls of these functions; None: no tool calls
    reasoning: ReasoningSyntax | None  # split the output's thinking from its answer
    starts_in_reasoning: bool  # the prompt opened the think block
    skip_special_tokens: bool  # False when a marker the reader looks for is a special token
    # the reply format the tokenizer declares (transformers' response_template), which reads a reply with tools
    declared_template: dict | None = None
    prompt_text: str = ""  # the rendered prompt: where a declared format's reader starts
    tools: list[dict] = field(default_factory=list)  # the tools described (their schemas type the arguments)
    forced_calls: bool = False  # the call grammar holds the output: it is tool calls only
    images: list[ImageInput] = field(default_factory=list)  # the prompt's pictures (a vision model's), in order


def chat_prompt_text(tokenizer: Tokenizer, messages: list[ChatMessage], tools: list[dict] | None,
                     template_kwargs: dict | None, add_generation_prompt: bool = True) -> str:
    """The conversation as the chat template renders it, with `tools` (OpenAI's, as dicts; None or empty: none
    described) passed to a template that takes them or described in the system prompt of one that does not, and
    tool calls / results of the history in a form the template renders. The chat route and /v1/tokenize both
    render here. APIError 400 for a conversation the template rejects."""
    syntax = detect_tool_syntax(tokenizer.hf.chat_template)
    placeholder = tokenizer.image_placeholder
    if placeholder is None and any(m.image_urls() for m in messages):
        raise APIError(400, "messages: this model takes no images (it is a text-only model)", "messages")
    dicts = [m.template_dict(placeholder or "") for m in messages]
    if syntax.template_supports_tools:
        dicts, template_tools = messages_for_template(dicts), tools or None
    else:
        dicts, template_tools = render_history_for_default(dicts), None
        if tools:
            dicts = _with_system_text(dicts, tools_system_prompt(tools))
    if placeholder is not None:  # a vision model's template reads content parts: text and {"type": "image"}
        dicts = [dict(d, content=content_parts(d["content"], placeholder)) if isinstance(d.get("content"), str)
                 else d for d in dicts]
    try:
        return tokenizer.chat_text(dicts, add_generation_prompt, template_tools, template_kwargs)
    except Exception as exc:  # a template that rejects this conversation (e.g. role order)
        raise APIError(400, f"messages: {exc}", "messages") from None


def plan_conversation(tokenizer: Tokenizer, messages: list[ChatMessage], tool_fields: ToolFields,
                      template_kwargs: dict | None = None, output_constraint: Constraint | None = None,
                      output_field: str | None = None, picture_hosts: frozenset[str] = frozenset()) -> ChatPlan:
    """A chat request's plan (see the module's docstring) from its parts (app/generate/request.py's ChatPrompt).
    `output_constraint`: the response format's, which a forced tool call overrides. APIError 400 for a conversation
    the template rejects. Runs off the event loop (template rendering is Python work)."""
    syntax = detect_tool_syntax(tokenizer.hf.chat_template)
    tools, choice = tool_fields.tool_dicts(), tool_fields.tool_choice_value()
    use_tools = bool(tools) and choice != "none"
    text = chat_prompt_text(tokenizer, messages, tools if use_tools else None, template_kwargs)
    images: list[ImageInput] = []
    if tokenizer.takes_images:
        prompt, images = prompt_with_pictures(tokenizer, text, [url for m in messages for url in m.image_urls()],
                                              picture_hosts)
    else:
        prompt = tokenizer.encode(text, add_special_tokens=False)

    reasoning = reasoning_syntax(tokenizer)
    specials = special_token_ids(tokenizer)
    constraint, blamed = output_constraint, output_field
    forced = use_tools and choice not in (None, "auto")
    if forced:  # the call grammar wins
        try:
            grammar = call_grammar(syntax, tools, choice, tool_fields.parallel_tool_calls is not False, specials)
        except ValueError as exc:
            raise APIError(400, f"tool_choice: {exc}", "tool_choice") from None
        constraint, blamed = Constraint.grammar(grammar), "tools"
    if constraint is not None and reasoning is not None and not text.rstrip().endswith(reasoning.end):
        constraint = constraint.opened_by(tokenizer.encode(reasoning.end, add_special_tokens=False))
    markers = [syntax.call_open, syntax.call_close] if use_tools else []
    markers += [reasoning.start, reasoning.end] if reasoning is not None else []
    # the model's own format reads what it writes freely; a forced call is written by the grammar in `syntax`
    declared = declared_template(tokenizer.hf) if use_tools and choice in (None, "auto") else None
    # a declared format's delimiters may be special tokens (Gemma 4's <|tool_call>): its reader sees them all
    skip_special = declared is None and may_skip_special_tokens(specials, markers)
    return ChatPlan(prompt, constraint, blamed, syntax, tool_names(tools) if use_tools else None, reasoning,
                    reasoning is not None and starts_in_reasoning(text, reasoning), skip_special,
                    declared, text if declared is not None else "", tools if use_tools else [], forced, images)


def content_parts(text: str, placeholder: str) -> list[dict]:
    """A message's text as the content parts a vision model's template takes (HF's shape): its text between the
    pictures' placeholders, {"type": "image"} for each."""
    parts: list[dict] = []
    for i, piece in enumerate(text.split(placeholder)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def prompt_with_pictures(tokenizer: Tokenizer, text: str, urls: list[str], picture_hosts: frozenset[str] = frozenset()
                         ) -> tuple[list[int], list[ImageInput]]:
    """A vision model's rendered prompt tokenized by its processor, each picture's placeholder expanded into the
    image's tokens (core/tokenizer.py encode_with_images); APIError 400 for a picture that cannot be read or a
    rendering whose placeholders do not match the pictures (a template that drops them, or text that writes one)."""
    pictures = read_pictures(urls, "messages", picture_hosts)
    found = text.count(tokenizer.image_placeholder)
    if found != len(pictures):
        raise APIError(400, f"messages: {len(pictures)} pictures, but the rendered prompt has {found} image "
                       f"placeholders ({tokenizer.image_placeholder!r} written in text, or a template that drops "
                       "pictures)", "messages")
    try:
        prompt = tokenizer.encode_with_images(text, [p.image for p in pictures], [p.digest for p in pictures])
    except ValueError as exc:  # the processor's own refusal of these pictures
        raise APIError(400, f"messages: {exc}", "messages") from None
    return prompt.token_ids, prompt.images


def format_constraint(body: ChatCompletionRequest) -> tuple[Constraint | None, str | None]:
    """The constraint `structured_outputs` or `response_format` asks for, and the field it is blamed on."""
    if body.structured_outputs is not None:
        return body.structured_outputs.constraint(), "structured_outputs"
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None, None
    if response_format.type == "json_object":
        return Constraint.json_object(), "response_format"
    schema = response_format.json_schema.schema_
    return Constraint.json_schema(schema if schema is not None else {}), "response_format"


def reasoning_syntax(tokenizer: Tokenizer) -> ReasoningSyntax | None:
    """The model's think markers when it reasons (its template or vocabulary has them), else None."""
    # one token lookup per marker (get_vocab() would build the whole vocabulary's dict for every request)
    return detect_reasoning(tokenizer.hf.chat_template,
                            lambda token: tokenizer.hf.backend_tokenizer.token_to_id(token) is not None)


def may_skip_special_tokens(specials: dict[str, int], markers: list[str | None]) -> bool:
    """Whether decoding may drop special tokens: not when a marker the output's reader looks for is one."""
    return not any(m in specials for m in markers if m)


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The tokenizer's special added tokens (e.g. Mistral's [TOOL_CALLS]): decoding drops them unless told not
    to, and a grammar must write them as their ids."""
    return {str(t.content): i for i, t in tokenizer.hf.added_tokens_decoder.items() if t.special}


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    """`text` at the end of the first system message, or as a new first system message."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}" if messages[0]["content"] else text)
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
