"""The FastAPI app, assembled: one ServerContext (app/context.py) shared by every router, the dialects' routes, the
sessions API, the fallbacks, the browser UI and the middleware every request passes.

A request's path: app/http/ (Host / Origin / key, body limit, disconnect watch) -> a dialect's route
(app/dialects/<api>/routes.py: its request translated into the canonical one) -> app/generate/ (the one admission
gate, the prompt rendered and tokenized off the event loop, the engine request submitted: admit.py) -> the engine
(core/async_engine.py) -> the outputs read back (app/generate/: text, reasoning, tool calls) -> the dialect's wire
format, whole or streamed.

Routes: OpenAI's /v1/chat/completions, /v1/completions (app/dialects/openai/routes.py), /v1/responses,
/v1/embeddings, /tokenize (app/dialects/openai/); Ollama's API under /api (app/dialects/ollama/); Anthropic's
Messages at /v1/messages (app/dialects/anthropic/); /v1/models and /admin/models (app/models/routes.py);
/v1/sessions and /v1/system_prompts (app/sessions/); /health and /metrics (app/http/metrics.py). Errors come in the
shape of the API a request was for (app/http/errors.py): 400 naming the bad field, 401 for a missing or wrong API
key, 404 for an unknown model, 503 when the bounded queue is full. A client that disconnects has its request
cancelled wherever it is (app/http/disconnect.py), aborted in the engine and its KV blocks freed, whole responses
included."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from kvforge.app.context import ServerContext
from kvforge.app.dialects.anthropic.routes import anthropic_router
from kvforge.app.dialects.ollama.routes import OllamaJSONBodies, ollama_router
from kvforge.app.dialects.openai.embeddings import embeddings_router
from kvforge.app.dialects.openai.responses import responses_router
from kvforge.app.dialects.openai.routes import openai_router
from kvforge.app.dialects.openai.tokenize import tokenize_router
from kvforge.app.dialects.rerank.routes import rerank_router
from kvforge.app.http.access import AccessGuard, AccessPolicy
from kvforge.app.http.disconnect import CancelOnDisconnect
from kvforge.app.http.errors import add_error_handlers
from kvforge.app.http.fallbacks import add_api_fallbacks
from kvforge.app.http.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from kvforge.app.http.metrics import status_router
from kvforge.app.models.factory import default_engine_factory
from kvforge.app.models.host import ModelHost
from kvforge.app.models.routes import models_router
from kvforge.app.models.spec import ModelSpec
from kvforge.app.sessions.history_routes import history_router
from kvforge.app.sessions.routes import sessions_router
from kvforge.app.sessions.service import ChatService
from kvforge.app.settings import serve_default
from kvforge.core.async_engine import AsyncEngine
from kvforge.core.store import Store

UIMount = Callable[[FastAPI, ChatService], FastAPI]  # the browser UI at /, over the sessions' ChatService


def create_app(host: ModelHost | AsyncEngine, model_name: str | None = None, api_key: str | None = None,
               max_pending: int = serve_default("max_pending"),
               default_max_tokens: int = serve_default("default_max_tokens"), models_dir=None,
               store: Store | None = None, ui: UIMount | None = None, access: AccessPolicy | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, request_timeout_s: float | None = None,
               context_overflow: str = serve_default("context_overflow"),
               image_url_hosts: list[str] | None = None) -> FastAPI:
    """`host` is a ModelHost, or an already running AsyncEngine served as `model_name`. With a
    `store`, the sessions API (/v1/sessions) keeps conversations in it, and `ui` (kvforge.ui.app.mount_ui)
    mounts the browser UI at / (it needs the store). `access` says who may call (default: loopback names, no CORS, and
    `api_key` when given); bodies over `max_request_bytes` get 413; a request still generating after
    `request_timeout_s` is aborted; a chat longer than its context is cut (`context_overflow` "truncate":
    app/generate/context_fit.py) or refused ("error"); a picture's http(s) URL is fetched only from
    `image_url_hosts` (app/generate/pictures.py)."""
    if isinstance(host, AsyncEngine):
        host = ModelHost(default_engine_factory, ModelSpec(served_name=model_name, tp=host.engine.config.tp_size),
                         host, models_dir)
    access = access or AccessPolicy(api_key=api_key)
    context = ServerContext.build(host, max_pending, default_max_tokens, request_timeout_s, context_overflow,
                                  frozenset(h.strip().lower() for h in image_url_hosts or () if h.strip()))
    app = FastAPI(title="kvforge", docs_url=None, redoc_url=None)
    app.state.host, app.state.metrics, app.state.admission = host, context.metrics, context.admission
    add_error_handlers(app)
    with_ui = store is not None and ui is not None
    app.include_router(status_router(context.metrics, root_page=not with_ui))
    app.include_router(models_router(context))
    app.include_router(openai_router(context))
    if store is not None:
        app.state.chat = ChatService(context, store)
        app.include_router(sessions_router(app.state.chat))
        app.include_router(history_router(app.state.chat))  # export, import, search, system-prompt presets
    app.include_router(tokenize_router(context))
    app.include_router(ollama_router(context))
    app.include_router(anthropic_router(context))
    app.include_router(responses_router(context))
    app.include_router(embeddings_router(context))
    app.include_router(rerank_router(context))
    add_api_fallbacks(app)  # after every API route, before the UI's mount, which would take every other request
    if with_ui:  # last: the UI mounted at / would shadow later routes
        app = ui(app, app.state.chat)
    # outermost first: Host / Origin / key, then the body cap, then the disconnect watch (add_middleware puts each
    # new one outside)
    app.add_middleware(OllamaJSONBodies)
    app.add_middleware(CancelOnDisconnect)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(AccessGuard, policy=access)
    return app
