"""The browser UI: a Gradio chat mounted in the `kvforge serve` process (UI at /, API at /v1).

Conversations come from the session store (the same ChatService as /v1/sessions, so a reload or a
restart shows the same history); replies stream; Stop aborts the request (the partial reply is
kept); Regenerate and Edit rework the last turn. The dashboard reads the one server-side sampler
every second. Nothing is fetched from outside 127.0.0.1: a built-in theme with system fonts, no
analytics (GRADIO_ANALYTICS_ENABLED is off before gradio is imported).
"""

from __future__ import annotations

import os

for _name, _value in (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_OFFLINE", "1"),
                      ("HF_HUB_DISABLE_TELEMETRY", "1")):
    os.environ.setdefault(_name, _value)

import gradio as gr  # noqa: E402 - after the offline switches above
import pandas as pd  # noqa: E402

from kvforge.app.chat_service import DEFAULT_TITLE, ChatService  # noqa: E402
from kvforge.app.errors import APIError  # noqa: E402
from kvforge.core.store import NotFound  # noqa: E402
from kvforge.ui.dashboard import DashboardSampler  # noqa: E402

CSS = """
#reply-stats { font-size: 0.85em; opacity: 0.8; }
#dashboard table { font-size: 0.85em; }
"""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


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
    return "Last reply: " + " · ".join(parts)


def dashboard_markdown(sampler: DashboardSampler) -> str:
    s = sampler.latest()
    st = s.stats
    if not st:
        return "**No model loaded**"
    lines = [f"**Model** {s.model} · {s.config.get('dtype')} · quant **{s.config.get('quant')}** · "
             f"decoding **{s.config.get('decoding')}**", "", "| | |", "|---|---|"]
    if s.gpus:
        for g in s.gpus:
            lines.append(f"| VRAM {g['device']} | {human_bytes(g['used'])} / {human_bytes(g['total'])} |")
    else:
        lines.append(f"| Process RSS | {human_bytes(s.rss_bytes)} |")
    lines += [
        f"| KV pool | {human_bytes(st['kv_cache_bytes'])} |",
        f"| KV blocks used / cached / free | {st['kv_blocks_used']} / {st['kv_blocks_cached']} / "
        f"{st['kv_blocks_free']} |",
        f"| Requests running / waiting | {st['running']} / {st['waiting']} |",
        f"| Generation tok/s | {st['generation_tokens_per_s']:.1f} |",
        f"| Prefix cache hit rate | {st['prefix_cache_hit_rate'] * 100:.0f}% |",
    ]
    if s.config.get("persist_kv"):
        lines.append(f"| KV on disk | {st['kv_disk_blocks']} blocks, {human_bytes(st['kv_disk_bytes'])} |")
    ttfts = sampler.recent_ttfts()[-5:]
    if ttfts:
        lines.append(f"| Recent TTFT | {', '.join(f'{t * 1000:.0f} ms' for t in reversed(ttfts))} |")
    return "\n".join(lines)


def throughput_frame(sampler: DashboardSampler) -> pd.DataFrame:
    samples = sampler.history()
    if not samples:
        return pd.DataFrame({"seconds ago": [], "tok/s": []})
    now = samples[-1].time
    return pd.DataFrame({"seconds ago": [round(s.time - now, 1) for s in samples],
                         "tok/s": [s.stats.get("generation_tokens_per_s", 0.0) for s in samples]})


def build_ui(chat: ChatService, sampler: DashboardSampler) -> gr.Blocks:
    store = chat.store

    def conversation_choices() -> list[tuple[str, str]]:
        return [(c.title, c.id) for c in store.list_conversations()]

    def chat_history(session_id: str | None) -> list[dict]:
        if not session_id:
            return []
        try:
            conv = store.get_conversation(session_id)
        except NotFound:
            return []
        return [{"role": m.role, "content": m.content} for m in conv.messages]

    def last_stats(session_id: str | None) -> str:
        if not session_id:
            return ""
        try:
            messages = store.get_conversation(session_id).messages
        except NotFound:
            return ""
        return reply_stats_markdown(messages[-1].to_dict()) if messages else ""

    def show(session_id: str | None):
        """Everything that depends on the selected conversation."""
        system = ""
        if session_id:
            try:
                system = (store.get_conversation(session_id).settings or {}).get("system_prompt") or ""
            except NotFound:
                session_id = None
        return (gr.update(choices=conversation_choices(), value=session_id), session_id,
                chat_history(session_id), last_stats(session_id), system)

    def on_load():
        choices = conversation_choices()
        return show(choices[0][1] if choices else None)

    def new_conversation(system: str):
        conv = store.create_conversation(DEFAULT_TITLE, chat.host.name, {"system_prompt": system or None})
        return show(conv.id)

    def rename(session_id: str | None, title: str):
        if session_id and title.strip():
            store.update_conversation(session_id, title=title.strip()[:200])
        return gr.update(choices=conversation_choices(), value=session_id), ""

    def delete(session_id: str | None):
        if session_id:
            try:
                store.delete_conversation(session_id)
            except NotFound:
                pass
        choices = conversation_choices()
        return show(choices[0][1] if choices else None)

    async def send(message: str, session_id: str | None, system: str, temperature: float, top_p: float,
                   max_tokens: int):
        """Stream the reply into the chat: yields (chat, textbox, stats, conversations, session)."""
        message = (message or "").strip()
        if not message:
            yield gr.update(), gr.update(), gr.update(), gr.update(), session_id
            return
        if not session_id:
            session_id = store.create_conversation(DEFAULT_TITLE, chat.host.name,
                                                   {"system_prompt": system or None}).id
        else:
            conv = store.get_conversation(session_id)
            if ((conv.settings or {}).get("system_prompt") or "") != (system or ""):
                store.update_conversation(session_id, settings={**(conv.settings or {}),
                                                                "system_prompt": system or None})
        overrides = {"temperature": float(temperature), "top_p": float(top_p), "max_tokens": int(max_tokens)}
        try:
            turn = await chat.start_turn(session_id, message, overrides)
        except APIError as exc:
            raise gr.Error(exc.message) from None
        history = chat_history(session_id) + [{"role": "assistant", "content": ""}]
        choices = gr.update(choices=conversation_choices(), value=session_id)
        yield history, "", "", choices, session_id
        async for event in turn.events():
            if event["type"] == "delta":
                history[-1]["content"] += event["content"]
                yield history, gr.update(), gr.update(), gr.update(), session_id
            elif event["type"] == "done":
                history[-1]["content"] = event["message"]["content"]
                yield history, gr.update(), reply_stats_markdown(event["message"]), gr.update(), session_id

    def drop_last_turn(session_id: str | None) -> str:
        """Remove the last user message and what follows it; returns that message."""
        if not session_id:
            return ""
        messages = store.get_conversation(session_id).messages
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        if not users:
            return ""
        store.truncate_messages(session_id, users[-1])
        return messages[users[-1]].content

    def edit_last(session_id: str | None):
        text = drop_last_turn(session_id)
        return chat_history(session_id), text, last_stats(session_id)

    with gr.Blocks(title="kvforge") as demo:
        session = gr.State(None)
        with gr.Row():
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
            with gr.Column(scale=2, min_width=280):
                dashboard = gr.Markdown(elem_id="dashboard")
                plot = gr.LinePlot(x="seconds ago", y="tok/s", title="Generation tok/s", height=220,
                                   elem_id="tokens-plot")
                timer = gr.Timer(1.0)

        shown = [conversations, session, chatbot, stats, system_box]
        demo.load(on_load, outputs=shown)
        new_button.click(new_conversation, inputs=[system_box], outputs=shown)
        conversations.input(show, inputs=[conversations], outputs=shown)
        rename_button.click(rename, inputs=[session, title_box], outputs=[conversations, title_box])
        delete_button.click(delete, inputs=[session], outputs=shown)

        send_inputs = [textbox, session, system_box, temperature, top_p, max_tokens]
        send_outputs = [chatbot, textbox, stats, conversations, session]
        sending = [send_button.click(send, send_inputs, send_outputs, concurrency_limit=None),
                   textbox.submit(send, send_inputs, send_outputs, concurrency_limit=None)]
        stop_button.click(None, cancels=sending)
        regenerating = regenerate_button.click(edit_last, [session], [chatbot, textbox, stats]).then(
            send, send_inputs, send_outputs, concurrency_limit=None)
        stop_button.click(None, cancels=[regenerating])
        edit_button.click(edit_last, [session], [chatbot, textbox, stats])

        timer.tick(lambda: (dashboard_markdown(sampler), throughput_frame(sampler)), outputs=[dashboard, plot],
                   queue=False, show_progress="hidden")
    demo.queue(default_concurrency_limit=None)
    return demo


def mount_ui(app, chat: ChatService, sampler: DashboardSampler):
    """Serve the UI at / of the FastAPI app (its /v1 routes are defined first, so they keep working)."""
    return gr.mount_gradio_app(app, build_ui(chat, sampler), path="/", theme=gr.themes.Default(), css=CSS,
                               footer_links=[])
