"""Embeddings for every dialect (OpenAI's /v1/embeddings, Ollama's /api/embed): each input is an embedding request
through the engine (core/pooling.py: the model's last hidden states pooled as its sentence-transformers config says,
by default mean-pooled and L2-normalised). A request's inputs are one group, which the scheduler shares fairly with
other requests (core/scheduler.py), and at most the engine's `max_num_seqs` of them are queued at a time (the next
as each finishes): a 2048-input request cannot fill the engine's queue, and its client leaving aborts a window, not
thousands. The model is the one the request names, or the server's --embedding-model, or the server's own. One
admission ticket covers the request; the inputs are tokenized and checked off the event loop; an input too long for
the context is refused before anything runs (or, asked for, truncated to the context's first tokens, as Ollama's
`truncate`)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from kvforge.app.generate.admission import Admission
from kvforge.app.generate.request import ContextWindow, check_prompt_chars
from kvforge.app.generate.stream import RequestTimedOut, within
from kvforge.app.http.errors import APIError
from kvforge.core.async_engine import AsyncEngine, RequestStream
from kvforge.core.output import RequestOutput
from kvforge.core.pooling import PoolingParams
from kvforge.core.scheduler import RequestRejected


@dataclass
class Embedded:
    """A request's embeddings, in input order, with their outputs (token counts and timings)."""

    embeddings: list[list[float]]
    outputs: list[RequestOutput]
    model: str  # the name of the model that embedded them

    @property
    def prompt_tokens(self) -> int:
        return sum(len(out.prompt_token_ids) for out in self.outputs)


def tokenize_inputs(engine: AsyncEngine, inputs: list[str] | list[list[int]], field: str, truncate: bool,
                    window: ContextWindow | None = None) -> list[list[int]]:
    """Each input's token ids (a list of ids is taken as it is); APIError 400 naming `field` (and the input's index
    when there are several) for an empty one, one the tokenizer cannot take, or, unless `truncate`, one too long
    for the model's context or the `window` asked for."""
    context, vocab = engine.engine.max_model_len, engine.engine.hf_config.vocab_size
    if window is not None and window.tokens < context:
        context = window.tokens
    prompts = []
    for i, item in enumerate(inputs):
        where = field if len(inputs) == 1 else f"{field}[{i}]"
        if isinstance(item, str):
            if not truncate:
                check_prompt_chars(engine, len(item), where)
            try:
                ids = engine.tokenizer.encode(item)
            except Exception as exc:  # text the tokenizer cannot take (e.g. a lone UTF-16 surrogate)
                raise APIError(400, f"{where}: cannot tokenize ({type(exc).__name__})", field) from None
        else:
            ids = list(item)
            if not engine.engine.in_vocabulary(ids):
                raise APIError(400, f"{where}: token ids must be in [0, {vocab})", field)
        if not ids:
            raise APIError(400, f"{where} must not be empty", field)
        if truncate:
            ids = ids[:context]
        elif window is not None and len(ids) > context:
            raise APIError(400, f"{where}: its {len(ids)} tokens do not fit the context of {context} tokens set by "
                           f"{window.field}", window.field, code="context_length_exceeded")
        try:  # every input is checked before any is queued: they are queued a window at a time
            engine.engine.validate_prompt(ids, PoolingParams())
        except RequestRejected as exc:
            raise APIError(400, f"{where}: {exc}", field, code="context_length_exceeded") from None
        prompts.append(ids)
    return prompts


async def embed(admission: Admission, inputs: list[str] | list[list[int]], field: str, timeout_s: float | None,
                truncate: bool = False, window: ContextWindow | None = None, dimensions: int | None = None,
                model: str | None = None, keep_alive_s: float | None = None) -> Embedded:
    """Every input's embedding (queued a window at a time, embed_windowed); aborted (blocks freed) if the client leaves
    or `timeout_s` passes (APIError 504). `field`: the request field the inputs came from, named in errors;
    `truncate`: inputs cut to the context (the model's, or a smaller `window`) instead of refused; `dimensions`: the
    size the client asks for, refused unless it is the model's (shortening embeddings is not supported); `model`: the
    model it names (None: the server's own, or its --embedding-model), loaded on demand, kept `keep_alive_s` after
    (Ollama's)."""
    if not inputs:
        raise APIError(400, f"{field} must not be empty", field)
    host = admission.host
    if host.embedding_model is not None:
        try:
            if host.entry_for(model) is None:  # no model, or the server's own: the dedicated embedding model's turn
                model = host.embedding_model
        except LookupError:
            pass  # enter() answers 404
    ticket = await admission.enter(model, keep_alive_s)
    try:
        engine = ticket.engine
        size = engine.engine.hf_config.hidden_size
        if dimensions is not None and dimensions != size:
            raise APIError(400, f"dimensions: this model embeds in {size} dimensions; shortening embeddings is not "
                           "supported", "dimensions")
        prompts = await run_in_threadpool(tokenize_inputs, engine, inputs, field, truncate, window)
        outputs = await embed_windowed(engine, prompts, timeout_s)
    except RequestTimedOut as exc:
        raise exc.api_error() from None
    finally:
        ticket.release()
    return Embedded([out.embedding for out in outputs], outputs, ticket.model)


async def embed_windowed(engine: AsyncEngine, prompts: list[list[int]], timeout_s: float | None,
                         params: PoolingParams | None = None) -> list[RequestOutput]:
    """Each prompt's final output, in order: one group in the engine, at most `max_num_seqs` of them queued at once
    (the request's share of the queue), all within `timeout_s` (RequestTimedOut past it). However it ends, each
    input still queued is aborted (its blocks freed) and none is queued after. `params`: a scoring request's
    (app/generate/rerank.py); by default an embedding's."""
    group, slots = f"embed-{uuid.uuid4().hex}", asyncio.Semaphore(engine.config.max_num_seqs)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s if timeout_s else None

    async def one(prompt: list[int]) -> RequestOutput:
        async with slots:
            stream = engine.add_request(prompt, params or PoolingParams(), group=group)
            left = None if deadline is None else max(deadline - loop.time(), 1e-3)
            try:
                return await _final(stream, left)
            finally:
                stream.abort()  # a no-op once finished

    tasks = [asyncio.ensure_future(one(prompt)) for prompt in prompts]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # after one failed (gather does not stop the others), or the client left
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # seen: only the first failure is raised


async def _final(stream: RequestStream, timeout_s: float | None) -> RequestOutput:
    async for out in within(stream, timeout_s):
        if out.finished:
            if out.embedding is None:  # aborted (the server is shutting down)
                raise APIError(503, "the request was stopped before its embedding was computed", None,
                               "server_error", "aborted")
            return out
    raise APIError(503, "the request ended without an embedding", None, "server_error", "aborted")
