"""OpenAI's chat completions (POST /v1/chat/completions) and completions (POST /v1/completions). A request is mapped
to the canonical one (app/generate/request.py: a ChatPrompt or a TextPrompt) and goes through the one way in
(app/generate/admit.py: admission, render, tokenize, submit); its outputs come back as a whole response or as
server-sent events, in OpenAI's shape (app/dialects/openai/format.py). A chat longer than its context loses its oldest
whole turns (app/generate/context_fit.py): the X-KVForge-Dropped-Messages header and the extension field
`context_truncated` (on the response, or the first chunk) say what went."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Response

from kvforge.app.context import ServerContext
from kvforge.app.dialects.openai.format import (
    chat_logprobs,
    completion_logprobs,
    delta,
    finish_reason,
    message,
    timings,
    usage,
)
from kvforge.app.dialects.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvforge.app.generate.admit import Admitted, admit_all
from kvforge.app.generate.chat_output import read_whole
from kvforge.app.generate.context_fit import truncation_field, truncation_headers
from kvforge.app.generate.request import ChatPrompt, ContextWindow, GenerateRequest, TextPrompt
from kvforge.app.generate.stream import Failed, StreamResponse, merged
from kvforge.core.output import RequestOutput


def openai_router(context: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, response: Response):
        context.admission.check_model(body.model)
        request = GenerateRequest(prompt=ChatPrompt.of(body), sampling=body, logprobs=body.logprobs_count(),
                                  model=body.model, window=context_window(body))
        return await respond(body, [request], chat=True, response=response)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest):
        context.admission.check_model(body.model)
        constraint = body.structured_outputs.constraint() if body.structured_outputs else None
        # echo with logprobs: the prompt's own token logprobs lead each choice's (lm-eval's loglikelihood)
        prompt_logprobs = body.logprobs if body.echo else None
        requests = [GenerateRequest(prompt=TextPrompt(text=prompt, echo=body.echo, constraint=constraint),
                                    sampling=body, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs,
                                    model=body.model, window=context_window(body)) for prompt in body.prompts()]
        return await respond(body, requests, chat=False)

    async def respond(body: ChatCompletionRequest | CompletionRequest, requests: list[GenerateRequest], chat: bool,
                      response: Response | None = None):
        """Admit and queue the request (a completions batch: each prompt, choice i * n + j its prompt i's sample j),
        answer in OpenAI's shape: a whole response, or its server-sent events. A chat cut to fit its context says so
        (app/generate/context_fit.py): the header, and `context_truncated` on the response or the first chunk."""
        batch = await admit_all(context, requests)
        cut = batch[0].truncation
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def close_all() -> None:
                for admitted in batch:
                    admitted.close()

            return StreamResponse(sse(batch, request_id, created, include_usage), close_all,
                                  headers=truncation_headers(cut))
        try:
            collected = await asyncio.gather(*(admitted.collect() for admitted in batch))
        finally:
            for admitted in batch:  # one part failed: the others go too
                admitted.close()
        choices, finals = [], []
        for position, (admitted, whole) in enumerate(zip(batch, collected)):
            n, tokenizer = admitted.params.n, admitted.engine.tokenizer
            for i in range(n):
                out = whole.finals[i]
                finals.append(out)
                index = position * n + i
                if chat:
                    lp = None if admitted.params.logprobs is None else chat_logprobs(whole.logprobs.get(i, []),
                                                                                     tokenizer)
                    reply = read_whole(admitted.plan, out.text)
                    choices.append({"index": index, "message": message(reply), "logprobs": lp,
                                    "finish_reason": finish_reason(out, bool(reply.calls))})
                else:
                    lp = None if admitted.params.logprobs is None else completion_logprobs(
                        whole.logprobs.get(i, []), tokenizer, admitted.prompt, whole.prompt_logprobs.get(i))
                    choices.append({"index": index, "text": admitted.echoed + out.text, "logprobs": lp,
                                    "finish_reason": finish_reason(out)})
        if response is not None:
            response.headers.update(truncation_headers(cut))
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": batch[0].model, "choices": choices,
                "usage": usage(finals, sum(len(admitted.prompt) for admitted in batch)),
                "timings": timings(finals[0]), **truncation_field(cut)}

    async def sse(batch: list[Admitted], request_id: str, created: int, include_usage: bool) -> AsyncIterator[str]:
        """A chat's choices as content, reasoning and tool-call deltas; a completion's as text (a batch's prompts
        interleaved as their tokens come)."""
        first = batch[0]
        chat, tokenizer = first.plan is not None, first.engine.tokenizer
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> str:
            payload = {"id": request_id, "object": kind, "created": created, "model": first.model,
                       "choices": choices, **extra}
            return f"data: {json.dumps(payload)}\n\n"

        finals: list[RequestOutput] = []
        started: set[int] = set()  # completions: choices whose first chunk (with the echoed prompt) is sent
        opening = truncation_field(first.truncation)  # on the response's first chunk
        async for position, item in merged([admitted.outputs() for admitted in batch]):
            if isinstance(item, Failed):  # headers are sent: say it in the stream, as OpenAI does
                error = {"message": item.message, "type": item.kind, "param": None, "code": item.code}
                yield f"data: {json.dumps({'error': error})}\n\n"
                yield "data: [DONE]\n\n"
                return
            admitted, out = batch[position], item.out
            index = position * admitted.params.n + out.index
            if chat:
                lp = chat_logprobs(out.delta_logprobs, tokenizer) if out.delta_logprobs else None
                deltas = [delta(part, both_reasoning_names=True) for part in item.parts]
                if item.first:  # the role goes out with the first token (a true TTFT), not before prefill
                    deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}, *deltas[1:]]
                elif lp and not deltas:
                    deltas = [{"content": ""}]
                for j, shaped in enumerate(deltas):
                    yield chunk([{"index": index, "delta": shaped, "logprobs": lp if j == 0 else None,
                                  "finish_reason": None}], **opening)
                    opening = {}
            else:
                lp = None
                if out.delta_logprobs or out.prompt_logprobs is not None:
                    lp = completion_logprobs(out.delta_logprobs or [], tokenizer, admitted.prompt, out.prompt_logprobs)
                echo_now = admitted.echoed if index not in started else ""  # opens each choice's text
                if out.delta_text or lp or echo_now:
                    started.add(index)
                    yield chunk([{"index": index, "text": echo_now + out.delta_text, "logprobs": lp,
                                  "finish_reason": None}])
            if out.finished:
                finals.append(out)
                last = {"index": index, "logprobs": None, "finish_reason": finish_reason(out, item.called_tools)}
                last.update({"delta": {}} if chat else {"text": ""})
                yield chunk([last], timings=timings(out))
        if include_usage:
            yield chunk([], usage=usage(finals, sum(len(admitted.prompt) for admitted in batch)))
        yield "data: [DONE]\n\n"

    return router


def context_window(body: ChatCompletionRequest | CompletionRequest) -> ContextWindow | None:
    """The context the request asks for with Ollama's num_ctx (None: the model's)."""
    return ContextWindow(body.num_ctx, "num_ctx") if body.num_ctx is not None else None
