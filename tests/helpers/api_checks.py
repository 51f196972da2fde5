"""Assertions about HTTP responses shared by the server tests (httpx, requests and schemathesis responses
alike: anything with a .json() method)."""

from __future__ import annotations

from typing import Any


def assert_openai_error(response: Any) -> None:
    """The body is exactly OpenAI's error shape: {"error": {"message": non-empty str, "type": non-empty str,
    "param": str | None, "code": str | None}} and nothing else."""
    try:
        body = response.json()
    except ValueError:
        raise AssertionError(f"not a JSON body: {response.text[:500]!r}") from None
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


def lax_number(value) -> float | None:
    """What pydantic's lax mode could read as a number (ints, floats, numeric strings)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def assert_api_error(response: Any, path: str) -> None:
    """The error shape of the API `path` belongs to: Ollama's ({"error": non-empty str}, nothing else) under /api/,
    Anthropic's ({"type": "error", "error": {"type", "message"}}) under /v1/messages, OpenAI's elsewhere."""
    body = response.json()
    if path.startswith("/api/"):
        assert isinstance(body, dict) and set(body) == {"error"}, body
        assert isinstance(body["error"], str) and body["error"], body
    elif path.startswith("/v1/messages"):
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
        assert all(isinstance(v, str) and v for v in body["error"].values()), body
    else:
        assert_openai_error(response)
