"""OpenAI's chat completions (POST /v1/chat/completions) and completions (POST /v1/completions): the canonical
dialect. A request goes through the one way in (app/generate/admit.py: admission, render, tokenize, submit); its
outputs come back as a whole response or as server-sent events, in OpenAI's shape."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import APIRouter

from kvforge.app.context import ServerContext
from kvforge.app.dialects.openai.format import finish_reason, format_logprobs, timings, usage
from kvforge.app.dialects.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvforge.app.generate.admit import admit, chat_chars, collect, render_chat
from kvforge.app.generate.chat_output import whole_message
from kvforge.app.generate.chat_request import ChatPlan
from kvforge.app.generate.stream import Failed, StreamResponse, drive
from kvforge.app.generate.submit import compile_constraint
from kvforge.app.http.errors import APIError
from kvforge.core.async_engine import AsyncEngine
from kvforge.core.constraint import Constraint
from kvforge.core.output import RequestOutput


def openai_router(context: ServerContext) -> APIRouter:
    router = APIRouter()
    admission, metrics = context.admission, context.metrics
    default_max_tokens, request_timeout_s = context.default_max_tokens, context.request_timeout_s

    def check_model(body: SamplingFields) -> None:
        admission.check_model(body.model)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        check_model(body)

        return await respond(body, chat_chars(body), partial(render_chat, body), body.logprobs_count(), chat=True)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body)

        constraint = body.structured_outputs.constraint() if body.structured_outputs else None

        def render(engine: AsyncEngine) -> list[int]:
            if constraint is not None:
                compile_constraint(engine, constraint, "structured_outputs")
            if isinstance(body.prompt, list):  # checked before echo decodes it (a huge id overflows the tokenizer)
                if not engine.engine.in_vocabulary(body.prompt):
                    raise APIError(400, f"prompt: token ids must be in [0, {engine.engine.hf_config.vocab_size})",
                                   "prompt")
                return body.prompt
            try:
                return engine.tokenizer.encode(body.prompt)
            except Exception as exc:  # text the tokenizer cannot take (e.g. a lone UTF-16 surrogate)
                raise APIError(400, f"prompt: cannot tokenize ({type(exc).__name__})", "prompt") from None

        def echo(engine: AsyncEngine, prompt: list[int]) -> str:  # the prompt's text, which starts each choice
            return body.prompt if isinstance(body.prompt, str) else engine.tokenizer.decode(prompt, False)

        chars = len(body.prompt) if isinstance(body.prompt, str) else 0
        return await respond(body, chars, render, body.logprobs, chat=False, echo=echo if body.echo else None,
                             constraint=constraint)

    async def respond(body: SamplingFields, chars: int, render: Callable[[AsyncEngine], list[int] | ChatPlan],
                      logprobs: int | None, chat: bool, echo: Callable[[AsyncEngine, list[int]], str] | None = None,
                      constraint: Constraint | None = None):
        """Admit and queue the request (app/generate/admit.py says what `render`, `echo` and `constraint` are), answer
        in OpenAI's shape."""
        prompt_field = "messages" if chat else "prompt"
        admitted = await admit(admission, body, chars, render, logprobs, prompt_field, default_max_tokens, echo,
                               constraint, model=body.model)
        engine, stream, params, plan, prompt = (admitted.engine, admitted.stream, admitted.params, admitted.plan,
                                                admitted.prompt)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamResponse(sse(engine, stream, request_id, created, plan, params.n, include_usage,
                                      len(prompt), admitted.model, admitted.echoed), admitted.close)
        finals, token_logprobs = await collect(admitted, request_timeout_s, metrics)
        choices = []
        for i in range(params.n):
            out = finals[i]
            lp = format_logprobs(token_logprobs.get(i, []), chat, engine.tokenizer) if logprobs is not None else None
            if chat:
                message, called = whole_message(plan, out.text)
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": finish_reason(out, called)})
            else:
                choices.append({"index": i, "text": admitted.echoed + out.text, "logprobs": lp,
                                "finish_reason": finish_reason(out)})
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": admitted.model, "choices": choices, "usage": usage(finals.values(), len(prompt)),
                "timings": timings(finals[0])}

    async def sse(engine: AsyncEngine, stream, request_id: str, created: int, plan: ChatPlan | None, n: int,
                  include_usage: bool, prompt_tokens: int, model: str, echo: str = "") -> AsyncIterator[str]:
        """`plan`: a chat's (its choices' text is read into content, reasoning and tool-call deltas); None for
        completions."""
        chat = plan is not None
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> str:
            payload = {"id": request_id, "object": kind, "created": created, "model": model,
                       "choices": choices, **extra}
            return f"data: {json.dumps(payload)}\n\n"

        finals: dict[int, RequestOutput] = {}
        started: set[int] = set()  # completions: samples whose first chunk (with the echoed prompt) is sent
        async for item in drive(stream, plan, request_timeout_s, metrics):
            if isinstance(item, Failed):  # headers are sent: say it in the stream, as OpenAI does
                error = {"message": item.message, "type": item.kind, "param": None, "code": item.code}
                yield f"data: {json.dumps({'error': error})}\n\n"
                yield "data: [DONE]\n\n"
                return
            out = item.out
            lp = format_logprobs(out.delta_logprobs, chat, engine.tokenizer) if out.delta_logprobs else None
            if chat:
                deltas = item.deltas
                if item.first:  # the role goes out with the first token (a true TTFT), not before prefill
                    deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}, *deltas[1:]]
                elif lp and not deltas:
                    deltas = [{"content": ""}]
                for j, delta in enumerate(deltas):
                    yield chunk([{"index": out.index, "delta": delta, "logprobs": lp if j == 0 else None,
                                  "finish_reason": None}])
            else:
                echo_now = echo if out.index not in started else ""  # opens each choice's text
                if out.delta_text or lp or echo_now:
                    started.add(out.index)
                    yield chunk([{"index": out.index, "text": echo_now + out.delta_text, "logprobs": lp,
                                  "finish_reason": None}])
            if out.finished:
                finals[out.index] = out
                last = {"index": out.index, "logprobs": None, "finish_reason": finish_reason(out, item.called_tools)}
                last.update({"delta": {}} if chat else {"text": ""})
                yield chunk([last], timings=timings(out))
        if include_usage:
            yield chunk([], usage=usage(finals.values(), prompt_tokens))
        yield "data: [DONE]\n\n"

    return router
