"""The sidebar's date groups (app/sessions/date_groups.py) at fixed times: calendar days in the time zone of `now`."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from kvforge.app.sessions.date_groups import date_label, group_by_date

TZ = timezone(timedelta(hours=2))
NOW = datetime(2026, 12, 4, 9, 30, tzinfo=TZ)  # a Friday morning


def at(*args: int) -> float:
    return datetime(*args, tzinfo=TZ).timestamp()


def test_labels_follow_calendar_days_then_months():
    cases = [
        (at(2026, 12, 4, 0, 0), "Today"),  # midnight
        (at(2026, 12, 4, 23, 0), "Today"),  # later than now (another clock): today
        (at(2026, 12, 3, 23, 59), "Yesterday"),  # 10 minutes ago, but yesterday
        (at(2026, 12, 3, 0, 0), "Yesterday"),
        (at(2026, 12, 2, 23, 59), "Previous 7 days"),
        (at(2026, 11, 27, 0, 0), "Previous 7 days"),  # 7 days
        (at(2026, 11, 26, 23, 59), "Previous 30 days"),  # 8 days
        (at(2026, 11, 4, 0, 0), "Previous 30 days"),  # 30 days
        (at(2026, 11, 3, 23, 59), "November 2026"),
        (at(2026, 1, 1, 0, 0), "January 2026"),
        (at(2025, 12, 31, 23, 59), "December 2025"),
    ]
    for when, label in cases:
        assert date_label(when, NOW) == label, datetime.fromtimestamp(when, TZ)
    # the same instant is another day elsewhere: 23:30 UTC on the 3rd is the 4th in UTC+2
    assert date_label(datetime(2026, 12, 3, 23, 30, tzinfo=timezone.utc).timestamp(), NOW) == "Today"
    # a naive now is local time, and so are the times
    naive = datetime(2026, 12, 4, 9, 30)
    assert date_label(datetime(2026, 12, 3, 23, 0).timestamp(), naive) == "Yesterday"


def test_groups_are_newest_first_with_their_items_most_recent_first():
    items = [("a", at(2026, 12, 4, 8, 0)), ("old", at(2025, 3, 1, 12, 0)), ("b", at(2026, 12, 4, 9, 0)),
             ("y", at(2026, 12, 3, 8, 0)), ("w", at(2026, 11, 30, 8, 0)), ("m", at(2026, 11, 10, 8, 0)),
             ("oct", at(2026, 10, 2, 8, 0)), ("older", at(2025, 3, 20, 12, 0))]
    groups = group_by_date(items, lambda item: item[1], NOW)
    assert [(label, [name for name, _ in group]) for label, group in groups] == [
        ("Today", ["b", "a"]), ("Yesterday", ["y"]), ("Previous 7 days", ["w"]), ("Previous 30 days", ["m"]),
        ("October 2026", ["oct"]), ("March 2025", ["older", "old"])]
    assert group_by_date([], lambda item: item[1], NOW) == []
