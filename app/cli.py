"""The `kvforge` command line."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    print("kvforge")
    return 0
