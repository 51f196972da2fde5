"""A chat longer than its context: the policy that keeps it answerable instead of refusing it (README "Long
conversations").

When a conversation's prompt leaves no room for the reply in its window (the model's context, or the smaller one the
request asks for: num_ctx), its oldest whole turns are left out. A turn is a user message and all that follows it up
to the next one (the reply, its tool calls and their results), so no tool result loses its call and no turn is cut in
half. The leading system (and developer) messages stay, and so does the newest turn: where they alone cannot fit,
the request is refused as before (400 context_length_exceeded). Raw prompts are never cut.

The prefix cache: dropping just enough turns would move the prompt's start on every turn, and every turn would
compute its whole history again. So the first turn kept is found by replaying the conversation's growth, turn by turn
(stateless: the same history always gives the same start): each time it outgrows the window, the oldest turns go
until the history left takes at most KEEP_SHARE of the window. The turns after keep that start, and its KV in the
prefix cache, until the window fills again: llama.cpp's context shift (half discarded), without server state.

The replay runs on estimated token counts (each message's text tokenized alone, plus the template's tokens around a
message, measured by two probe renders of the system prompt; ESTIMATE_MARGIN over), not on a render per turn; the
prompt kept is rendered once to check it, and where the estimate fell short a bisection over the turns to drop finds
the fewest more that fit. Renders: the whole conversation (skipped when its characters alone cannot fit), two probes,
the prompt kept, and rarely log2(turns) more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvforge.app.dialects.openai.messages import ChatMessage
from kvforge.app.generate.chat_request import ChatPlan
from kvforge.app.http.errors import APIError

KEEP_SHARE = 0.5  # after a cut, the history kept takes at most this share of the window (the rest: room to grow)
REPLY_SHARE = 0.25  # the room kept for a reply that names no max_tokens (or one the route cuts to fit anyway)
HEADER = "X-KVForge-Dropped-Messages"  # on every truncated chat's response: the number of messages left out
FIELD = "context_truncated"  # the response body's extension field: {"dropped_messages", "dropped_turns"}
HEAD_ROLES = ("system", "developer")  # the leading messages that always stay
FALLBACK_MESSAGE_TOKENS = 8  # the template's tokens around a message, where the probes cannot tell
# a turn's estimate is raised by this much: a template may wrap some messages more than the probes' (tool calls and
# results), and an estimate that falls short costs renders and a start that moves with every turn
ESTIMATE_MARGIN = 1.1


class Message(Protocol):
    role: str


@dataclass(frozen=True)
class ContextBudget:
    """What a chat's prompt must fit: its window and the room kept there for the reply."""

    window: int  # tokens the prompt and its reply share
    reserve: int  # of them, kept for the reply

    @classmethod
    def of(cls, window: int, requested: int | None, default: int | None, cut_to_fit: bool) -> ContextBudget:
        """`requested`: the request's max_tokens, kept whole unless the route cuts it to what the context leaves
        (`cut_to_fit`: Anthropic's upper bound, Ollama's num_predict, any request naming a window), then at most
        REPLY_SHARE of the window; none: the model's or server's default (`default`) up to that share."""
        share = int(window * REPLY_SHARE)
        if requested is not None:
            return cls(window, min(requested, share) if cut_to_fit else requested)
        return cls(window, min(default, share) if default else share)

    @property
    def limit(self) -> int:
        """The most tokens the prompt may take."""
        return max(self.window - self.reserve, 0)

    @property
    def keep(self) -> int:
        """After a cut, the most tokens the prompt's history (before its newest turn) may take."""
        return min(int(self.window * KEEP_SHARE), self.limit)


@dataclass(frozen=True)
class Truncation:
    """What a cut left out, counted in the conversation as OpenAI's messages (what every dialect translates into)."""

    dropped_messages: int
    dropped_turns: int

    def fields(self) -> dict[str, int]:
        return {"dropped_messages": self.dropped_messages, "dropped_turns": self.dropped_turns}


def truncation_headers(truncation: Truncation | None) -> dict[str, str]:
    """The response header that says a chat was cut (none when it was not)."""
    return {HEADER: str(truncation.dropped_messages)} if truncation is not None else {}


def truncation_field(truncation: Truncation | None) -> dict[str, Any]:
    """The body's extension field that says a chat was cut (none when it was not)."""
    return {FIELD: truncation.fields()} if truncation is not None else {}


def split_turns(messages: Sequence[Message]) -> tuple[list, list[list]]:
    """The leading system / developer messages, and the turns after them, each from a user message up to the next
    (messages before the first user message are a turn of their own)."""
    at = 0
    while at < len(messages) and messages[at].role in HEAD_ROLES:
        at += 1
    turns: list[list] = []
    for message in messages[at:]:
        if message.role == "user" or not turns:
            turns.append([message])
        else:
            turns[-1].append(message)
    return list(messages[:at]), turns


def droppable(messages: Sequence[Message]) -> bool:
    """Whether the conversation has a turn before its newest: something this policy could leave out."""
    return len(split_turns(messages)[1]) > 1


def first_kept_turn(fixed: int, sizes: list[int], limit: int, keep: int) -> int:
    """The index of the first turn kept: the conversation replayed turn by turn (`sizes`: each turn's tokens;
    `fixed`: what every prompt has besides its turns: the system prompt, the tools, the template's frame). Where a
    prompt outgrows `limit` (the last one always does: it was rendered), the oldest turns go until the history
    before that turn takes at most `keep` tokens and the prompt `limit`; the turn itself always stays."""
    start, total = 0, fixed  # total: fixed + sizes[start:j + 1]
    for j, size in enumerate(sizes):
        total += size
        if total <= limit and not (j == len(sizes) - 1 and start == 0):
            continue
        history = total - size
        while start < j and (history > keep or history + size > limit):
            history -= sizes[start]
            start += 1
        total = history + size
    return start


def message_text(message: ChatMessage) -> str:
    """What a message puts in the prompt besides the template's markers: its text, its thinking, its calls."""
    calls = "".join(call.function.name + call.function.arguments for call in message.tool_calls or ())
    thinking = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    return message.text() + (thinking or "") + calls + (message.name or "")


@dataclass(frozen=True)
class Fitted:
    """A conversation as it is sent: its messages, their rendering (None: too long by its characters to render),
    and what was left out (None: nothing)."""

    messages: list[ChatMessage]
    plan: ChatPlan | None
    truncation: Truncation | None = None


def fit_conversation(messages: list[ChatMessage], budget: ContextBudget,
                     plan: Callable[[list[ChatMessage]], ChatPlan | None],
                     count: Callable[[list[str]], list[int]]) -> Fitted:
    """The conversation, rendered by `plan` (None for messages too long by their characters to render), cut to the
    budget by this module's policy when it does not fit; `count`: the tokens of each text. When even the system
    prompt and the newest turn do not fit, they are returned all the same: the way in refuses them as before."""
    whole = plan(messages)
    if whole is not None and len(whole.prompt) <= budget.limit:
        return Fitted(messages, whole)
    head, turns = split_turns(messages)
    if len(turns) < 2:
        return Fitted(messages, whole)
    fixed, per_message = template_costs(head, plan, count)
    counts = iter(count([message_text(m) for turn in turns for m in turn]))
    sizes = [math.ceil(ESTIMATE_MARGIN * sum(next(counts) + per_message for _ in turn)) for turn in turns]
    plans: dict[int, ChatPlan | None] = {}

    def kept(start: int) -> list[ChatMessage]:
        return head + [m for turn in turns[start:] for m in turn]

    def fits(start: int) -> bool:
        if start not in plans:
            plans[start] = plan(kept(start))
        return plans[start] is not None and len(plans[start].prompt) <= budget.limit

    start = first_kept_turn(fixed, sizes, budget.limit, budget.keep)
    if not fits(start):  # the estimate fell short: the fewest more turns to drop, by bisection
        low, high = start + 1, len(turns) - 1
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if fits(middle) else (middle + 1, high)
        start = high
        fits(start)
    dropped = sum(len(turn) for turn in turns[:start])
    return Fitted(kept(start), plans[start], Truncation(dropped, start) if start else None)


def template_costs(head: list[ChatMessage], plan: Callable[[list[ChatMessage]], ChatPlan | None],
                   count: Callable[[list[str]], list[int]]) -> tuple[int, int]:
    """(the tokens of a prompt with no turns: the head, the tools, the template's frame; the template's tokens around
    one message), from two probe renders of the head with one and with three short messages. The same head gives
    the same costs on every turn, so the replay's decisions hold from turn to turn."""
    probe = [ChatMessage(role="user", content="x"), ChatMessage(role="assistant", content="x"),
             ChatMessage(role="user", content="x")]
    x = count(["x"])[0]
    try:
        one, three = plan(head + probe[:1]), plan(head + probe)
    except APIError:  # a template that refuses the probe: estimates without it
        one = three = None
    if one is None or three is None:
        per_message = FALLBACK_MESSAGE_TOKENS
        return sum(n + per_message for n in count([message_text(m) for m in head])), per_message
    per_message = max(0, math.ceil((len(three.prompt) - len(one.prompt) - 2 * x) / 2))
    return max(0, len(one.prompt) - x - per_message), per_message
