"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers  # e.g. Retry-After on a 503


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


# a union's members each report an error; the one about the value beats the ones about another member's type
TYPE_MISMATCHES = frozenset({"string_type", "list_type", "int_type", "float_type", "bool_type", "dict_type",
                             "model_type", "int_parsing", "float_parsing", "none_required"})


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
    # field names and list indices; union member tags ("constrained-str", "list[...]") say nothing to a client
    loc = [str(p) for p in best.get("loc", ()) if p != "body" and (isinstance(p, int) or str(p).isidentifier())]
    message = best.get("msg", "invalid value")
    if best.get("type") == "finite_number":
        message = "must be a finite number"
    elif best.get("type") == "value_error":  # our validators' own words, without pydantic's "Value error, "
        message = str((best.get("ctx") or {}).get("error", message.removeprefix("Value error, ")))
    return f"{'.'.join(loc) or 'body'}: {message}", (loc[0] if loc else None)
