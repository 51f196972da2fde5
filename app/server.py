"""The FastAPI app: OpenAI-compatible REST API over one AsyncEngine.

Routes: /v1/chat/completions, /v1/completions, /v1/responses (app/responses_api.py; streamed as server-sent
events or whole),
/v1/sessions (conversations kept server-side, see sessions.py; export, import, search and /v1/system_prompts:
history_api.py),
/v1/models, /health, /metrics (Prometheus); Ollama's API under /api (app/ollama_api.py), Anthropic's Messages at
/v1/messages (app/anthropic_api.py). Errors come in OpenAI's shape, {"error": {"message", "type", "param",
"code"}} (in Ollama's and Anthropic's on their routes): 400 naming the bad field,
401 for a missing or wrong API key, 404 for an unknown model, 503 when the bounded queue is full. A client that
disconnects has its request cancelled wherever it is (app/disconnect.py), aborted in the engine and its KV blocks
freed, whole responses included."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from kvforge.app.access import AccessGuard, AccessPolicy
from kvforge.app.admission import Admission
from kvforge.app.anthropic_api import anthropic_router
from kvforge.app.chat_output import ChoiceReader, whole_message
from kvforge.app.chat_request import ChatPlan
from kvforge.app.chat_service import ChatService
from kvforge.app.completion import (
    RequestTimedOut,
    StreamResponse,
    compile_constraint,
    finish_reason,
    format_logprobs,
    timings,
    usage,
    within,
)
from kvforge.app.disconnect import CancelOnDisconnect
from kvforge.app.embeddings_api import embeddings_router
from kvforge.app.engine_factory import build_async_engine
from kvforge.app.errors import APIError, error_response, validation_message
from kvforge.app.generation import admit, chat_chars, collect, render_chat
from kvforge.app.history_api import history_router
from kvforge.app.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from kvforge.app.metrics import ServerMetrics
from kvforge.app.models import InvalidSpec, ModelHost, ModelSpec
from kvforge.app.ollama_api import OllamaJSONBodies, ollama_router
from kvforge.app.protocol import ChatCompletionRequest, CompletionRequest, LoadModelRequest, SamplingFields
from kvforge.app.responses_api import responses_router
from kvforge.app.sessions import sessions_router
from kvforge.app.tokenize_routes import tokenize_router
from kvforge.core.async_engine import AsyncEngine
from kvforge.core.constraint import Constraint
from kvforge.core.engine import RequestsFailed
from kvforge.core.metrics import gpu_memory
from kvforge.core.output import RequestOutput
from kvforge.core.store import Store


def default_engine_factory(spec: ModelSpec) -> AsyncEngine:
    """The swaps of a server made from a bare AsyncEngine: the spec over EngineConfig's defaults."""
    return build_async_engine(spec, progress=False)


class ApiFallback:
    """Answers, in OpenAI's shape, what the API routes do not: 405 (with Allow) for a method an API path does
    not take, 404 for an unknown path under /v1, /api or /admin. Without it Starlette hands such requests to the
    UI mounted at /, which answers Gradio's own 404 page."""

    def __init__(self, app: FastAPI) -> None:
        self.routes = list(http_routes(app.router.routes))

    async def __call__(self, scope, receive, send) -> None:
        allowed = sorted({m for r in self.routes if r.path_regex.match(scope["path"]) for m in (r.methods or ())})
        if allowed:
            response = error_response(405, f"method {scope['method']} is not allowed on {scope['path']} (allowed: "
                                      f"{', '.join(allowed)})", None, "invalid_request_error", "method_not_allowed",
                                      {"Allow": ", ".join(allowed)})
        else:
            response = error_response(404, f"no route {scope['path']}", None, "not_found_error", "not_found")
        await response(scope, receive, send)


def http_routes(routes):
    """The HTTP routes of a route table, those of included routers too."""
    for route in routes:
        if hasattr(route, "original_router"):  # FastAPI's include_router()
            yield from http_routes(route.original_router.routes)
        elif isinstance(route, APIRoute | Route):
            yield route


def add_api_fallbacks(app: FastAPI) -> None:
    """After the API's routes, before the UI's mount: every API path with any other method, and the rest of
    /v1, /api and /admin, go to ApiFallback (an ASGI endpoint: a Route with methods=None takes every method)."""
    fallback = ApiFallback(app)
    paths = {r.path for r in fallback.routes} | {"/v1/{rest:path}", "/admin/{rest:path}", "/api/{rest:path}"}
    for path in sorted(paths):
        app.router.routes.append(Route(path, fallback, include_in_schema=False))


def create_app(host: ModelHost | AsyncEngine, model_name: str | None = None, api_key: str | None = None,
               max_pending: int = 256, default_max_tokens: int = 512, models_dir=None,
               store: Store | None = None, ui: bool = False, access: AccessPolicy | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, request_timeout_s: float | None = None) -> FastAPI:
    """`host` is a ModelHost, or an already running AsyncEngine served as `model_name`. With a
    `store`, the sessions API (/v1/sessions) keeps conversations in it, and `ui` mounts the browser
    UI at / (it needs the store). `access` says who may call (default: loopback names, no CORS, and
    `api_key` when given); bodies over `max_request_bytes` get 413; a request still generating after
    `request_timeout_s` is aborted."""
    if isinstance(host, AsyncEngine):
        host = ModelHost(default_engine_factory, ModelSpec(served_name=model_name, tp=host.engine.config.tp_size),
                         host, models_dir)
    access = access or AccessPolicy(api_key=api_key)
    app = FastAPI(title="kvforge", docs_url=None, redoc_url=None)
    admission = Admission(host, max_pending)
    metrics = ServerMetrics(host, admission)
    app.state.host, app.state.metrics, app.state.admission = host, metrics, admission

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.kind, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), None, kind, getattr(exc, "code", None))

    @app.exception_handler(RequestsFailed)
    async def _request_failed(_: Request, exc: RequestsFailed):  # e.g. out of GPU memory: this request only
        return error_response(503, str(exc), None, "server_error", "request_failed")

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):  # never a bare 500 page
        return error_response(500, f"internal error: {type(exc).__name__}", None, "server_error")

    def check_model(body: SamplingFields) -> None:
        admission.check_model(body.model)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": host.name}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def model_card(name: str | None = None, engine: AsyncEngine | None = None) -> dict:
        """A loaded model's card (the server's own when none is given): how it runs and the memory it takes."""
        name, core = (name, engine.engine) if engine is not None else (host.name, host.current().engine)
        runtime = core.runtime()
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "kvforge", "loaded": True,
                "quant": core.config.quant, "quant_options": core.config.quant_options, "dtype": core.config.dtype,
                "decoding": core.config.decoding, "decoding_options": core.config.decoding_options,
                "tp": core.config.tp_size, "max_model_len": core.max_model_len,
                # what a request leaving these fields out gets (core/generation_defaults.py), and from where
                "sampling_defaults": core.generation_defaults.values,
                "sampling_defaults_source": core.generation_defaults.source,
                "device": runtime.device, "kernels": runtime.kernels, "cuda_graphs": runtime.cuda_graphs,
                "memory": {"weights_bytes": runtime.weight_bytes, "kv_cache_bytes": runtime.kv_cache_bytes,
                           "gpus": gpu_memory()}}

    @app.get("/v1/models")
    async def list_models():
        """The loaded models (the server's own first), then the others a request may name (loaded on demand)."""
        loaded = host.loaded()
        cards = [model_card(name, engine) for name, engine, _, _ in loaded]
        names = {name for name, _, _, _ in loaded} | {host.spec.name, host.default_entry}
        cards += [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "kvforge", "loaded": False}
                  for name in host.available() if name not in names]
        return {"object": "list", "data": cards}

    @app.get("/admin/models")
    async def admin_models():
        return {"loaded": model_card() if host.engine is not None else None, "available": host.available(),
                "in_flight": host.in_flight, "last_error": host.last_error}

    @app.post("/admin/models/load")
    async def admin_load(body: LoadModelRequest):
        spec = ModelSpec(body.model, body.dtype, body.quant, body.quant_options, body.served_model_name,
                         body.kv_cache_gb, body.decoding, body.decoding_options,
                         host.default_tp if body.tp is None else body.tp)
        try:
            await host.load(spec)
        except InvalidSpec as exc:  # refused before the swap began: a path, tp or the decoding plugin / options
            raise APIError(400, str(exc), exc.param) from None
        except ValueError as exc:  # bad path, unknown plugin, bad dtype, a split the model cannot take
            about_decoding = body.decoding != "none" and f"plugin {body.decoding!r}" in str(exc)
            param = ("decoding_options" if about_decoding else "tp" if "tensor-parallel" in str(exc)
                     else "kv_cache_gb" if "kv_cache" in str(exc) else "model")
            after = "" if host.engine is not None else " (no model is loaded: the tensor-parallel one went first)"
            raise APIError(400, f"{exc}{after}", param) from None
        except Exception as exc:  # the old model keeps serving, unless a tensor-parallel one was closed first
            after = "the previous model keeps serving" if host.engine is not None else "no model is loaded"
            raise APIError(400, f"loading failed, {after}: {type(exc).__name__}: {exc}", "model") from None
        return {"loaded": model_card()}

    @app.post("/admin/models/unload")
    async def admin_unload():
        await host.unload()
        return {"loaded": None}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        check_model(body)

        return await respond(body, chat_chars(body), partial(render_chat, body), body.logprobs_count(), chat=True)

    @app.post("/v1/completions")
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
        """Admit and queue the request (app/generation.py says what `render`, `echo` and `constraint` are), answer
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
        started: set[int] = set()  # samples whose first chunk (chat: with the role; echo: the prompt) is sent
        readers: dict[int, ChoiceReader] = {}
        try:
            async for out in within(stream, request_timeout_s):
                lp = format_logprobs(out.delta_logprobs, chat, engine.tokenizer) if out.delta_logprobs else None
                if chat:
                    reader = readers.setdefault(out.index, ChoiceReader(plan))
                    deltas = reader.read(out)
                    if out.index not in started:  # the role goes out with the first token (a true TTFT), not
                        started.add(out.index)    # before prefill
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
                    metrics.observe_finished(out)
                    called = chat and readers[out.index].num_tool_calls > 0
                    last = {"index": out.index, "logprobs": None, "finish_reason": finish_reason(out, called)}
                    last.update({"delta": {}} if chat else {"text": ""})
                    yield chunk([last], timings=timings(out))
            if include_usage:
                yield chunk([], usage=usage(finals.values(), prompt_tokens))
            yield "data: [DONE]\n\n"
        except (RequestsFailed, RequestTimedOut) as exc:  # headers are sent: say it in the stream, as OpenAI does
            kind, code = ((exc.kind, exc.code) if isinstance(exc, RequestTimedOut)
                          else ("server_error", "request_failed"))
            error = {"message": str(exc), "type": kind, "param": None, "code": code}
            yield f"data: {json.dumps({'error': error})}\n\n"
            yield "data: [DONE]\n\n"

    if store is not None:
        app.state.chat = ChatService(admission, store, metrics, default_max_tokens, request_timeout_s)
        app.include_router(sessions_router(app.state.chat))
        app.include_router(history_router(app.state.chat))  # export, import, search, system-prompt presets
    app.include_router(tokenize_router(admission))
    app.include_router(ollama_router(admission, metrics, default_max_tokens, request_timeout_s))
    app.include_router(anthropic_router(admission, metrics, default_max_tokens, request_timeout_s))
    app.include_router(responses_router(admission, metrics, default_max_tokens, request_timeout_s))
    app.include_router(embeddings_router(admission, request_timeout_s))
    add_api_fallbacks(app)  # after every API route, before the UI's mount, which would take every other request
    if store is not None and ui:  # last: the UI mounted at / would shadow later routes
        from kvforge.ui.app import mount_ui
        from kvforge.ui.dashboard import DashboardSampler

        app.state.sampler = DashboardSampler(host, metrics).start()
        app = mount_ui(app, app.state.chat, app.state.sampler)
    # outermost first: Host / Origin / key, then the body cap, then the disconnect watch (add_middleware puts each
    # new one outside)
    app.add_middleware(OllamaJSONBodies)
    app.add_middleware(CancelOnDisconnect)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(AccessGuard, policy=access)
    return app
