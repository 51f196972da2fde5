"""The browser's login sessions: the cookie the login form sets holds a random session id, and the server keeps
the ids it handed out, so that /logout ends a session for good (a cookie that only signed its expiry stayed valid
after a logout until it expired).

The ids live in this process's memory only: a restart ends every session (the browser is sent to the login form
again), and so does a change of the key, which takes a restart. Only a digest of each id is kept; at most
MAX_SESSIONS are open at once (a new login past that ends the oldest session).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict

SESSION_SECONDS = 7 * 24 * 3600  # a session's life from its login
MAX_SESSIONS = 1000


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8", "replace")).hexdigest()


class LoginSessions:
    """Open sessions by the digest of their id, oldest first. Event-loop code only: not thread-safe."""

    def __init__(self, lifetime_s: float = SESSION_SECONDS, max_sessions: int = MAX_SESSIONS) -> None:
        self.lifetime_s, self.max_sessions = lifetime_s, max_sessions
        self._expiry: OrderedDict[str, float] = OrderedDict()

    def open(self) -> str:
        """A new session; its id (the cookie's value)."""
        session_id = secrets.token_urlsafe(32)
        self._expiry[_digest(session_id)] = time.time() + self.lifetime_s
        while len(self._expiry) > self.max_sessions:
            self._expiry.popitem(last=False)
        return session_id

    def valid(self, session_id: str) -> bool:
        if not session_id:
            return False
        digest = _digest(session_id)
        expires = self._expiry.get(digest)
        if expires is None:
            return False
        if expires < time.time():
            del self._expiry[digest]
            return False
        return True

    def close(self, session_id: str) -> None:
        """Logging out: the session ends now (an unknown id: nothing to do)."""
        self._expiry.pop(_digest(session_id), None)
