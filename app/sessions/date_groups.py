"""Conversations grouped by when they were last updated, as a desktop chat app's sidebar shows them: "Today",
"Yesterday", "Previous 7 days", "Previous 30 days", then one group per month ("November 2026"), newest first.

Days are calendar days in the time zone of `now` (a naive `now` is local time), so "Yesterday" starts at the
previous midnight, not 24 hours ago. A time after `now` (another machine's clock) counts as today.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TypeVar

T = TypeVar("T")

# English names, whatever the process's locale (strftime's %B follows LC_TIME)
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")


def date_label(updated_at: float, now: datetime) -> str:
    """The group of a Unix time seen at `now`."""
    when = datetime.fromtimestamp(updated_at, now.tzinfo)
    days = (now.date() - when.date()).days
    if days <= 0:
        return "Today"
    if days == 1:
        return "Yesterday"
    if days <= 7:
        return "Previous 7 days"
    if days <= 30:
        return "Previous 30 days"
    return f"{MONTHS[when.month - 1]} {when.year}"


def group_by_date(items: Iterable[T], updated_at: Callable[[T], float], now: datetime) -> list[tuple[str, list[T]]]:
    """(label, items) groups, newest first; each group's items the most recently updated first."""
    groups: dict[str, list[T]] = {}  # insertion order: newest group first, as the items are sorted
    for item in sorted(items, key=updated_at, reverse=True):
        groups.setdefault(date_label(updated_at(item), now), []).append(item)
    return list(groups.items())
