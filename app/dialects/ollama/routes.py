"""Ollama's REST API on the same server, for the local tools that speak only Ollama's dialect (Open WebUI's default,
editor plugins, home automation). A request is translated into the canonical one (app/dialects/ollama/protocol.py,
app/generate/request.py) and runs the same way: the one admission gate, the chat template, tools, constraints (`format`)
and reasoning (`think`).

    POST /api/chat       {"model", "messages", "tools", "format", "options", "think", "stream"} -> NDJSON or whole
    POST /api/generate   {"model", "prompt", "system", "raw", "context", ...} -> NDJSON or whole, with `context`
    GET  /api/tags       the models directory's models (`kvforge models`' list)
    POST /api/show       one of them: details, model_info, capabilities (and the template when it is loaded)
    POST /api/embed      {"model", "input", "truncate", "options": {"num_ctx"}, "dimensions"} -> {"embeddings", ...}
    POST /api/pull       {"model": "owner/name[:QUANT]", "stream"} -> progress lines (app/models/pull.py), into
    --models-dir
    GET  /api/ps         the loaded model, with its memory
    GET  /api/version    the Ollama API version these routes follow

Streams are JSON lines; the last has `done: true`, `done_reason` ("stop", "length"; "load" for an empty request,
which only checks that the model is loaded) and Ollama's timings in nanoseconds, filled from the request's metrics:
total_duration (arrival to finish), prompt_eval_count / prompt_eval_duration (the prompt's tokens, the time from
first scheduling to the first token), eval_count / eval_duration (generated tokens, first token to finish),
load_duration 0 (the model was loaded already). Errors are Ollama's {"error": "..."} with the status, naming the
Ollama field; an error after the stream began is a last line {"error": "..."}. A chat longer than its context
(options.num_ctx, or the model's) loses its oldest whole turns instead of being cut silently as Ollama does
(app/generate/context_fit.py): the X-KVForge-Dropped-Messages header and `context_truncated` (the whole response's,
the last line's) say what went.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from kvforge.app.context import ServerContext
from kvforge.app.dialects.ollama.protocol import (
    OLLAMA_NAMES,
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaModelRequest,
    OllamaPullRequest,
    OllamaRequest,
)
from kvforge.app.dialects.openai.format import chat_logprobs
from kvforge.app.dialects.openai.protocol import ChatCompletionRequest
from kvforge.app.generate.admit import Admitted, admit
from kvforge.app.generate.chat_output import read_whole
from kvforge.app.generate.chat_request import reasoning_syntax
from kvforge.app.generate.context_fit import truncation_field, truncation_headers
from kvforge.app.generate.embeddings import embed
from kvforge.app.generate.parsers.tool_calls import detect_tool_syntax
from kvforge.app.generate.reply import Part, Text, Thinking, ToolCall, WholeReply
from kvforge.app.generate.request import UNBOUNDED, ChatPrompt, ContextWindow, GenerateRequest, TextPrompt
from kvforge.app.generate.stream import Failed, StreamResponse
from kvforge.app.http.errors import APIError, renaming_route
from kvforge.app.models.catalog import LISTING_DEADLINE_S, ModelEntry, catalog
from kvforge.app.models.keep_alive import forever_from_now
from kvforge.app.models.pull import PullError, PullProgress, parse_name, pull
from kvforge.core.output import RequestOutput

OLLAMA_API_VERSION = "0.12.0"  # the Ollama release whose API these routes follow (clients read it for features)
NDJSON = "application/x-ndjson"


class OllamaJSONBodies:
    """Ollama reads every request body as JSON whatever its Content-Type, and its documentation's curl examples send
    none (curl then says form data): requests to /api/ are read as JSON too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/api/"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def nanoseconds(seconds: float | None) -> int:
    return int(round((seconds or 0) * 1e9))


def final_fields(out: RequestOutput, prompt_tokens: int) -> dict[str, Any]:
    """The last line's done_reason and timings (the module's docstring says what each is)."""
    m = out.metrics or {}
    ttft, queued = m.get("ttft") or 0, m.get("queue_time") or 0
    return {"done": True, "done_reason": "length" if out.finish_reason == "length" else "stop",
            "total_duration": nanoseconds(m.get("e2e_latency")), "load_duration": 0,
            "prompt_eval_count": prompt_tokens, "prompt_eval_duration": nanoseconds(max(ttft - queued, 0)),
            "eval_count": len(out.token_ids), "eval_duration": nanoseconds(max((m.get("e2e_latency") or 0) - ttft, 0))}


def shaped(name: str, message: dict[str, Any], chat: bool) -> dict[str, Any]:
    """A line or whole response around an Ollama message: /api/chat's carries it, /api/generate's its text (and
    thinking)."""
    line = {"model": name, "created_at": now()}
    if chat:
        line["message"] = message
    else:
        line["response"] = message["content"]
        if message.get("thinking"):
            line["thinking"] = message["thinking"]
    return line


def last_fields(admitted: Admitted, out: RequestOutput, chat: bool) -> dict[str, Any]:
    """What the last line adds: done, done_reason, the timings; /api/generate's `context` (prompt and output ids,
    which a next request may continue from); what a chat cut to fit its context left out (`context_truncated`)."""
    fields = final_fields(out, len(admitted.prompt)) | truncation_field(admitted.truncation)
    if not chat:
        fields["context"] = admitted.prompt + list(out.token_ids)
    return fields


def tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "function": {"index": call.index, "name": call.name, "arguments": call.arguments_value}}


def part_message(part: Part) -> dict[str, Any]:
    """One part of a streamed reply as an Ollama message."""
    message: dict[str, Any] = {"role": "assistant", "content": part.text if isinstance(part, Text) else ""}
    if isinstance(part, Thinking):
        message["thinking"] = part.text
    elif isinstance(part, ToolCall):
        message["tool_calls"] = [tool_call(part)]
    return message


def whole_message(reply: WholeReply) -> dict[str, Any]:
    """A finished reply as an Ollama message."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.thinking:
        message["thinking"] = reply.thinking
    if reply.calls:
        message["tool_calls"] = [tool_call(call) for call in reply.calls]
    return message


def ollama_logprobs(items, tokenizer) -> list[dict[str, Any]]:
    def entry(e: dict) -> dict:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}

    return [entry(e) | {"top_logprobs": [entry(t) for t in e["top_logprobs"]]}
            for e in chat_logprobs(items, tokenizer)["content"]]


def ollama_router(context: ServerContext) -> APIRouter:
    admission, host = context.admission, context.host
    router = APIRouter(route_class=renaming_route(OLLAMA_NAMES))  # errors name Ollama's fields

    def served(name: str) -> str:
        """`name` as the response names it (Ollama's clients add the tag ":latest"); 404 for no model here."""
        admission.check_model(name)
        return name

    async def load_or_unload(body: OllamaRequest | OllamaEmbedRequest) -> str:
        """An empty request: Ollama's way to load a model (or, with keep_alive 0, to unload one loaded on demand);
        the done_reason."""
        keep_alive = body.keep_alive_s()
        entry = host.entry_for(body.model)
        if keep_alive == 0 and entry is not None and await host.unload_on_demand(entry):
            return "unload"
        ticket = await admission.enter(body.model, keep_alive)
        ticket.release()
        return "load"

    def context_window(body: OllamaRequest, prompt_field: str) -> ContextWindow:
        num_ctx = body.num_ctx()
        return ContextWindow(num_ctx or UNBOUNDED, "options.num_ctx" if num_ctx else prompt_field)

    def chat_prompt(body: OllamaRequest, request: ChatCompletionRequest, prefix: list[int] | None,
                    field: str) -> ChatPrompt:
        return ChatPrompt.of(request, prefix=prefix or [], reasoning_field="think" if body.think else None,
                             field=field)

    @router.post("/api/chat")
    async def chat(body: OllamaChatRequest, response: Response):
        name = served(body.model)
        if not body.messages:
            return {"model": name, "created_at": now(), "message": {"role": "assistant", "content": ""},
                    "done": True, "done_reason": await load_or_unload(body)}
        request = body.chat_request()
        admitted = await admit(context, GenerateRequest(
            prompt=chat_prompt(body, request, None, "messages"), sampling=request, logprobs=request.logprobs_count(),
            model=body.model, keep_alive_s=body.keep_alive_s(), window=context_window(body, "messages")))
        return await respond(admitted, name, body.stream, chat=True, response=response)

    @router.post("/api/generate")
    async def generate(body: OllamaGenerateRequest):
        name = served(body.model)
        if not body.prompt and not body.context:
            return {"model": name, "created_at": now(), "response": "", "done": True,
                    "done_reason": await load_or_unload(body)}
        if body.raw:
            request = body.completion_request()
            prompt, logprobs = TextPrompt(text=body.prompt, prefix=body.context or []), request.logprobs
        else:
            request = body.chat_request()
            prompt, logprobs = chat_prompt(body, request, body.context, "prompt"), request.logprobs_count()
        admitted = await admit(context, GenerateRequest(
            prompt=prompt, sampling=request, logprobs=logprobs, model=body.model, keep_alive_s=body.keep_alive_s(),
            window=context_window(body, "prompt")))
        return await respond(admitted, name, body.stream, chat=False)

    async def respond(admitted: Admitted, name: str, stream: bool, chat: bool, response: Response | None = None):
        """`chat`: /api/chat's shape (a message); else /api/generate's (a response text, and the context). A chat
        cut to fit its context says so: the header, and `context_truncated` on the whole response or last line."""
        headers = truncation_headers(admitted.truncation)
        if stream:
            return StreamResponse(lines(admitted, name, chat), admitted.close, NDJSON, headers)
        if response is not None:
            response.headers.update(headers)
        collected = await admitted.collect()
        final, token_logprobs = collected.finals[0], collected.logprobs
        if admitted.plan is None:  # a raw prompt: the text as it came
            message = {"role": "assistant", "content": final.text}
        else:
            message = whole_message(read_whole(admitted.plan, final.text))
        whole = shaped(name, message, chat)
        whole.update(last_fields(admitted, final, chat))
        if token_logprobs.get(0):
            whole["logprobs"] = ollama_logprobs(token_logprobs[0], admitted.engine.tokenizer)
        return whole

    async def lines(admitted: Admitted, name: str, chat: bool) -> AsyncIterator[str]:
        """A streamed response's JSON lines."""
        async for item in admitted.outputs():
            if isinstance(item, Failed):  # the status is sent: say it in the stream, as Ollama does
                yield json.dumps({"error": item.message}) + "\n"
                return
            out = item.out
            messages = [part_message(part) for part in item.parts]
            logprobs = ollama_logprobs(out.delta_logprobs, admitted.engine.tokenizer) if out.delta_logprobs else None
            if logprobs and not messages:
                messages = [{"role": "assistant", "content": ""}]
            for i, message in enumerate(messages):
                line = shaped(name, message, chat) | {"done": False}
                if logprobs and i == 0:
                    line["logprobs"] = logprobs
                yield json.dumps(line) + "\n"
            if out.finished:
                last = shaped(name, {"role": "assistant", "content": ""}, chat)
                yield json.dumps(last | last_fields(admitted, out, chat)) + "\n"

    @router.get("/api/version")
    async def version():
        return {"version": OLLAMA_API_VERSION}

    async def entries(names: set[str] | None = None) -> list[ModelEntry]:
        """The models directory's entries (or those of `names`), read off the event loop within the listing
        deadline: an entry not read by then comes with an error, as a broken one does."""
        engine = host.engine
        tokens = engine.engine.max_model_len if engine is not None else 4096
        return await run_in_threadpool(catalog, host.models_dir, tokens, "auto", names, LISTING_DEADLINE_S)

    @router.get("/api/tags")
    async def tags():
        return {"models": [tag(e) for e in await entries() if e.error is None]}

    @router.post("/api/show")
    async def show(body: OllamaModelRequest):
        base = body.model.removesuffix(":latest")
        entry = next(iter(await entries({base})), None)
        loaded = host.engine is not None and base == host.name
        if entry is None and not loaded:
            raise APIError(404, f"model {body.model!r} not found", "model")
        if entry is not None and entry.error is not None and not loaded:
            raise APIError(400, f"model {body.model!r} cannot be read: {entry.error}", "model")
        engine = host.engine if loaded else None
        family = details(entry).get("family") or (engine.engine.hf_config.model_type if engine is not None else None)
        info: dict[str, Any] = {"general.architecture": family}
        if entry is not None:
            info["general.parameter_count"] = entry.parameters
        # as Ollama's: a generative model's (its /api/embed pools states, but it is no trained sentence encoder);
        # tools: a template without tool syntax gets the default rendering. Copilot hides a model without tools.
        capabilities = ["completion", "tools"]
        result: dict[str, Any] = {"details": details(entry), "model_info": info, "capabilities": capabilities,
                                  "modified_at": modified_at(entry)}
        if engine is not None:
            # where clients (VS Code Copilot) read the context: the one served, which is what a prompt must fit
            info[f"{family}.context_length"] = engine.engine.max_model_len
            trained = getattr(engine.engine.hf_config, "max_position_embeddings", None)
            if trained:
                info["kvforge.trained_context_length"] = trained
            result["template"] = shown_template(engine.tokenizer.hf.chat_template)
            result["parameters"] = f"num_ctx {engine.engine.max_model_len}"
            if reasoning_syntax(engine.tokenizer) is not None:
                capabilities.append("thinking")
            if engine.tokenizer.takes_images:  # Ollama's name for a model that takes pictures
                capabilities.append("vision")
        return result

    @router.post("/api/embed")
    async def embed_texts(body: OllamaEmbedRequest) -> dict[str, Any]:
        served(body.model)
        num_ctx = body.num_ctx()
        result = await embed(admission, body.inputs(), "input", context.request_timeout_s, truncate=body.truncate,
                             window=ContextWindow(num_ctx, "options.num_ctx") if num_ctx else None,
                             dimensions=body.dimensions, model=body.model, keep_alive_s=body.keep_alive_s())
        took = max((out.metrics or {}).get("e2e_latency") or 0 for out in result.outputs)
        return {"model": body.model, "embeddings": result.embeddings, "total_duration": nanoseconds(took),
                "load_duration": 0, "prompt_eval_count": result.prompt_tokens}

    @router.post("/api/pull")
    async def pull_model(body: OllamaPullRequest):
        if host.models_dir is None:
            raise APIError(400, "model: this server has no models directory to pull into (--models-dir)", "model")
        try:
            parse_name(body.model)
        except PullError as exc:
            raise APIError(400, f"model: {exc}", "model") from None
        loop, progress = asyncio.get_running_loop(), asyncio.Queue()

        def report(step: PullProgress) -> None:
            loop.call_soon_threadsafe(progress.put_nowait, step)

        task = asyncio.ensure_future(asyncio.to_thread(pull, body.model, host.models_dir, None, report))
        if not body.stream:
            try:
                await task
            except PullError as exc:
                raise APIError(400, f"model: {exc}", "model") from None
            return {"status": "success"}

        async def lines() -> AsyncIterator[str]:
            while not (task.done() and progress.empty()):
                getter = asyncio.ensure_future(progress.get())
                await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                step = getter.result()
                line = {"status": step.status, "digest": step.digest, "total": step.total, "completed": step.completed}
                yield json.dumps({k: v for k, v in line.items() if v is not None}) + "\n"
            if task.exception() is not None:
                error = task.exception()
                message = f"model: {error}" if isinstance(error, PullError) else f"{type(error).__name__}: {error}"
                yield json.dumps({"error": message}) + "\n"

        return StreamResponse(lines(), lambda: None, NDJSON)

    @router.get("/api/ps")
    async def ps():
        """Every loaded model: the server's own (it stays loaded) and those loaded on demand."""
        catalogued = {e.name: e for e in await entries(
            {resident.name if resident is not None else host.default_entry for _, _, _, resident in host.loaded()})}
        models = []
        for name, engine, size, resident in host.loaded():  # as they are now: models may have come or gone meanwhile
            entry = catalogued.get(resident.name if resident is not None else host.default_entry)
            # the server's own model stays loaded: Ollama's "forever" (a timestamp ~292 years on), as for keep_alive -1
            expires = resident.expires_at() if resident is not None else forever_from_now()
            models.append({"name": tagged(name), "model": tagged(name), "size": size,
                           "size_vram": size if engine.engine.runtime().device.startswith("cuda") else 0,
                           "digest": digest(entry), "details": details(entry),
                           "expires_at": datetime.fromtimestamp(expires, UTC).isoformat().replace("+00:00", "Z"),
                           "context_length": engine.engine.max_model_len})
        return {"models": models}

    return router


# where the chat template has no tool syntax, kvforge describes the tools in a system prompt and reads calls back
# (app/generate/tool_prompts.py): said in a Jinja comment (it renders nothing), because clients judge tool support by
# the template's text (litellm: "tools" in it), as Ollama's templates for tool-calling models mention .Tools
TOOLS_NOTE = ("\n{#- kvforge: with tools, they are described in a system prompt and calls read back as <tool_call> "
              "JSON (app/generate/tool_prompts.py) #}")


def shown_template(template: str | None) -> str | None:
    """The chat template as /api/show gives it: the model's own, and where it has no tool syntax, the note above."""
    if template is None or detect_tool_syntax(template).template_supports_tools:
        return template
    return template + TOOLS_NOTE


def tag(entry: ModelEntry) -> dict[str, Any]:
    return {"name": tagged(entry.name), "model": tagged(entry.name), "modified_at": modified_at(entry),
            "size": entry.size_bytes, "digest": digest(entry), "details": details(entry)}


def tagged(name: str) -> str:
    """A model's name as Ollama lists it, with a tag (":latest" where it has none): Open WebUI keeps the Ollama and
    the OpenAI connection's models apart by their ids, and the OpenAI side lists the bare name. Requests take
    either (app/models/host.py drops ":latest")."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def details(entry: ModelEntry | None) -> dict[str, Any]:
    if entry is None:
        return {}
    family = (entry.architecture or "").lower().removesuffix("forcausallm") or None
    return {"parent_model": "", "format": entry.format, "family": family, "families": [family] if family else None,
            "parameter_size": parameter_size(entry.parameters), "quantization_level": entry.quantization}


def parameter_size(parameters: int | None) -> str | None:
    if not parameters:
        return None
    return f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"


def modified_at(entry: ModelEntry | None) -> str | None:
    if entry is None or entry.modified_ns is None:
        return None
    return datetime.fromtimestamp(entry.modified_ns / 1e9, UTC).isoformat().replace("+00:00", "Z")


def digest(entry: ModelEntry | None) -> str | None:
    """An identity of the entry's file version (path, size, modification time, as the catalog read them): Ollama's
    digests name blobs, which a models directory does not have; hashing the content would read gigabytes per
    listing."""
    if entry is None or entry.path is None or entry.modified_ns is None:
        return None
    return hashlib.sha256(f"{entry.path}:{entry.size_bytes}:{entry.modified_ns}".encode()).hexdigest()

