"""A conversation as Markdown, for reading and sharing: the branch shown, as the chat shows it.

    # Title
    ### System          (the conversation's system prompt, when it has one)
    ### User / ### Assistant / ### Tool `call_id`   each message's content
    <details><summary>Reasoning</summary> ... </details>   a reasoning model's thinking, folded
    ```json [tool calls] ```                             the calls a reply made
    *24 tokens · 31.2 tok/s · TTFT 85 ms · 12 cached tokens*   a reply's figures (app/sessions/reply_stats.py)

Content is the model's own Markdown, kept as it is; the other branches are in the JSON export (app/sessions/history.py).
"""

from __future__ import annotations

import json
import re

from kvforge.app.sessions.conversations import Conversation, Message
from kvforge.app.sessions.reply_stats import reply_stats_line

ROLE_HEADINGS = {"user": "User", "assistant": "Assistant", "tool": "Tool"}


def conversation_markdown(conv: Conversation) -> str:
    """The conversation (loaded with its messages) as a Markdown document."""
    sections = [f"# {' '.join(conv.title.split())}"]
    system_prompt = (conv.settings or {}).get("system_prompt")
    if system_prompt:
        sections.append(f"### System\n\n{system_prompt}")
    sections += [message_markdown(m) for m in conv.messages]
    return "\n\n".join(sections) + "\n"


def message_markdown(m: Message) -> str:
    heading = ROLE_HEADINGS.get(m.role, m.role.title())
    if m.role == "tool" and m.tool_call_id:
        heading += f" `{m.tool_call_id}`"
    parts = [f"### {heading}"]
    if m.reasoning:
        parts.append(f"<details><summary>Reasoning</summary>\n\n{m.reasoning}\n\n</details>")
    if m.content:
        parts.append(m.content)
    if m.tool_calls:
        parts.append(fenced(json.dumps(m.tool_calls, indent=2, ensure_ascii=False), "json"))
    note = reply_stats_line(m.to_dict())
    if note:
        parts.append(f"*{note}*")
    return "\n\n".join(parts)


def fenced(text: str, language: str) -> str:
    """A code block whose fence is longer than any run of backticks in `text`."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text}\n{fence}"
