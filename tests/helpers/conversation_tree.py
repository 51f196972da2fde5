"""A conversation with branches, reasoning, tool calls and token figures, built straight in the store (no model):
what the history tests (export, import, search) work on.

    u1 What is the capital of France?
    ├── a1 Paris. (reasoning; 24 tokens, 31.2 tok/s, TTFT 85 ms, 12 cached)
    │   ├── u2 Which river flows through Florence?      (3rd message; not on the branch shown)
    │   │   └── a2 The Arno.
    │   └── u3 And the capital of Spain?                 (an edit of u2)
    │       └── a3 (calls weather)
    │           └── t1 21 C                              (the tool's result)
    │               └── a4 Madrid, 21 C and sunny.       (the last message shown; its prompt left 2 out)
    └── a1b The capital is Paris.                        (a regenerated reply)
"""

from __future__ import annotations

from kvforge.app.sessions.conversations import Conversation, Conversations
from kvforge.app.sessions.protocol import SessionSettings

WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Madrid"}'}}
LEFT_OUT = {"dropped_messages": 2, "dropped_turns": 1}  # what the last reply's prompt left out (context_fit.py)
SETTINGS = SessionSettings.model_validate({"system_prompt": "Answer briefly.", "sampling": {"temperature": 0.3},
                                           "tools": [WEATHER_TOOL], "tool_choice": "auto"}).stored()


def build_tree(conversations: Conversations, title: str = "Capitals of Europe") -> Conversation:
    conv = conversations.create(title, model="SmolLM2-135M-Instruct", settings=SETTINGS)
    add = conversations.add_message
    u1 = add(conv.id, "user", "What is the capital of France?")
    a1 = add(conv.id, "assistant", "Paris.", reasoning="The user asks for France's capital.", prompt_tokens=40,
             completion_tokens=24, cached_tokens=12, finish_reason="stop", ttft_s=0.085, tokens_per_s=31.2)
    add(conv.id, "user", "Which river flows through Florence?")
    add(conv.id, "assistant", "The Arno.", completion_tokens=4, finish_reason="stop")
    add(conv.id, "assistant", "The capital is Paris.", parent_id=u1.id, completion_tokens=6,
        finish_reason="length", tokens_per_s=28.0)
    add(conv.id, "user", "And the capital of Spain?", parent_id=a1.id)
    add(conv.id, "assistant", "", tool_calls=[CALL], completion_tokens=9, finish_reason="tool_calls")
    add(conv.id, "tool", "21 C", tool_call_id="call_1")
    add(conv.id, "assistant", "Madrid, 21 C and sunny.", completion_tokens=1, cached_tokens=0, ttft_s=0.0404,
        tokens_per_s=12.0, finish_reason="stop", context_truncated=LEFT_OUT)
    return conversations.get(conv.id)
