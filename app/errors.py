"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)
