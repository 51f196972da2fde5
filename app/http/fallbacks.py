"""What the API routes do not answer, answered in the API's own shape: 405 (with Allow) for a method an API path
does not take, 404 for an unknown path under /v1, /api or /admin. Without it Starlette hands such requests to the UI
mounted at /, which answers Gradio's own 404 page."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Route

from kvforge.app.http.errors import error_response


class ApiFallback:
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
