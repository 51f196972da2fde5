"""A conversation as the chat shows it: its messages as bubbles (a reasoning model's thinking collapsible before its
answer; a reply's tool calls, and the results posted for them, each collapsible after it), a reply's stats line (and
the notice that older messages were left out of its prompt), the branch points (a message with other versions) and
their labels."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvforge.app.sessions.reply_stats import reply_stats_line

if TYPE_CHECKING:
    from kvforge.app.generate.context_fit import Truncation
    from kvforge.app.sessions.conversations import Conversation

REASONING_TITLE = "Reasoning"


def tool_call_title(call: dict) -> str:
    return f"Tool call: {call['function']['name']}"


def tool_result_title(name: str | None, call_id: str | None) -> str:
    return f"Tool result: {name}" if name else f"Tool result for {call_id}"


def reply_stats_markdown(message: dict | None, truncation: Truncation | None = None) -> str:
    """Per-reply stats under the chat, and the notice of a reply whose prompt left older messages out: `truncation`
    while it streams, else what the stored reply kept (so a reloaded conversation says it again)."""
    line = reply_stats_line(message, left_out=False)
    shown = [f"Last reply: {line}"] if line else []
    stored = (message or {}).get("context_truncated") or {}
    count = truncation.dropped_messages if truncation is not None else stored.get("dropped_messages")
    if count:
        shown.append(truncation_notice(count))
    return "\n\n".join(shown)


def truncation_notice(count: int) -> str:
    """What a reply to a conversation longer than the model's context says (app/generate/context_fit.py): `count`
    messages were left out of its prompt."""
    return (f"⚠ Older messages were left out of the model's context: the {count} oldest "
            f"message{'' if count == 1 else 's'} did not fit, so the model saw the system prompt and the newest "
            "turns only. They stay in the conversation.")


def message_bubbles(role: str, content: str, reasoning: str | None = None, thinking: bool = False,
                    tool_calls: list[dict] | None = None, tool_name: str | None = None,
                    tool_call_id: str | None = None, pictures: list[str] | None = None) -> list[dict]:
    """A message as the chat shows it: a reasoning model's thinking in a collapsible bubble ("Reasoning", Gradio's
    metadata title) before its answer; `thinking` while the reply still streams it; each tool call after it (its
    arguments); a tool result (role "tool", Gradio has no such role) as a collapsible bubble named after its call;
    a user message's pictures (their files) as a bubble each before its text."""
    if pictures:
        shown = [{"role": "user", "content": {"path": path}} for path in pictures]
        return shown + (message_bubbles(role, content) if content else [])
    if role == "tool":
        return [{"role": "assistant", "content": content,
                 "metadata": {"title": tool_result_title(tool_name, tool_call_id), "status": "done"}}]
    bubbles = []
    if reasoning:
        status = "pending" if thinking else "done"
        bubbles.append({"role": "assistant", "content": reasoning,
                        "metadata": {"title": REASONING_TITLE, "status": status}})
    if content or not (reasoning or tool_calls):
        bubbles.append({"role": role, "content": content})
    for call in tool_calls or ():
        bubbles.append({"role": "assistant", "content": f"```json\n{call['function']['arguments']}\n```",
                        "metadata": {"title": tool_call_title(call), "status": "done"}})
    return bubbles


@dataclass
class ChatView:
    """A conversation's branch as the chat shows it: the bubbles, and for each bubble the message it shows (its id)
    and its tooltip (a reply's stats, on its answer's bubble); the branch points along it ("< 2/3 >")."""
    bubbles: list[dict] = field(default_factory=list)
    message_ids: list[int] = field(default_factory=list)
    titles: list[str] = field(default_factory=list)
    branches: list[dict] = field(default_factory=list)


def chat_view(conv: Conversation | None, picture_path: Callable[[str], str] | None = None) -> ChatView:
    """`picture_path`: a file of a kept picture, by its SHA-256 (UIService.picture_path); None: pictures not shown."""
    view = ChatView()
    if conv is None:
        return view
    names = {}  # each call's function, for the results that answer it
    for number, m in enumerate(conv.messages, 1):
        names.update({call["id"]: call["function"]["name"] for call in m.tool_calls or ()})
        pictures = [picture_path(digest) for digest in m.images or ()] if picture_path is not None else None
        shown = message_bubbles(m.role, m.content, m.reasoning, tool_calls=m.tool_calls,
                                tool_name=names.get(m.tool_call_id), tool_call_id=m.tool_call_id, pictures=pictures)
        stats = reply_stats_line(m.to_dict())
        view.bubbles += shown
        view.message_ids += [m.id] * len(shown)
        view.titles += [stats if b["role"] == "assistant" and "metadata" not in b else "" for b in shown]
        siblings = list(m.siblings or [m.id])
        if len(siblings) > 1:
            at = siblings.index(m.id)
            view.branches.append({"number": number, "role": m.role, "index": at + 1, "count": len(siblings),
                                  "previous": siblings[at - 1] if at > 0 else None,
                                  "next": siblings[at + 1] if at + 1 < len(siblings) else None})
    return view


def titles_html(titles: list[str]) -> str:
    """The bubbles' tooltips for the page's script (TOOLTIP_SCRIPT), which sets them as the bubbles' titles."""
    return f'<div data-titles="{html.escape(json.dumps(titles))}"></div>'


# Set in the page's head: keeps each chat bubble's title (its tooltip) equal to the list #message-titles holds.
TOOLTIP_SCRIPT = """<script>
(() => {
  const apply = () => {
    const holder = document.querySelector('#message-titles [data-titles]');
    if (!holder) return;
    let titles;
    try { titles = JSON.parse(holder.dataset.titles); } catch (e) { return; }
    document.querySelectorAll('#chat [data-testid=user], #chat [data-testid=bot]').forEach((el, i) => {
      const title = titles[i] || '';
      if (title && el.title !== title) el.title = title;
      else if (!title && el.hasAttribute('title')) el.removeAttribute('title');
    });
  };
  let queued = false;
  new MutationObserver(() => {
    if (!queued) { queued = true; requestAnimationFrame(() => { queued = false; apply(); }); }
  }).observe(document.documentElement, {subtree: true, childList: true, characterData: true, attributes: true,
                                        attributeFilter: ['data-titles']});
})();
</script>"""


def last_stats(conv: Conversation | None) -> str:
    return reply_stats_markdown(conv.messages[-1].to_dict()) if conv is not None and conv.messages else ""


def branch_label(point: dict) -> str:
    who = "reply" if point["role"] == "assistant" else f"{point['role']} message"
    return f"Message {point['number']} ({who}): {point['index']}/{point['count']}"
