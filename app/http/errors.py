"""API errors in the shape of the API a request was for: OpenAI's, {"error": {"message", "type", "param", "code"}};
under /api/ Ollama's, {"error": "message"}; under /v1/messages Anthropic's, {"type": "error", "error": {"type",
"message"}}: each API's clients read their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kvforge.core.engine import RequestsFailed

OLLAMA_PATHS = "/api/"  # Ollama's API (app/dialects/ollama/routes.py)
ANTHROPIC_PATHS = "/v1/messages"  # Anthropic's Messages API (app/dialects/anthropic/routes.py)
# an HTTP status -> Anthropic's error type
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 504: "timeout_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers  # e.g. Retry-After on a 503


class ErrorResponse(JSONResponse):
    """An error in the shape of the API the request was for, chosen by the path it answers: so every place that
    refuses a request (the routes, the middleware, the fallback for unknown paths) answers each API in its own."""

    def __init__(self, status: int, message: str, param: str | None, kind: str, code: str | None,
                 headers: dict[str, str] | None) -> None:
        super().__init__({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                         headers=headers)
        self.message, self.given_headers = message, headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if path.startswith((OLLAMA_PATHS, ANTHROPIC_PATHS)):
            self.body = self.render({"error": self.message} if path.startswith(OLLAMA_PATHS)
                                    else anthropic_error(self.status_code, self.message))
            self.init_headers(self.given_headers)  # the new body's Content-Length
        await super().__call__(scope, receive, send)


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   code: str | None = None, headers: dict[str, str] | None = None) -> ErrorResponse:
    return ErrorResponse(status, message, param, kind, code, headers)


def renaming_route(names: dict[str, str]) -> type[APIRoute]:
    """A route class for another API's dialect, translated into OpenAI-shaped requests: an error about a field
    names it as that API's clients send it (`names`: OpenAI-shaped field -> theirs, e.g. max_tokens ->
    options.num_predict)."""

    class RenamingRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def route(request: Request):
                try:
                    return await handler(request)
                except APIError as exc:
                    name = names.get(exc.param or "")
                    if name is None:
                        raise
                    message = name + exc.message.removeprefix(exc.param) if exc.message.startswith(exc.param) \
                        else exc.message
                    raise APIError(exc.status, message, name, exc.kind, exc.code, exc.headers) from None

            return route

    return RenamingRoute


# a union's members each report an error; the one about the value beats the ones about another member's type
TYPE_MISMATCHES = frozenset({"string_type", "list_type", "int_type", "float_type", "bool_type", "dict_type",
                             "model_type", "int_parsing", "float_parsing", "none_required", "literal_error"})


def sent_path(body: Any, loc: list) -> list[str]:
    """An error's location as the client sent it: the keys and list indices found in the body, and a last
    name that is not there (a required field that is missing). Union members' tags that pydantic puts in the
    location ("json_schema", "ChatCompletionNamedToolChoice", "list[constrained-str]") say nothing to a client."""
    path, node = [], body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int) \
                and 0 <= part < len(node):
            path.append(str(part))
            node = node[part]
        elif i == len(loc) - 1 and isinstance(part, str) and part.isidentifier():
            path.append(part)
    return path


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first validation error in words, and the field it is about: "temperature: must be a finite
    number", "stop: List should have at most 32 items", "invalid JSON at line 1 column 13: Expecting value"."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # loc is ("body", character offset)
        offset = first.get("loc", ("body", 0))[-1]
        offset = offset if isinstance(offset, int) else 0
        doc = exc.body.decode("utf-8", "replace") if isinstance(exc.body, bytes) else str(exc.body or "")
        line = doc.count("\n", 0, offset) + 1
        column = offset - (doc.rfind("\n", 0, offset) + 1) + 1
        reason = (first.get("ctx") or {}).get("error", "not valid JSON")
        return f"invalid JSON at line {line} column {column}: {reason}", None
    field = tuple(first.get("loc", ()))[:2]
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == field]
    best = next((e for e in same_field if e.get("type") not in TYPE_MISMATCHES), first)
    loc = sent_path(exc.body, [p for p in best.get("loc", ()) if p != "body"])
    if best.get("type") == "extra_forbidden" and loc:  # the unknown key as sent (it need not be an identifier)
        where = f"{'.'.join(loc[:-1])}: " if len(loc) > 1 else ""
        return (f"{where}unknown field {loc[-1]!r} (neither OpenAI's nor one of this server's documented extras)",
                loc[0])
    message = best.get("msg", "invalid value")
    if best.get("type") == "finite_number":
        message = "must be a finite number"
    elif best.get("type") == "value_error":  # our validators' own words, without pydantic's "Value error, "
        message = str((best.get("ctx") or {}).get("error", message.removeprefix("Value error, ")))
    return f"{'.'.join(loc) or 'body'}: {message}", (loc[0] if loc else None)


def validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """`data` (an OpenAI-shaped request translated from another API's; None values left out) validated as `model`;
    an APIError 400 naming the field when it is not valid."""
    try:
        return model.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as exc:
        raise APIError(400, *validation_message(RequestValidationError(exc.errors(), body=data))) from None


def add_error_handlers(app: FastAPI) -> None:
    """Every error a route raises answered in its API's shape, never a bare 500 page: APIError as it says, a body
    that does not validate as 400 naming the field, Starlette's own errors, a request the engine failed (e.g. out of
    GPU memory: that request only) as 503, anything else as 500 naming the exception's type."""

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
    async def _request_failed(_: Request, exc: RequestsFailed):
        return error_response(503, str(exc), None, "server_error", "request_failed")

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}", None, "server_error")
