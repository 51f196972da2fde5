"""Between the API and the engine: a request body becomes an engine request (validated sampling
parameters, a max_tokens that fits the context), and engine outputs become OpenAI's response fields
(finish reason, usage, timings, logprobs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvforge.app.dialects.openai.protocol import SamplingFields
from kvforge.app.http.errors import APIError
from kvforge.core.async_engine import AsyncEngine, RequestStream
from kvforge.core.constraint import Constraint, InvalidConstraint
from kvforge.core.output import RequestOutput, TokenLogprob
from kvforge.core.sampling import SamplingParams
from kvforge.core.scheduler import RequestRejected


@dataclass(frozen=True)
class ContextWindow:
    """A context a request asks for (Ollama's options.num_ctx): its prompt must fit, and its output stops where the
    window ends. Larger than the model's context: the model's."""

    tokens: int
    field: str  # the request field that set it, named when the prompt does not fit


def submit(engine: AsyncEngine, prompt: list[int], body: SamplingFields, default_max_tokens: int,
           logprobs: int | None, prompt_field: str, constraint: Constraint | None = None,
           skip_special_tokens: bool = True,
           window: ContextWindow | None = None) -> tuple[RequestStream, SamplingParams]:
    """Queue the request (held to `constraint`, compiled beforehand off the event loop); APIError 400 naming the
    field for bad sampling values or a prompt that cannot fit (`prompt_field` names where the prompt came from)."""
    defaults = engine.engine.generation_defaults.values
    body = body.over_defaults(defaults)
    default_max_tokens = defaults.get("max_tokens", default_max_tokens)
    try:
        params = body.sampling_params(default_max_tokens, logprobs)
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split()[0]) from None
    params.constraint, params.skip_special_tokens = constraint, skip_special_tokens
    context = engine.engine.max_model_len
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
        stream = engine.add_request(prompt, params)
    except RequestRejected as exc:
        raise APIError(400, str(exc), prompt_field, code="context_length_exceeded") from None
    except ValueError as exc:  # the prompt's token ids, or logit_bias's, outside the vocabulary
        param = "logit_bias" if str(exc).startswith("logit_bias") else prompt_field
        raise APIError(400, str(exc), param) from None
    return stream, params


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
    if chars > context * engine.tokenizer.max_token_chars:
        raise APIError(400, f"{prompt_field}: {chars} characters cannot fit this model's context of {context} "
                       "tokens", prompt_field, code="context_length_exceeded")


class StreamResponse(StreamingResponse):
    """A streamed response (server-sent events, or Ollama's JSON lines) that runs `on_close` however it ends — also
    when the client went away before the body generator started (its own `finally` never runs then): the
    admission ticket is released and the request aborted exactly once either way."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None],
                 media_type: str = "text/event-stream") -> None:
        super().__init__(events, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class RequestTimedOut(Exception):
    kind, code = "timeout_error", "request_timeout"  # its type and code in OpenAI's error shape

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request ran past the server's --request-timeout of {seconds:g} s and was aborted")

    def api_error(self) -> APIError:
        """For a whole (not streamed) response: 504."""
        return APIError(504, str(self), None, self.kind, self.code)


async def within(stream: RequestStream, timeout_s: float | None) -> AsyncIterator[RequestOutput]:
    """The stream's outputs, aborting the request (its KV blocks freed) and raising RequestTimedOut once
    `timeout_s` seconds have passed since this call; no limit when None or 0."""
    if not timeout_s:
        async for out in stream:
            yield out
        return
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        left = deadline - asyncio.get_running_loop().time()
        try:
            out = await asyncio.wait_for(stream.__anext__(), max(left, 0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            stream.abort()
            raise RequestTimedOut(timeout_s) from None
        yield out


def finish_reason(out: RequestOutput, called_tools: bool = False) -> str:
    """OpenAI's finish_reason: "length", "tool_calls" (a reply that ended by calling tools) or "stop"; and ours,
    "repetition" (the repetition guard ended a reply stuck in a loop)."""
    if out.finish_reason in ("length", "repetition"):
        return out.finish_reason
    return "tool_calls" if called_tools else "stop"


def usage(finals, prompt_tokens: int) -> dict:
    finals = list(finals)
    completion = sum(len(o.token_ids) for o in finals)
    cached = max((o.num_cached_tokens for o in finals), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def timings(out: RequestOutput) -> dict:
    m = out.metrics or {}
    tpot = m.get("tpot")
    return {"ttft_ms": None if m.get("ttft") is None else round(m["ttft"] * 1000, 2),
            "tpot_ms": None if tpot is None else round(tpot * 1000, 2),
            "tokens_per_second": None if not tpot else round(1 / tpot, 2),
            "queue_ms": None if m.get("queue_time") is None else round(m["queue_time"] * 1000, 2)}


def format_logprobs(items: list[TokenLogprob], chat: bool, tokenizer) -> dict:
    """OpenAI's logprobs objects: chat {"content": [...]}, completions {"tokens", "token_logprobs", ...}."""

    def entry(token_id: int, logprob: float) -> dict:
        piece = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "id": token_id}

    if chat:
        return {"content": [entry(i.token_id, i.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in i.top]}
                            for i in items]}
    return {"tokens": [entry(i.token_id, i.logprob)["token"] for i in items],
            "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [{entry(t, lp)["token"]: lp for t, lp in i.top} for i in items]}
