"""Wrong API keys slowed per client address, so that a key cannot be guessed at the speed of the network.

The policy: an address may send 5 wrong keys (a Bearer header, `x-api-key` or the login form); then it is locked
out for 1 s, and each further wrong key doubles its lockout, up to 60 s. While locked out, every key it sends gets
429 with `Retry-After` without being checked (a check would tell a guesser when it is right), the correct one
included; a valid login cookie still passes (it is a random session id, not a guess). A correct key ends the
address's record; so do 15 minutes without a wrong key. Other addresses are not affected. A request without any
key is not a guess and is never counted. IPv6 clients are counted per /64 (one host holds a whole /64).

Hand-written: rate-limit libraries (e.g. `limits`) count requests in fixed or moving windows; what is wanted here
is a lockout that grows with each failure, which is a few lines over a dict.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

FREE_FAILURES = 5  # wrong keys an address may send before it waits
FIRST_LOCKOUT_S = 1.0  # the wait after them; each further wrong key doubles it
MAX_LOCKOUT_S = 60.0
FORGET_AFTER_S = 15 * 60.0  # an address with no wrong key for this long starts over
MAX_ADDRESSES = 10_000  # records kept (the least recently failing address is dropped first)


def client_address(scope: dict) -> str:
    """The address a request's failures count against: the peer's IP; an IPv6 peer's /64 network."""
    client = scope.get("client")
    host = client[0] if client else ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host or "unknown"  # a Unix socket or a test transport
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


@dataclass
class _Failures:
    count: int
    last: float  # time.monotonic() of the latest wrong key
    locked_until: float


class KeyThrottle:
    """Failed key checks per address (see the module docstring). Event-loop code only: not thread-safe."""

    def __init__(self, free_failures: int = FREE_FAILURES, first_lockout_s: float = FIRST_LOCKOUT_S,
                 max_lockout_s: float = MAX_LOCKOUT_S) -> None:
        self.free_failures, self.first_lockout_s, self.max_lockout_s = free_failures, first_lockout_s, max_lockout_s
        self._records: OrderedDict[str, _Failures] = OrderedDict()

    def retry_after(self, address: str) -> int:
        """Whole seconds `address` must still wait before a key of its is checked (0: it may try now)."""
        record = self._records.get(address)
        if record is None:
            return 0
        now = time.monotonic()
        if now - record.last > FORGET_AFTER_S:
            del self._records[address]
            return 0
        return math.ceil(record.locked_until - now) if record.locked_until > now else 0

    def failed(self, address: str) -> None:
        """A wrong key from `address`: counted, and past the free ones its lockout starts (or doubles)."""
        now = time.monotonic()
        record = self._records.pop(address, None)
        if record is None or now - record.last > FORGET_AFTER_S:
            record = _Failures(0, now, now)
        record.count += 1
        record.last = now
        if record.count >= self.free_failures:
            doublings = record.count - self.free_failures
            record.locked_until = now + min(self.max_lockout_s, self.first_lockout_s * 2 ** min(doublings, 32))
        self._records[address] = record  # the most recent last: the oldest go first when full
        while len(self._records) > MAX_ADDRESSES:
            self._records.popitem(last=False)

    def succeeded(self, address: str) -> None:
        """The correct key from `address`: its record ends."""
        self._records.pop(address, None)
