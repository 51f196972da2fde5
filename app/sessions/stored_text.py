"""Text the store can keep on every database: PostgreSQL's text type cannot hold NUL characters (SQLite can), so
a request carrying one is refused (400) instead of failing in the database (500)."""

from __future__ import annotations

from pydantic import AfterValidator


def storable(text: str) -> str:
    if "\x00" in text:
        raise ValueError("must not contain NUL characters (\\u0000)")
    return text


# after a str's constraints: Annotated[str, Field(max_length=...), Storable] (pydantic words their errors as a str's)
Storable = AfterValidator(storable)
