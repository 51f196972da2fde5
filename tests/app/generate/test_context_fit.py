"""The long-conversation policy (app/generate/context_fit.py) on its own, with a template of known sizes instead of a
model: whole turns dropped (a tool result never without its call), the system prompts and the newest turn kept, the
history cut to half the window so that the start stays put for the turns after (the prefix cache), few renders, a
bisection where the estimate falls short, and what the way in refuses when even the newest turn cannot fit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvforge.app.dialects.openai.messages import ChatMessage
from kvforge.app.generate.context_fit import (
    ESTIMATE_MARGIN,
    KEEP_SHARE,
    REPLY_SHARE,
    ContextBudget,
    droppable,
    first_kept_turn,
    fit_conversation,
    split_turns,
)

FRAME = 3  # the template's tokens around the whole prompt (a BOS, the generation prompt)
WRAP = 4  # the template's tokens around each message


@dataclass
class Plan:
    prompt: list[int]


class Template:
    """A chat template whose sizes are known: a message is its words plus WRAP tokens (`extra` more for a tool
    result, a wrapping the probes do not see); renders are counted, the conversations rendered kept."""

    def __init__(self, extra_for_tools: int = 0, max_words: int | None = None) -> None:
        self.extra, self.max_words = extra_for_tools, max_words
        self.rendered: list[list[ChatMessage]] = []

    def size(self, message: ChatMessage) -> int:
        return words(message) + WRAP + (self.extra if message.role == "tool" else 0)

    def plan(self, messages: list[ChatMessage]) -> Plan | None:
        if self.max_words is not None and sum(words(m) for m in messages) > self.max_words:
            return None  # too long by its characters: not rendered
        self.rendered.append(messages)
        return Plan([0] * (FRAME + sum(self.size(m) for m in messages)))


def words(message: ChatMessage) -> int:
    calls = " ".join(f"{c.function.name} {c.function.arguments}" for c in message.tool_calls or ())
    return len(f"{message.text()} {calls}".split())


def count(texts: list[str]) -> list[int]:
    return [len(text.split()) for text in texts]


def user(n: int, words_: int = 20) -> ChatMessage:
    return ChatMessage(role="user", content=f"question {n} " + "word " * (words_ - 2))


def assistant(n: int, words_: int = 20) -> ChatMessage:
    return ChatMessage(role="assistant", content=f"answer {n} " + "word " * (words_ - 2))


def call(n: int) -> list[ChatMessage]:
    """An assistant's tool call and its result."""
    return [ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": f"call_{n}", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]),
            ChatMessage(role="tool", tool_call_id=f"call_{n}", content="result " + "word " * 10)]


SYSTEM = [ChatMessage(role="system", content="You are terse."), ChatMessage(role="developer", content="Be exact.")]


def chat(turns: int, tools_every: int = 0) -> list[ChatMessage]:
    """The system prompts, then `turns` turns (a user question, every `tools_every`-th with a tool call and its
    result, then an answer); the last turn's question unanswered."""
    messages = list(SYSTEM)
    for n in range(turns):
        messages.append(user(n))
        if tools_every and n % tools_every == 0:
            messages += call(n)
        if n < turns - 1:
            messages.append(assistant(n))
    return messages


def fit(messages: list[ChatMessage], budget: ContextBudget, template: Template | None = None):
    template = template or Template()
    return fit_conversation(messages, budget, template.plan, count), template


def test_a_conversation_that_fits_is_rendered_once_and_not_cut():
    fitted, template = fit(chat(3), ContextBudget(1000, 100))
    assert fitted.truncation is None and fitted.messages == chat(3) and len(template.rendered) == 1


def test_the_oldest_whole_turns_go_the_system_prompts_and_the_newest_turn_stay():
    messages = chat(30, tools_every=3)
    budget = ContextBudget(600, 50)
    fitted, template = fit(messages, budget)
    kept, cut = fitted.messages, fitted.truncation
    assert cut is not None and cut.dropped_turns > 0
    assert kept[:2] == SYSTEM and kept[2].role == "user"  # the system prompts, then a whole turn
    assert kept[-1] == messages[-1] and kept == SYSTEM + messages[len(SYSTEM) + cut.dropped_messages:]
    _, turns = split_turns(messages)
    assert cut.dropped_messages == sum(len(turn) for turn in turns[:cut.dropped_turns])
    calls = {c.id for m in kept for c in m.tool_calls or ()}
    assert all(m.tool_call_id in calls for m in kept if m.role == "tool")  # no result without its call
    assert len(fitted.plan.prompt) <= budget.limit
    assert len(template.rendered) <= 4  # the whole, two probes, the prompt kept


def test_the_start_stays_put_until_the_window_fills_again():
    """A conversation growing turn by turn, as a client resends it: the first message kept changes only when the
    prompt would no longer fit (as estimated), and then the history left is about half the window (KEEP_SHARE), so
    about half a window's turns in a row share their start (and its cached KV)."""
    budget = ContextBudget(800, 60)
    starts, shifts = [], 0
    turn_tokens = 2 * (20 + WRAP)
    for turns in range(1, 80):
        messages = chat(turns)
        fitted, _ = fit(messages, budget)
        dropped = fitted.truncation.dropped_messages if fitted.truncation else 0
        starts.append(dropped)
        assert len(fitted.plan.prompt) <= budget.limit
        if len(starts) > 1 and starts[-1] != starts[-2]:
            shifts += 1
            # a shift happens only where the old start would have overflowed, as estimated (ESTIMATE_MARGIN over)
            old = SYSTEM + messages[len(SYSTEM) + starts[-2]:]
            assert FRAME + sum(Template().size(m) for m in old) > budget.limit / ESTIMATE_MARGIN
            # and leaves a history of about half the window: cut to it where the estimate (ESTIMATE_MARGIN over)
            # first overflowed, then grown by the turns since, no more than the margin's share of the window
            history = len(fitted.plan.prompt) - (WRAP + 20)
            slack = budget.limit * (1 - 1 / ESTIMATE_MARGIN) + turn_tokens
            assert budget.keep - 2 * turn_tokens < history <= budget.keep + slack
    turns_per_shift = (budget.limit - budget.window * KEEP_SHARE) / turn_tokens
    assert shifts <= 79 / (turns_per_shift - 1) + 1, starts
    assert shifts >= 3  # it did grow past the window several times


def test_the_replay_is_the_same_whatever_came_after():
    """The start a conversation gets is the one it gets again once more turns came: it depends on the history, not
    on how long the newest turn is (within the window)."""
    budget = ContextBudget(800, 60)
    fitted, _ = fit(chat(40), budget)
    longer = chat(40)[:-1] + [user(39, words_=60)]
    again, _ = fit(longer, budget)
    assert again.truncation == fitted.truncation


def test_an_estimate_that_falls_short_is_corrected_by_a_bounded_bisection():
    template = Template(extra_for_tools=60)  # tool results far longer than the probes measure
    budget = ContextBudget(900, 50)
    messages = chat(60, tools_every=1)
    fitted, _ = fit(messages, budget, template)
    assert fitted.truncation is not None and len(fitted.plan.prompt) <= budget.limit
    assert len(template.rendered) <= 4 + 6  # log2(60 turns) renders more at most
    one_more_kept = SYSTEM + messages[len(SYSTEM) + fitted.truncation.dropped_messages - 4:]
    assert len(template.plan(one_more_kept).prompt) > budget.limit  # the fewest turns dropped


def test_when_even_the_newest_turn_cannot_fit_it_is_returned_for_the_way_in_to_refuse():
    messages = chat(5)[:-1] + [user(4, words_=400)]
    fitted, _ = fit(messages, ContextBudget(300, 20))
    assert fitted.messages == SYSTEM + messages[-1:]
    assert len(fitted.plan.prompt) > 280 and fitted.truncation.dropped_turns == 4


def test_a_conversation_too_long_to_render_is_cut_without_rendering_it_whole():
    template = Template(max_words=2000)
    messages = chat(200)
    fitted, _ = fit(messages, ContextBudget(600, 50), template)
    assert fitted.truncation is not None and len(fitted.plan.prompt) <= 550
    assert all(len(rendered) < len(messages) for rendered in template.rendered)
    only_newest, _ = fit(messages[:2] + [user(1, words_=3000)], ContextBudget(600, 50), Template(max_words=2000))
    assert only_newest.plan is None  # the caller refuses it by its characters


def test_one_turn_has_nothing_to_drop():
    messages = SYSTEM + [user(0, words_=500)]
    assert not droppable(messages) and droppable(chat(2))
    fitted, _ = fit(messages, ContextBudget(300, 20))
    assert fitted.messages == messages and fitted.truncation is None


def test_turns_start_at_user_messages():
    messages = SYSTEM + [assistant(0), user(1), *call(1), assistant(1), user(2)]
    head, turns = split_turns(messages)
    assert head == SYSTEM and [len(t) for t in turns] == [1, 4, 1]
    assert turns[1][0].role == "user" and turns[1][2].role == "tool"


@pytest.mark.parametrize("requested, default, cut_to_fit, reserve", [
    (100, None, False, 100),  # the request's max_tokens, kept whole where the engine holds the request to it
    (5000, None, False, 5000),  # more than the window: nothing fits, the way in refuses as before
    (5000, None, True, 1024),  # Anthropic's upper bound, Ollama's -1: a share of the window
    (None, None, False, 1024),  # none: a share of the window
    (None, 256, False, 256),  # the model's or the server's default, up to that share
])
def test_the_room_kept_for_the_reply(requested, default, cut_to_fit, reserve):
    budget = ContextBudget.of(4096, requested, default, cut_to_fit)
    assert budget.reserve == reserve and REPLY_SHARE * 4096 == 1024
    assert budget.limit == max(4096 - reserve, 0) and budget.keep == min(2048, budget.limit)


def test_first_kept_turn_replays_the_growth():
    # window limit 100, keep 50: the fourth turn overflows (4 x 30 > 100): the history is cut to <= 50 (one turn)
    assert first_kept_turn(0, [30, 30, 30], 100, 50) == 1  # the last prompt is known not to fit: cut
    assert first_kept_turn(0, [30, 30, 30, 30], 100, 50) == 2
    assert first_kept_turn(0, [30, 30, 30, 30, 30], 100, 50) == 2  # the start stays until the window fills
    assert first_kept_turn(0, [30, 30, 30, 30, 30, 30], 100, 50) == 4
    assert first_kept_turn(10, [30, 30, 90], 100, 50) == 2  # a newest turn that needs all the room
