"""The chat: the conversations list (new, switch, rename, delete), the messages with their per-reply stats (a
reasoning model's thinking in a collapsible bubble before its answer; a reply's tool calls, and the results the
client posted for them, each in a collapsible bubble after it), a streamed reply with Stop (the partial reply is
kept), Regenerate and Edit last message, and the generation settings (system prompt, temperature, top-p, max
tokens). A conversation's tools are set, and their results posted, through the sessions API (app/sessions.py).

Gradio is imported inside the functions: build_ui imports this module after the offline environment is set.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvforge.app.errors import APIError
from kvforge.ui.service import UIService

if TYPE_CHECKING:
    import gradio as gr

    from kvforge.app.conversations import Conversation


REASONING_TITLE = "Reasoning"


def tool_call_title(call: dict) -> str:
    return f"Tool call: {call['function']['name']}"


def tool_result_title(name: str | None, call_id: str | None) -> str:
    return f"Tool result: {name}" if name else f"Tool result for {call_id}"


def reply_stats_markdown(message: dict | None) -> str:
    """Per-reply stats under the chat: tokens, tok/s, TTFT, cached tokens."""
    if not message or message.get("role") != "assistant":
        return ""
    parts = [f"{message.get('completion_tokens', '?')} tokens"]
    if message.get("tokens_per_s"):
        parts.append(f"{message['tokens_per_s']:.1f} tok/s")
    if message.get("ttft_s") is not None:
        parts.append(f"TTFT {message['ttft_s'] * 1000:.0f} ms")
    parts.append(f"{message.get('cached_tokens') or 0} cached tokens")
    if message.get("finish_reason") == "abort":
        parts.append("stopped")
    elif message.get("finish_reason") == "tool_calls":
        parts.append("called tools")
    return "Last reply: " + " · ".join(parts)


def message_bubbles(role: str, content: str, reasoning: str | None = None, thinking: bool = False,
                    tool_calls: list[dict] | None = None, tool_name: str | None = None,
                    tool_call_id: str | None = None) -> list[dict]:
    """A message as the chat shows it: a reasoning model's thinking in a collapsible bubble ("Reasoning", Gradio's
    metadata title) before its answer; `thinking` while the reply still streams it; each tool call after it (its
    arguments); a tool result (role "tool", Gradio has no such role) as a collapsible bubble named after its call."""
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


def chat_history(conv: Conversation | None) -> list[dict]:
    if conv is None:
        return []
    bubbles, names = [], {}  # names: each call's function, for the results that answer it
    for m in conv.messages:
        names.update({call["id"]: call["function"]["name"] for call in m.tool_calls or ()})
        bubbles += message_bubbles(m.role, m.content, m.reasoning, tool_calls=m.tool_calls,
                                   tool_name=names.get(m.tool_call_id), tool_call_id=m.tool_call_id)
    return bubbles


def last_stats(conv: Conversation | None) -> str:
    return reply_stats_markdown(conv.messages[-1].to_dict()) if conv is not None and conv.messages else ""


class ChatHandlers:
    """The chat's event handlers. Their names and docstrings are the UI's Gradio API (/send, /show, /on_load...)."""

    def __init__(self, service: UIService) -> None:
        self.service = service

    def show(self, session_id: str | None):
        """Everything that depends on the selected conversation (read once)."""
        # -> (conversations, session, chat, stats, system prompt)
        import gradio as gr

        conv = self.service.conversation(session_id)
        session_id = conv.id if conv is not None else None
        system = ((conv.settings or {}).get("system_prompt") or "") if conv is not None else ""
        return (gr.update(choices=self.service.conversation_choices(), value=session_id), session_id,
                chat_history(conv), last_stats(conv), system)

    def on_load(self):
        choices = self.service.conversation_choices()
        return self.show(choices[0][1] if choices else None)

    def new_conversation(self, system: str):
        return self.show(self.service.create_conversation(system).id)

    def rename(self, session_id: str | None, title: str):
        import gradio as gr

        if session_id and title.strip():
            self.service.rename_conversation(session_id, title.strip()[:200])
        return gr.update(choices=self.service.conversation_choices(), value=session_id), ""

    def delete(self, session_id: str | None):
        if session_id:
            self.service.delete_conversation(session_id)
        return self.on_load()

    async def send(self, message: str, session_id: str | None, system: str, temperature: float, top_p: float,
                   max_tokens: int):
        """Stream the reply into the chat: yields (chat, textbox, stats, conversations, session)."""
        import gradio as gr

        message = (message or "").strip()
        if not message:
            yield gr.update(), gr.update(), gr.update(), gr.update(), session_id
            return
        try:
            self.service.check_open()  # a full server refuses before anything is stored (start_turn checks again)
        except APIError as exc:
            raise gr.Error(exc.message) from None
        if not session_id:
            session_id = self.service.create_conversation(system).id
        else:
            self.service.keep_system_prompt(session_id, system)
        overrides = {"temperature": float(temperature), "top_p": float(top_p), "max_tokens": int(max_tokens)}
        try:
            turn = await self.service.start_turn(session_id, message, overrides)
        except APIError as exc:
            raise gr.Error(exc.message) from None
        before = chat_history(self.service.conversation(session_id))
        reasoning, content, calls = "", "", []
        choices = gr.update(choices=self.service.conversation_choices(), value=session_id)
        yield before + message_bubbles("assistant", ""), "", "", choices, session_id
        async for event in turn.events():
            if event["type"] == "delta":
                reasoning += event.get("reasoning_content", "")
                content += event.get("content", "")
                calls += event.get("tool_calls", [])
                shown = message_bubbles("assistant", content, reasoning, thinking=not (content or calls),
                                        tool_calls=calls)
                yield before + shown, gr.update(), gr.update(), gr.update(), session_id
            elif event["type"] == "done":
                message = event["message"]
                shown = message_bubbles("assistant", message["content"], message.get("reasoning_content"),
                                        tool_calls=message.get("tool_calls"))
                yield before + shown, gr.update(), reply_stats_markdown(message), gr.update(), session_id

    async def stopped_stats(self, session_id: str | None) -> str:
        """After Stop: the cancelled reply is stored as it ends (abort); show its stats once it is."""
        conv = self.service.conversation(session_id)
        for _ in range(40):
            if conv is None:
                return ""
            last = conv.messages[-1] if conv.messages else None
            if last is not None and last.role == "assistant" and last.finish_reason == "abort":
                break
            await asyncio.sleep(0.05)
            conv = self.service.conversation(session_id)
        return last_stats(conv)

    def edit_last(self, session_id: str | None):
        # the last user message back into the textbox, its reply dropped: (chat, textbox, stats)
        text = self.service.drop_last_turn(session_id)
        conv = self.service.conversation(session_id)
        return chat_history(conv), text, last_stats(conv)


def add_chat(blocks: gr.Blocks, service: UIService) -> None:
    """Two columns of the page's row: the conversations, then the chat with its generation settings."""
    import gradio as gr

    on = ChatHandlers(service)
    session = gr.State(None)  # the conversation this tab shows
    with gr.Column(scale=1, min_width=220):
        new_button = gr.Button("New chat", elem_id="new-chat", variant="secondary")
        conversations = gr.Radio(label="Conversations", choices=[], elem_id="conversations")
        title_box = gr.Textbox(label="Rename to", elem_id="rename-title", max_lines=1)
        with gr.Row():
            rename_button = gr.Button("Rename", elem_id="rename", size="sm")
            delete_button = gr.Button("Delete", elem_id="delete", size="sm", variant="stop")
    with gr.Column(scale=3):
        chatbot = gr.Chatbot(elem_id="chat", height=460, label="Chat")
        stats = gr.Markdown(elem_id="reply-stats")
        with gr.Row():
            textbox = gr.Textbox(placeholder="Message (Enter to send)", show_label=False, scale=5,
                                 elem_id="message", max_lines=8)
            send_button = gr.Button("Send", variant="primary", scale=1, elem_id="send")
            stop_button = gr.Button("Stop", scale=1, elem_id="stop")
        with gr.Row():
            regenerate_button = gr.Button("Regenerate", size="sm", elem_id="regenerate")
            edit_button = gr.Button("Edit last message", size="sm", elem_id="edit-last")
        with gr.Accordion("Generation settings", open=False):
            system_box = gr.Textbox(label="System prompt", lines=2, elem_id="system-prompt")
            temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature", elem_id="temperature")
            top_p = gr.Slider(0.05, 1, value=1.0, step=0.05, label="Top-p", elem_id="top-p")
            max_tokens = gr.Slider(1, 4096, value=512, step=1, label="Max tokens", elem_id="max-tokens")

    shown = [conversations, session, chatbot, stats, system_box]
    blocks.load(on.on_load, outputs=shown)
    new_button.click(on.new_conversation, inputs=[system_box], outputs=shown)
    conversations.input(on.show, inputs=[conversations], outputs=shown)
    rename_button.click(on.rename, inputs=[session, title_box], outputs=[conversations, title_box])
    delete_button.click(on.delete, inputs=[session], outputs=shown)

    send_inputs = [textbox, session, system_box, temperature, top_p, max_tokens]
    send_outputs = [chatbot, textbox, stats, conversations, session]
    sending = [send_button.click(on.send, send_inputs, send_outputs, concurrency_limit=None),
               textbox.submit(on.send, send_inputs, send_outputs, concurrency_limit=None)]
    sending.append(regenerate_button.click(on.edit_last, [session], [chatbot, textbox, stats]).then(
        on.send, send_inputs, send_outputs, concurrency_limit=None))
    stop_button.click(None, cancels=sending).then(on.stopped_stats, [session], [stats])
    edit_button.click(on.edit_last, [session], [chatbot, textbox, stats])
