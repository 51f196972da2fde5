"""The one way in, the same for every API dialect and the sessions API: a canonical request
(app/generate/request.py) through the one gate (app/generate/admission.py), its prompt rendered and tokenized off
the event loop (its constraint compiled there), then submitted: its sampling fields over the model's defaults into
validated SamplingParams (a 400 naming the field otherwise), a max_tokens that fits the context (or the window the
request asks for), queued. What comes back, Admitted, is the one way out: its outputs driven by
app/generate/stream.py, which each dialect writes in its own shape."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from kvforge.app.context import ServerContext
from kvforge.app.generate.admission import Ticket
from kvforge.app.generate.chat_request import ChatPlan
from kvforge.app.generate.context_fit import ContextBudget, Truncation, droppable
from kvforge.app.generate.off_loop import off_loop
from kvforge.app.generate.request import ChatPrompt, GenerateRequest, Rendered, check_prompt_chars
from kvforge.app.generate.stream import Failed, Read, RequestTimedOut, drive
from kvforge.app.http.errors import APIError
from kvforge.core.async_engine import AsyncEngine, RequestStream
from kvforge.core.output import RequestOutput, TokenLogprob
from kvforge.core.sampling import SamplingParams
from kvforge.core.scheduler import RequestRejected


@dataclass
class Admitted:
    """A queued request and what its response is made from."""

    context: ServerContext
    ticket: Ticket
    stream: RequestStream
    params: SamplingParams
    prompt: list[int]
    plan: ChatPlan | None  # a chat's (how its output is read); None for a prompt taken as it is
    echoed: str = ""  # the text each choice starts with (completions' echo)
    truncation: Truncation | None = None  # what was left out of a chat too long for its context

    @property
    def model(self) -> str:
        """The name of the model it runs on: what its response names."""
        return self.ticket.model

    @property
    def engine(self) -> AsyncEngine:
        return self.ticket.engine

    def close(self) -> None:
        """However the response ends, once: the admission place released and the request aborted (a no-op once
        it finished; a client that went away frees its KV blocks)."""
        self.ticket.release()
        self.stream.abort()

    def outputs(self, read: bool = True) -> AsyncIterator[Read | Failed]:
        """The request's outputs, each read into the reply's parts, within the server's request timeout
        (app/generate/stream.py's drive)."""
        return drive(self.stream, self.plan, self.context.request_timeout_s, self.context.metrics, read)

    async def collect(self) -> Collected:
        """A whole (not streamed) response's outputs. The request is closed however this ends; past the request
        timeout it is aborted and APIError 504 raised."""
        collected = Collected({}, {}, {})
        try:
            async for item in self.outputs(read=False):
                if isinstance(item, Failed):  # no headers sent yet: 504 past the timeout, the engine's failure 503
                    raise item.error.api_error() if isinstance(item.error, RequestTimedOut) else item.error
                out = item.out
                if out.delta_logprobs:
                    collected.logprobs.setdefault(out.index, []).extend(out.delta_logprobs)
                if out.prompt_logprobs is not None:
                    collected.prompt_logprobs[out.index] = out.prompt_logprobs
                if out.finished:
                    collected.finals[out.index] = out
        finally:
            self.close()
        return collected


@dataclass
class Collected:
    """A whole response's outputs, by sample index: each sample's final output, its token logprobs, and (asked for)
    its prompt's token logprobs."""

    finals: dict[int, RequestOutput]
    logprobs: dict[int, list[TokenLogprob]]
    prompt_logprobs: dict[int, list[TokenLogprob]]


async def admit(context: ServerContext, request: GenerateRequest) -> Admitted:
    """Admit the request (its model loaded on demand), render its prompt off the event loop, queue it; APIError
    naming the field for a prompt too long or empty, bad sampling values, a constraint that cannot be enforced."""
    return (await admit_all(context, [request]))[0]


async def admit_all(context: ServerContext, requests: list[GenerateRequest]) -> list[Admitted]:
    """admit() for a request made of several (completions' batch of prompts, one model): one admission place for
    them all, each queued as its own engine request, all in one group that shares the engine as one client's
    request does (core/scheduler.py). All or none: a part refused closes those queued before it."""
    ticket = await context.admission.enter(requests[0].model, requests[0].keep_alive_s)
    tickets = ticket.split(len(requests)) if len(requests) > 1 else [ticket]
    group = uuid.uuid4().hex if len(requests) > 1 else None
    admitted: list[Admitted] = []
    try:
        for request, part in zip(requests, tickets, strict=True):
            admitted.append(await _queue(context, request, part, group))
    except BaseException:
        for queued in admitted:
            queued.close()
        for part in tickets[len(admitted):]:
            part.release()
        raise
    return admitted


async def _queue(context: ServerContext, request: GenerateRequest, ticket: Ticket, group: str | None) -> Admitted:
    request = with_picture_hosts(context, request)
    prompt_field = request.prompt.field
    engine = ticket.engine
    budget = fit_budget(context, engine, request)
    # before the request is queued: a client gone during these awaits leaves nothing running
    if budget is None:
        check_prompt_chars(engine, request.prompt.chars(), prompt_field)
        rendered = await off_loop(request.prompt.render, engine, ticket.model)
    else:  # its characters are checked as it is fitted: a long chat may be cut to fit
        rendered = await off_loop(request.prompt.render, engine, ticket.model, budget)
    if not rendered.prompt:
        raise APIError(400, f"{prompt_field} must not be empty", prompt_field)
    stream, params = submit(engine, request, rendered, context.default_max_tokens, group)
    return Admitted(context, ticket, stream, params, rendered.prompt, rendered.plan, rendered.echoed,
                    rendered.truncation)


def sent_prompt(context: ServerContext, engine: AsyncEngine, request: GenerateRequest
                ) -> tuple[list[int], Truncation | None]:
    """The token ids a chat request would be queued with, and what they leave out of a conversation longer than its
    context: its prompt rendered and fitted as _queue does, nothing compiled or queued (what a token count counts).
    Blocking work (render, tokenize): run it off the event loop, under an admission ticket for `engine`."""
    request = with_picture_hosts(context, request)
    prompt = request.prompt
    if not isinstance(prompt, ChatPrompt):
        raise TypeError("sent_prompt: a chat request's prompt only")
    budget = fit_budget(context, engine, request)
    if budget is None:
        check_prompt_chars(engine, prompt.chars(), prompt.field)
    plan, truncation = prompt.sent_plan(engine, budget)
    return plan.prompt, truncation


def with_picture_hosts(context: ServerContext, request: GenerateRequest) -> GenerateRequest:
    """The request with the server's image URL hosts on its chat prompt (the only place a prompt learns them)."""
    if not isinstance(request.prompt, ChatPrompt) or not context.picture_hosts:
        return request
    return replace(request, prompt=replace(request.prompt, picture_hosts=context.picture_hosts))


def fit_budget(context: ServerContext, engine: AsyncEngine, request: GenerateRequest) -> ContextBudget | None:
    """The budget a chat is fitted into when it outgrows its context (app/generate/context_fit.py: its window, the
    room for the reply); None where nothing is cut: a prompt taken as it is, a request or a server
    (--context-overflow error) that says not to, a conversation with no turn before its newest."""
    prompt = request.prompt
    if not (isinstance(prompt, ChatPrompt) and request.truncate and context.context_overflow == "truncate"
            and droppable(prompt.messages)):
        return None
    window = engine.engine.max_model_len
    if request.window is not None:
        window = min(window, request.window.tokens)
    default = engine.engine.generation_defaults.values.get("max_tokens", context.default_max_tokens)
    # a route that names a window cuts max_tokens to what the context leaves (submit): an upper bound, not a need
    budget = ContextBudget.of(window, request.sampling.requested_max_tokens(), default or None,
                              cut_to_fit=request.window is not None)
    return budget if budget.limit > 0 else None  # a reply that needs the whole window: no prompt fits (submit's 400)


def submit(engine: AsyncEngine, request: GenerateRequest, rendered: Rendered,
           default_max_tokens: int, group: str | None = None) -> tuple[RequestStream, SamplingParams]:
    """Queue the rendered request (held to its constraint, compiled beforehand off the event loop); APIError 400
    naming the field for bad sampling values or a prompt that cannot fit."""
    prompt, prompt_field, window = rendered.prompt, request.prompt.field, request.window
    defaults = engine.engine.generation_defaults.values
    body = request.sampling.over_defaults(defaults)
    context = engine.engine.max_model_len
    # no default (0): what is left of the context, cut below
    default_max_tokens = defaults.get("max_tokens", default_max_tokens) or context
    try:
        params = body.sampling_params(default_max_tokens, request.logprobs)
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split()[0]) from None
    params.constraint, params.skip_special_tokens = rendered.constraint, rendered.skip_special_tokens
    params.prompt_logprobs = request.prompt_logprobs
    if window is not None:
        context = min(context, window.tokens)
        if len(prompt) >= context:
            raise APIError(400, f"{window.field}: the prompt's {len(prompt)} tokens leave no room in a context of "
                           f"{context} tokens", window.field, code="context_length_exceeded")
        params.max_tokens = min(params.max_tokens, context - len(prompt))
    if params.max_tokens == default_max_tokens and body.requested_max_tokens() is None:
        # no explicit limit: fit what is left of the context instead of rejecting the request
        params.max_tokens = max(1, min(params.max_tokens, context - len(prompt)))
    try:
        stream = engine.add_request(rendered.engine_prompt, params, group=group)
    except RequestRejected as exc:
        raise APIError(400, str(exc), prompt_field, code="context_length_exceeded") from None
    except ValueError as exc:  # the prompt's token ids, or logit_bias's, outside the vocabulary
        param = "logit_bias" if str(exc).startswith("logit_bias") else prompt_field
        raise APIError(400, str(exc), param) from None
    return stream, params
