"""The canonical generation request: what every dialect's request (OpenAI's chat, completions and responses,
Ollama's chat and generate, Anthropic's messages, a session's turn) becomes before the way in
(app/generate/admit.py). A dialect maps its fields here and nothing else; the prompt is a conversation rendered with
the chat template (ChatPrompt) or a text / token ids taken as they are (TextPrompt). Rendering runs off the event
loop (template rendering and tokenizing are Python work) and compiles the request's constraint there."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvforge.app.dialects.openai.messages import ChatMessage
from kvforge.app.dialects.openai.protocol import ChatCompletionRequest, SamplingFields
from kvforge.app.dialects.openai.tools import ToolFields
from kvforge.app.generate.chat_request import ChatPlan, format_constraint, plan_conversation, reasoning_syntax
from kvforge.app.generate.context_fit import ContextBudget, Truncation, fit_conversation
from kvforge.app.http.errors import APIError
from kvforge.core.async_engine import AsyncEngine
from kvforge.core.constraint import Constraint, InvalidConstraint
from kvforge.core.images import ImageInput, ImagePrompt
from kvforge.core.tokenizer import Tokenizer


@dataclass(frozen=True)
class Rendered:
    """A prompt made ready: its token ids, the constraint its output is held to (compiled), a chat's plan (how its
    output is read), the text each choice starts with (completions' echo), what a cut left out of a long chat."""

    prompt: list[int]
    constraint: Constraint | None = None
    plan: ChatPlan | None = None
    echoed: str = ""
    truncation: Truncation | None = None  # what a chat too long for its context left out (context_fit.py)

    @property
    def skip_special_tokens(self) -> bool:
        """Whether decoding may drop special tokens (not where a chat's reader looks for one)."""
        return self.plan.skip_special_tokens if self.plan is not None else True

    @property
    def engine_prompt(self) -> list[int] | ImagePrompt:
        """What the engine is given: the token ids, with a vision model's pictures (core/images.py) where it has any."""
        return ImagePrompt(self.prompt, self.plan.images) if self.plan is not None and self.plan.images else self.prompt


@dataclass(frozen=True, kw_only=True)
class ChatPrompt:
    """A conversation for the chat template: its messages, the tools the model may call, the output format asked
    for, extra template variables."""

    messages: list[ChatMessage]
    tools: ToolFields = field(default_factory=ToolFields)
    template_kwargs: dict | None = None
    output: Constraint | None = None  # the response format's constraint (a forced tool call overrides it)
    output_field: str | None = None  # the field `output` came from, blamed when it cannot be enforced
    prefix: list[int] = field(default_factory=list)  # ids before the conversation (Ollama's `context`)
    reasoning_field: str | None = None  # a field that asks the model to think (Ollama's think): refused if it cannot
    field: str = "messages"  # the request field the prompt came from (too long, empty, rejected by the template)
    picture_hosts: frozenset[str] = frozenset()  # hosts its pictures' http(s) URLs may be fetched from (admit sets it)

    @classmethod
    def of(cls, request: ChatCompletionRequest, **fields) -> ChatPrompt:
        """An OpenAI-shaped chat request's conversation (what the other dialects translate theirs into)."""
        output, output_field = format_constraint(request)
        return cls(messages=request.messages, tools=request, template_kwargs=request.chat_template_kwargs,
                   output=output, output_field=output_field, **fields)

    def chars(self) -> int:
        """The characters the prompt is made from (messages and tools), checked before rendering."""
        return sum(len(m.text()) for m in self.messages) + sum(len(t.model_dump_json()) for t in self.tools.tools or [])

    def plan(self, tokenizer: Tokenizer) -> ChatPlan:
        """Render and decide (app/generate/chat_request.py); APIError 400 naming `field` for a conversation the
        template rejects."""
        try:
            plan = plan_conversation(tokenizer, self.messages, self.tools, self.template_kwargs, self.output,
                                     self.output_field, self.picture_hosts)
        except APIError as exc:
            if exc.param != "messages" or self.field == "messages":
                raise
            raise APIError(400, exc.message.replace("messages: ", f"{self.field}: ", 1), self.field) from None
        if not self.prefix:
            return plan
        shift = len(self.prefix)  # the pictures' positions move with the prompt
        images = [ImageInput([p + shift for p in image.positions], image.pixels, image.digest) for image in plan.images]
        return replace(plan, prompt=self.prefix + plan.prompt, images=images)

    def render(self, engine: AsyncEngine, model: str, budget: ContextBudget | None = None) -> Rendered:
        """`budget`: the conversation's oldest turns are left out where it does not fit (app/generate/
        context_fit.py); None: rendered whole (its characters checked before, by check_prompt_chars)."""
        if self.reasoning_field and reasoning_syntax(engine.tokenizer) is None:
            raise APIError(400, f"{self.reasoning_field}: {model!r} does not think (its template and vocabulary "
                           "have no think markers)", self.reasoning_field)
        plan, truncation = self.sent_plan(engine, budget)
        if plan.constraint is not None:
            compile_constraint(engine, plan.constraint, plan.constraint_field)
        return Rendered(plan.prompt, plan.constraint, plan, truncation=truncation)

    def sent_plan(self, engine: AsyncEngine, budget: ContextBudget | None) -> tuple[ChatPlan, Truncation | None]:
        """The plan of the prompt sent, and what it left out: the conversation whole (`budget` None), or fitted to
        `budget` (see render); its constraint not compiled (a token count needs none)."""
        if budget is None:
            return self.plan(engine.tokenizer), None
        return self._fitted(engine, budget)

    def _fitted(self, engine: AsyncEngine, budget: ContextBudget) -> tuple[ChatPlan, Truncation | None]:
        tokenizer, bound = engine.tokenizer, prompt_chars_bound(engine)

        def plan(messages: list[ChatMessage]) -> ChatPlan | None:
            part = replace(self, messages=messages)
            return part.plan(tokenizer) if part.chars() <= bound else None  # not rendered: it cannot fit

        def count(texts: list[str]) -> list[int]:  # the Rust tokenizer's batch: no per-text Python work
            return [len(e.ids) for e in tokenizer.hf.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]

        fitted = fit_conversation(self.messages, budget, plan, count)
        if fitted.plan is None:  # even what must stay is too long by its characters: the 400 it always was
            check_prompt_chars(engine, replace(self, messages=fitted.messages).chars(), self.field)
        return fitted.plan, fitted.truncation


@dataclass(frozen=True, kw_only=True)
class TextPrompt:
    """A prompt taken as it is: text (tokenized) or token ids."""

    text: str | list[int]
    prefix: list[int] = field(default_factory=list)  # ids before it (Ollama's `context`)
    echo: bool = False  # each choice starts with the prompt's text (completions' echo)
    constraint: Constraint | None = None  # structured_outputs'
    field: str = "prompt"

    def chars(self) -> int:
        return len(self.text) if isinstance(self.text, str) else 0

    def render(self, engine: AsyncEngine, model: str) -> Rendered:
        if self.constraint is not None:
            compile_constraint(engine, self.constraint, "structured_outputs")
        if isinstance(self.text, list):  # checked before echo decodes it (a huge id overflows the tokenizer)
            if not engine.engine.in_vocabulary(self.text):
                raise APIError(400, f"{self.field}: token ids must be in [0, {engine.engine.hf_config.vocab_size})",
                               self.field)
            ids = self.text
        else:
            try:
                ids = engine.tokenizer.encode(self.text)
            except Exception as exc:  # text the tokenizer cannot take (e.g. a lone UTF-16 surrogate)
                raise APIError(400, f"{self.field}: cannot tokenize ({type(exc).__name__})", self.field) from None
        prompt = self.prefix + ids
        if not self.echo or not prompt:
            return Rendered(prompt, self.constraint)
        echoed = self.text if isinstance(self.text, str) else engine.tokenizer.decode(prompt, False)
        return Rendered(prompt, self.constraint, echoed=echoed)


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One generation request in no API's terms."""

    prompt: ChatPrompt | TextPrompt
    sampling: SamplingFields  # the sampling values, OpenAI's names (a dialect maps its own, naming them in errors)
    logprobs: int | None = None  # the top logprobs per token to return (None: none)
    prompt_logprobs: int | None = None  # the prompt's token logprobs too, with this many top ones (None: none)
    model: str | None = None  # the model it names (None: the server's own), loaded on demand
    keep_alive_s: float | None = None  # how long a model loaded for it stays after (Ollama's keep_alive)
    window: ContextWindow | None = None  # a context it asks for, smaller than the model's (Ollama's num_ctx)
    truncate: bool = True  # False: a chat too long for its context is refused, not cut (Responses' truncation)


UNBOUNDED = 2**31  # a window no model reaches: the model's own context bounds the request, max_tokens cut to fit


@dataclass(frozen=True)
class ContextWindow:
    """A context a request asks for (Ollama's options.num_ctx): its prompt must fit, and its output stops where the
    window ends. Larger than the model's context: the model's."""

    tokens: int
    field: str  # the request field that set it, named when the prompt does not fit


def compile_constraint(engine: AsyncEngine, constraint: Constraint, field: str) -> None:
    """Compile (and cache) a request's constraint before it is queued, off the event loop and the engine thread;
    APIError 400 naming `field` when it cannot be enforced."""
    try:
        engine.engine.compile_constraint(constraint)
    except InvalidConstraint as exc:
        raise APIError(400, f"{field}: cannot be enforced: {exc}", field) from None


def check_prompt_chars(engine: AsyncEngine, chars: int, prompt_field: str) -> None:
    """Refuse, before tokenizing it, a prompt too long to fit the context whatever its tokens: more than
    max_model_len times the longest token's characters (see Tokenizer.max_token_chars)."""
    context = engine.engine.max_model_len
    if chars > prompt_chars_bound(engine):
        raise APIError(400, f"{prompt_field}: {chars} characters cannot fit this model's context of {context} "
                       "tokens", prompt_field, code="context_length_exceeded")


def prompt_chars_bound(engine: AsyncEngine) -> int:
    """The most characters a prompt that fits the model's context can have (see check_prompt_chars)."""
    return engine.engine.max_model_len * engine.tokenizer.max_token_chars
