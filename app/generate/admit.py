"""A generation request's way into the engine, the same for every API dialect (OpenAI's routes, Ollama's, ...):
through the one gate (app/generate/admission.py), its prompt rendered and tokenized off the event loop (with its
constraint
compiled there), queued. Each dialect then reads the engine's outputs into its own response shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from kvforge.app.dialects.openai.protocol import ChatCompletionRequest, SamplingFields
from kvforge.app.generate.admission import Admission, Ticket
from kvforge.app.generate.chat_request import ChatPlan, plan_chat
from kvforge.app.generate.off_loop import off_loop
from kvforge.app.generate.stream import Failed, RequestTimedOut, drive
from kvforge.app.generate.submit import ContextWindow, check_prompt_chars, compile_constraint, submit
from kvforge.app.http.errors import APIError
from kvforge.app.http.metrics import ServerMetrics
from kvforge.core.async_engine import AsyncEngine, RequestStream
from kvforge.core.constraint import Constraint
from kvforge.core.output import RequestOutput, TokenLogprob
from kvforge.core.sampling import SamplingParams


@dataclass
class Admitted:
    """A queued request and what its response is made from."""

    ticket: Ticket
    engine: AsyncEngine
    stream: RequestStream
    params: SamplingParams
    prompt: list[int]
    plan: ChatPlan | None  # a chat's (how its output is read); None for a plain completion
    echoed: str = ""  # the text each choice starts with (completions' echo)

    @property
    def model(self) -> str:
        """The name of the model it runs on: what its response names."""
        return self.ticket.model

    def close(self) -> None:
        """However the response ends, once: the admission place released and the request aborted (a no-op once
        it finished; a client that went away frees its KV blocks)."""
        self.ticket.release()
        self.stream.abort()


async def admit(admission: Admission, body: SamplingFields, chars: int,
                render: Callable[[AsyncEngine], list[int] | ChatPlan], logprobs: int | None, prompt_field: str,
                default_max_tokens: int, echo: Callable[[AsyncEngine, list[int]], str] | None = None,
                constraint: Constraint | None = None, window: ContextWindow | None = None, model: str | None = None,
                keep_alive_s: float | None = None) -> Admitted:
    """Admit the request, render its prompt off the event loop, queue it. `chars`: the prompt's characters, checked
    before rendering; `render` gives the prompt's ids, or a chat's ChatPlan (which holds its constraint; `render`
    compiles it); `echo`: the text each choice starts with, from the engine and the prompt's ids; `constraint`: a
    completion's (compiled by `render`); `window`: a context the request asks for, smaller than the model's;
    `model`: the model it names (None: the server's own), loaded on demand, kept `keep_alive_s` after (Ollama's)."""
    ticket = await admission.enter(model, keep_alive_s)
    try:
        engine = ticket.engine
        check_prompt_chars(engine, chars, prompt_field)
        rendered = await off_loop(render, engine)
        plan = rendered if isinstance(rendered, ChatPlan) else None
        prompt = plan.prompt if plan is not None else rendered
        if not prompt:
            raise APIError(400, f"{prompt_field} must not be empty", prompt_field)
        # before the request is queued: a client gone during this await leaves nothing running
        echoed = await run_in_threadpool(echo, engine, prompt) if echo else ""
        stream, params = submit(engine, prompt, body, default_max_tokens, logprobs, prompt_field,
                                plan.constraint if plan else constraint, plan.skip_special_tokens if plan else True,
                                window)
    except BaseException:
        ticket.release()
        raise
    return Admitted(ticket, engine, stream, params, prompt, plan, echoed)


def render_chat(body: ChatCompletionRequest, engine: AsyncEngine) -> ChatPlan:
    """A chat request's plan with its constraint compiled: `render` for admit() (off the event loop)."""
    plan = plan_chat(body, engine.tokenizer)
    if plan.constraint is not None:
        compile_constraint(engine, plan.constraint, plan.constraint_field)
    return plan


def chat_chars(body: ChatCompletionRequest) -> int:
    """The characters a chat request's prompt is made from (its messages and tools), checked before rendering."""
    return sum(len(m.text()) for m in body.messages) + sum(len(t.model_dump_json()) for t in body.tools or [])


async def collect(admitted: Admitted, timeout_s: float | None,
                  metrics: ServerMetrics) -> tuple[dict[int, RequestOutput], dict[int, list[TokenLogprob]]]:
    """A whole (not streamed) response's outputs: each sample's final output and its token logprobs, by sample
    index. The request is closed however this ends; past `timeout_s` it is aborted and APIError 504 raised."""
    finals: dict[int, RequestOutput] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    try:
        async for item in drive(admitted.stream, admitted.plan, timeout_s, metrics, read=False):
            if isinstance(item, Failed):  # no headers sent yet: 504 past the timeout, the engine's failure as 503
                raise item.error.api_error() if isinstance(item.error, RequestTimedOut) else item.error
            out = item.out
            if out.delta_logprobs:
                logprobs.setdefault(out.index, []).extend(out.delta_logprobs)
            if out.finished:
                finals[out.index] = out
    finally:
        admitted.close()
    return finals, logprobs
