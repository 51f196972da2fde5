"""The front door of every route: the Host check, the Origin check (CORS), then the API key.

One pure ASGI middleware wraps the whole app — the OpenAI and sessions APIs, /admin, /metrics,
/openapi.json and the Gradio UI with its queue, SSE and websocket routes — so a route added later is
covered without opting in (deny by default). Only /health and the login page stay open.

- **Host** (DNS rebinding: a page on evil.example that re-points its name at 127.0.0.1 sends
  `Host: evil.example`): IP literals, `localhost` and `*.localhost`, the bound host name, the machine's own
  names when bound to every interface, and `--allowed-hosts` are served; any other name gets 403. IP literals
  are always safe here, as in Vite's and webpack-dev-server's host checks: rebinding needs a DNS name.
- **Origin** (a browser page on another origin): same-origin requests and `--allowed-origins` pass; any
  other Origin gets 403, preflights included. No CORS headers are sent unless the origin is allowed:
  the ones Gradio's own middleware adds are removed from every response.
- **API key** (when one is set): `Authorization: Bearer <key>`, `x-api-key: <key>` (Anthropic's clients),
  or the browser's session cookie from the login form (HttpOnly, SameSite=Strict: a random session id the server
  keeps, app/http/login_sessions.py, ended by /logout). A browser opening a page without it is sent to /login; anything
  else gets 401. Wrong keys are slowed per client address (app/http/key_throttle.py): past a few, 429 with Retry-After.
"""

from __future__ import annotations

import fnmatch
import html
import ipaddress
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, quote, urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import cookie_parser
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvforge.app.http.errors import error_response
from kvforge.app.http.key_throttle import KeyThrottle, client_address
from kvforge.app.http.login_sessions import SESSION_SECONDS, LoginSessions

OPEN_PATHS = frozenset({"/health"})
LOGIN_PATH, LOGOUT_PATH = "/login", "/logout"
COOKIE = "kvforge_session"
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
CORS_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
MAX_LOGIN_FORM_BYTES = 16 << 10


def host_name(host_header: str) -> str:
    """The name or address of a Host header, without port or brackets, lower case, no trailing dot."""
    value = host_header.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1:value.find("]")] if "]" in value else ""
    if value.count(":") == 1:
        value = value.rsplit(":", 1)[0]
    return value.rstrip(".")


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an Origin header or URL; None when it is not one (e.g. "null")."""
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.scheme, parts.hostname.rstrip("."), port or (443 if parts.scheme == "https" else 80)


@dataclass
class AccessPolicy:
    """Who may reach the server: the key (None: no key needed), the names it answers to, the origins
    allowed to call it from a browser page. `bound_host` is the address it listens on."""

    api_key: str | None = None
    bound_host: str = "127.0.0.1"
    allowed_hosts: list[str] = field(default_factory=list)  # "name", ".example.com" (and subdomains), "*"
    allowed_origins: list[str] = field(default_factory=list)  # "http://host:port", patterns ("http://*"), "*"
    sessions: LoginSessions = field(default_factory=LoginSessions)  # the browser's logins
    throttle: KeyThrottle = field(default_factory=KeyThrottle)  # wrong keys per client address

    def __post_init__(self) -> None:
        names = {"localhost", host_name(self.bound_host)}
        if self.bound_host in WILDCARD_BINDS:  # every interface: the machine's own names too
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        self._names = {n for n in names if n}
        self._patterns = [h.strip().lower() for h in self.allowed_hosts if h.strip()]

    def host_allowed(self, host_header: str) -> bool:
        name = host_name(host_header)
        if not name:
            return False
        if is_ip_literal(name) or name in self._names or name.endswith(".localhost"):
            return True
        for pattern in self._patterns:
            if pattern == "*" or pattern == name or (pattern.startswith(".") and
                                                     (name == pattern[1:] or name.endswith(pattern))):
                return True
        return False

    @staticmethod
    def same_origin(origin: str, scheme: str, host_header: str) -> bool:
        """The page was served by this server under this Host."""
        key = origin_key(origin)
        return key is not None and key == origin_key(f"{scheme}://{host_header}")

    def origin_allowed(self, origin: str, scheme: str, host_header: str) -> bool:
        """Same-origin, or an allowed origin."""
        if self.same_origin(origin, scheme, host_header):
            return True
        return any(fnmatch.fnmatchcase(origin.lower(), pattern.lower()) for pattern in self.allowed_origins)

    # --- the key and the browser's session cookie -------------------------------------------------

    def key_matches(self, given: str) -> bool:
        return secrets.compare_digest(given.encode(), self.api_key.encode())

    @staticmethod
    def presented_key(headers: Headers) -> str | None:
        """The key a request sends (Bearer or x-api-key), or None when it sends none."""
        bearer = headers.get("authorization", "")
        if bearer[:7].lower() == "bearer ":
            return bearer[7:].strip()
        if "x-api-key" in headers:
            return headers["x-api-key"].strip()
        return None

    def logged_in(self, headers: Headers) -> bool:
        return self.sessions.valid(cookie_parser(headers.get("cookie", "")).get(COOKIE, ""))


def safe_next(target: str | None) -> str:
    """Where to go after logging in: a path on this server only (no open redirect)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvforge: log in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font-family:system-ui,sans-serif;max-width:24rem;margin:12vh auto;padding:0 1rem}}
input{{width:100%;padding:.5rem;margin:.5rem 0;box-sizing:border-box}}button{{padding:.5rem 1.2rem}}
.error{{color:#b00020}}</style></head>
<body><h1>kvforge</h1><p>This server needs its API key.</p>{error}
<form method="post" action="/login"><input type="hidden" name="next" value="{next}">
<label for="key">API key</label><input id="key" name="key" type="password" autocomplete="current-password"
autofocus required><button type="submit">Log in</button></form></body></html>
"""


def login_page(next_path: str, error: str = "", status: int = 200) -> HTMLResponse:
    message = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    return HTMLResponse(LOGIN_PAGE.format(error=message, next=html.escape(next_path, quote=True)), status,
                        headers={"Cache-Control": "no-store"})


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None when it is longer than `limit`."""
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return body


class AccessGuard:
    """The ASGI middleware: Host, then Origin / CORS, then the key (see the module docstring)."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        websocket = scope["type"] == "websocket"
        refusal = self.refusal(scope, headers)
        if refusal is not None:
            if websocket:  # closing before accepting answers the handshake with 403
                await send({"type": "websocket.close", "code": 1008, "reason": refusal[1]})
            else:
                await error_response(refusal[0], refusal[1], None, "permission_error", refusal[2])(scope, receive, send)
            return
        origin = headers.get("origin")  # absent, same-origin or allowed (refused above otherwise)
        same = origin is None or self.policy.same_origin(origin, http_scheme(scope), headers.get("host", ""))
        cross_origin = None if same else origin
        if cross_origin and scope.get("method") == "OPTIONS" and "access-control-request-method" in headers:
            await self.preflight(cross_origin, headers)(scope, receive, send)  # an allowed origin (checked above)
            return
        if self.policy.api_key is not None and scope["path"] not in OPEN_PATHS:
            if scope["path"] in (LOGIN_PATH, LOGOUT_PATH) and not websocket:
                await self.login(scope, receive, send)
                return
            if not self.policy.logged_in(headers):
                key = self.policy.presented_key(headers)
                if key is None:
                    await self.unauthenticated(scope, headers, receive, send)
                    return
                if not await self.key_accepted(key, scope, receive, send):
                    return
        await self.app(scope, receive, self.cors_send(send, cross_origin))

    def refusal(self, scope: Scope, headers: Headers) -> tuple[int, str, str] | None:
        host = headers.get("host", "")
        if not self.policy.host_allowed(host):
            return (403, f"Host {host!r} is not allowed: this server answers to localhost and its own addresses "
                    "(start it with --allowed-hosts NAME to serve another name)", "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.policy.origin_allowed(origin, http_scheme(scope), host):
            return (403, f"Origin {origin!r} is not allowed: pages of other origins may not call this server "
                    "(start it with --allowed-origins ORIGIN to allow one)", "origin_not_allowed")
        return None

    def preflight(self, origin: str, headers: Headers) -> Response:
        allow = {"Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": CORS_METHODS,
                 "Access-Control-Max-Age": "600", "Vary": "Origin"}
        if "access-control-request-headers" in headers:
            allow["Access-Control-Allow-Headers"] = headers["access-control-request-headers"]
        return Response(status_code=204, headers=allow)

    def cors_send(self, send: Send, allowed_origin: str | None) -> Send:
        """Removes every CORS header an inner app set (Gradio's middleware adds its own); adds ours for an
        allowed cross-origin caller."""

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [(k, v) for k, v in message.get("headers", [])
                                      if not k.lower().startswith(b"access-control-")]
                if allowed_origin is not None:
                    out = MutableHeaders(scope=message)
                    out["Access-Control-Allow-Origin"] = allowed_origin
                    out.add_vary_header("Origin")
            await send(message)

        return wrapped

    async def key_accepted(self, key: str, scope: Scope, receive: Receive, send: Send) -> bool:
        """Check a presented key unless its address is locked out; answers the refusal itself (429 or 401)."""
        address = client_address(scope)
        wait = self.policy.throttle.retry_after(address)
        if wait:
            await self.too_many_failures(wait, scope, receive, send)
            return False
        if self.policy.key_matches(key):
            self.policy.throttle.succeeded(address)
            return True
        self.policy.throttle.failed(address)
        await self.unauthenticated(scope, Headers(scope=scope), receive, send)
        return False

    @staticmethod
    async def too_many_failures(wait: int, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"too many wrong API keys from this address: try again in {wait} s"
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": message})
            return
        await error_response(429, message, None, "rate_limit_error", "too_many_wrong_keys",
                             {"Retry-After": str(wait)})(scope, receive, send)

    async def unauthenticated(self, scope: Scope, headers: Headers, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
            return
        if scope["method"] in ("GET", "HEAD") and "text/html" in headers.get("accept", ""):
            target = scope["path"] + (f"?{scope['query_string'].decode('latin-1')}" if scope["query_string"] else "")
            await RedirectResponse(f"{LOGIN_PATH}?next={quote(target, safe='')}", 303)(scope, receive, send)
            return
        await error_response(401, "missing or wrong API key (send 'Authorization: Bearer <key>', or log in at "
                             "/login)", None, "authentication_error", "invalid_api_key",
                             {"WWW-Authenticate": "Bearer"})(scope, receive, send)

    async def login(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /login: the form; POST /login: the key -> a new session and its cookie (wrong keys count against the
        address, as the API's do); /logout: the session ended and the cookie cleared."""
        query = parse_qs(scope["query_string"].decode("latin-1"))
        if scope["path"] == LOGOUT_PATH:
            self.policy.sessions.close(cookie_parser(Headers(scope=scope).get("cookie", "")).get(COOKIE, ""))
            response: Response = RedirectResponse(LOGIN_PATH, 303)
            response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
        elif scope["method"] in ("GET", "HEAD"):
            response = login_page(safe_next(query.get("next", ["/"])[0]))
        elif scope["method"] == "POST":
            body = await read_body(receive, MAX_LOGIN_FORM_BYTES)
            form = parse_qs((body or b"").decode("utf-8", "replace"))
            target = safe_next(form.get("next", ["/"])[0])
            address = client_address(scope)
            wait = self.policy.throttle.retry_after(address)
            if wait:
                response = login_page(target, f"Too many wrong keys from this address: try again in {wait} s.", 429)
                response.headers["Retry-After"] = str(wait)
            elif body is not None and self.policy.key_matches(form.get("key", [""])[0]):
                self.policy.throttle.succeeded(address)
                response = RedirectResponse(target, 303)
                response.set_cookie(COOKIE, self.policy.sessions.open(), max_age=SESSION_SECONDS, path="/",
                                    httponly=True, samesite="strict")
            else:
                self.policy.throttle.failed(address)
                response = login_page(target, "Wrong API key.", 401)
        else:
            response = error_response(405, f"method {scope['method']} is not allowed on {scope['path']}", None,
                                      "invalid_request_error", "method_not_allowed")
        await response(scope, receive, send)


def http_scheme(scope: Scope) -> str:
    return {"ws": "http", "wss": "https"}.get(scope.get("scheme", "http"), scope.get("scheme", "http"))


def split_list(value: str | Iterable[str] | None) -> list[str]:
    """A comma-separated setting (or a TOML list) as a list of its non-empty items."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item and item.strip()]

