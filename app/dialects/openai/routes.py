"""OpenAI's chat completions (POST /v1/chat/completions) and completions (POST /v1/completions). A request is mapped
to the canonical one (app/generate/request.py: a ChatPrompt or a TextPrompt) and goes through the one way in
(app/generate/admit.py: admission, render, tokenize, submit); its outputs come back as a whole response or as
server-sent events, in OpenAI's shape (app/dialects/openai/format.py)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter

from kvforge.app.context import ServerContext
from kvforge.app.dialects.openai.format import delta, finish_reason, format_logprobs, message, timings, usage
from kvforge.app.dialects.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvforge.app.generate.admit import Admitted, admit
from kvforge.app.generate.chat_output import read_whole
from kvforge.app.generate.request import ChatPrompt, GenerateRequest, TextPrompt
from kvforge.app.generate.stream import Failed, StreamResponse
from kvforge.core.output import RequestOutput


def openai_router(context: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        context.admission.check_model(body.model)
        request = GenerateRequest(prompt=ChatPrompt.of(body), sampling=body, logprobs=body.logprobs_count(),
                                  model=body.model)
        return await respond(body, request, chat=True)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest):
        context.admission.check_model(body.model)
        constraint = body.structured_outputs.constraint() if body.structured_outputs else None
        request = GenerateRequest(prompt=TextPrompt(text=body.prompt, echo=body.echo, constraint=constraint),
                                  sampling=body, logprobs=body.logprobs, model=body.model)
        return await respond(body, request, chat=False)

    async def respond(body: ChatCompletionRequest | CompletionRequest, request: GenerateRequest, chat: bool):
        """Admit and queue the request, answer in OpenAI's shape: a whole response, or its server-sent events."""
        admitted = await admit(context, request)
        engine, params, plan = admitted.engine, admitted.params, admitted.plan
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamResponse(sse(admitted, request_id, created, include_usage), admitted.close)
        finals, token_logprobs = await admitted.collect()
        choices = []
        for i in range(params.n):
            out = finals[i]
            lp = None if request.logprobs is None else format_logprobs(token_logprobs.get(i, []), chat,
                                                                        engine.tokenizer)
            if chat:
                reply = read_whole(plan, out.text)
                choices.append({"index": i, "message": message(reply), "logprobs": lp,
                                "finish_reason": finish_reason(out, bool(reply.calls))})
            else:
                choices.append({"index": i, "text": admitted.echoed + out.text, "logprobs": lp,
                                "finish_reason": finish_reason(out)})
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": admitted.model, "choices": choices, "usage": usage(finals.values(), len(admitted.prompt)),
                "timings": timings(finals[0])}

    async def sse(admitted: Admitted, request_id: str, created: int, include_usage: bool) -> AsyncIterator[str]:
        """A chat's choices as content, reasoning and tool-call deltas; a completion's as text."""
        chat, engine, echo = admitted.plan is not None, admitted.engine, admitted.echoed
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> str:
            payload = {"id": request_id, "object": kind, "created": created, "model": admitted.model,
                       "choices": choices, **extra}
            return f"data: {json.dumps(payload)}\n\n"

        finals: dict[int, RequestOutput] = {}
        started: set[int] = set()  # completions: samples whose first chunk (with the echoed prompt) is sent
        async for item in admitted.outputs():
            if isinstance(item, Failed):  # headers are sent: say it in the stream, as OpenAI does
                error = {"message": item.message, "type": item.kind, "param": None, "code": item.code}
                yield f"data: {json.dumps({'error': error})}\n\n"
                yield "data: [DONE]\n\n"
                return
            out = item.out
            lp = format_logprobs(out.delta_logprobs, chat, engine.tokenizer) if out.delta_logprobs else None
            if chat:
                deltas = [delta(part) for part in item.parts]
                if item.first:  # the role goes out with the first token (a true TTFT), not before prefill
                    deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}, *deltas[1:]]
                elif lp and not deltas:
                    deltas = [{"content": ""}]
                for j, shaped in enumerate(deltas):
                    yield chunk([{"index": out.index, "delta": shaped, "logprobs": lp if j == 0 else None,
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
            yield chunk([], usage=usage(finals.values(), len(admitted.prompt)))
        yield "data: [DONE]\n\n"

    return router
