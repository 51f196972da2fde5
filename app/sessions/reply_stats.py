"""A reply's figures in one line, as the chat's tooltip and stats line and the Markdown export show them:
"24 tokens · 31.2 tok/s · TTFT 85 ms · 12 cached tokens", then how it ended when it did not end by itself, and the
messages its prompt left out of a conversation longer than the context."""

from __future__ import annotations

from typing import Any

# finish reasons worth saying (a reply that stopped by itself, "stop", says nothing)
ENDINGS = {"length": "max tokens reached", "abort": "stopped", "repetition": "stopped: it repeated itself",
           "timeout": "timed out", "tool_calls": "called tools"}


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def reply_stats_line(message: dict[str, Any] | None, left_out: bool = True) -> str:
    """The figures of an assistant message (a stored message's dict, Message.to_dict()); "" for any other message.
    A figure not known (a reply imported without it) is left out. `left_out`: with the count of messages its prompt
    left out, where it left some (False: the caller says so at length, as the chat's notice does)."""
    if not message or message.get("role") != "assistant":
        return ""
    parts = []
    if message.get("completion_tokens") is not None:
        parts.append(plural(message["completion_tokens"], "token"))
    if message.get("tokens_per_s"):
        parts.append(f"{message['tokens_per_s']:.1f} tok/s")
    if message.get("ttft_s") is not None:
        parts.append(f"TTFT {message['ttft_s'] * 1000:.0f} ms")
    if message.get("completion_tokens") is not None:  # a reply generated here: its cache hit, zero included
        parts.append(plural(message.get("cached_tokens") or 0, "cached token"))
    ending = ENDINGS.get(message.get("finish_reason"))
    parts += [ending] if ending else []
    truncated = message.get("context_truncated")
    if left_out and truncated:
        parts.append(f"{plural(truncated['dropped_messages'], 'older message')} left out")
    return " · ".join(parts)
