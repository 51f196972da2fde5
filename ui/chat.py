"""The chat: the conversations list (new, switch, rename, delete), the messages with their per-reply stats (shown as
ui/chat_view.py renders them), a streamed reply with Stop (the partial reply is kept), Regenerate and Edit last message,
pictures attached in the chat box for a vision model (thumbnails in the history, kept with the conversation), and the
generation settings (system prompt, temperature, top-p, max tokens, the repetition guard): each conversation
shows its own, which start at the served model's defaults (core/generation_defaults.py; "Model defaults" goes back to
them) and are kept with it when a message is sent. A conversation's tools are set, and their results posted, through the
sessions API (app/sessions/routes.py).

Gradio is imported inside the functions: build_ui imports this module after the offline environment is set.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvforge.app.http.errors import APIError
from kvforge.ui.chat_view import branch_label, chat_view, last_stats, message_bubbles, reply_stats_markdown, titles_html
from kvforge.ui.service import UIService

if TYPE_CHECKING:
    import gradio as gr

    from kvforge.app.sessions.conversations import Conversation


class ChatHandlers:
    """The chat's event handlers. Their names and docstrings are the UI's Gradio API (/send, /show, /on_load...)."""

    def __init__(self, service: UIService) -> None:
        self.service = service

    def show(self, session_id: str | None, search: str = ""):
        """Everything that depends on the selected conversation (read once): (conversations listing, session, chat,
        stats, system prompt, temperature, top-p, max tokens, repetition guard, model defaults, branches, bubble
        message ids, tooltips)."""
        conv = self.service.conversation(session_id)
        session_id = conv.id if conv is not None else None
        system = ((conv.settings or {}).get("system_prompt") or "") if conv is not None else ""
        view = chat_view(conv, self.service.picture_path)
        return (self.listing(session_id, search), session_id, view.bubbles, last_stats(conv), system,
                *self.sampling_shown(conv), view.branches, view.message_ids, titles_html(view.titles))

    def listing(self, session_id: str | None, search: str = "") -> dict:
        """What the conversations list shows: the groups by date (matching `search`), the one selected."""
        search = (search or "").strip()
        return {"groups": self.service.conversation_groups(search), "selected": session_id, "search": search}

    def sampling_shown(self, conv: Conversation | None) -> tuple:
        """The generation settings' controls for a conversation: (temperature, top-p, max tokens, repetition guard,
        the model's defaults)."""
        view = self.service.sampling_view(conv)
        return (view["temperature"], view["top_p"], view["max_tokens"], view["repetition_guard"],
                self.service.model_defaults_note())

    def model_defaults(self):
        """The Model defaults button: the controls back at the model's defaults (kept with the next message)."""
        return self.sampling_shown(None)[:4]

    def on_load(self):
        groups = self.service.conversation_groups("")
        first = next((items[0][1] for _, items in groups if items), None)
        return self.show(first)

    def on_page_load(self):
        """The page's first view (on_load's), then New chat enabled."""
        import gradio as gr

        return (*self.on_load(), gr.update(interactive=True))

    def new_conversation(self, system: str):
        return self.show(self.service.create_conversation(system).id)

    def search(self, session_id: str | None, search: str) -> dict:
        return self.listing(session_id, search)

    def rename(self, session_id: str | None, title: str, search: str):
        if session_id and title.strip():
            self.service.rename_conversation(session_id, title.strip()[:200])
        return self.listing(session_id, search), ""

    def delete(self, session_id: str | None):
        if session_id:
            self.service.delete_conversation(session_id)
        return self.on_load()

    def switch_branch(self, session_id: str | None, message_id: int | None, search: str = ""):
        """Show the branch through `message_id` (a sibling of a message shown: "<" / ">")."""
        if session_id and message_id is not None:
            self.service.switch_branch(session_id, message_id)
        return self.show(session_id, search)

    def export(self, session_id: str | None, fmt: str):
        """The conversation as a file to download (JSON with every branch and the token metadata, or Markdown)."""
        import gradio as gr

        if not session_id:
            raise gr.Error("No conversation to export: choose one first")
        name, text = self.service.export_conversation(session_id, "markdown" if fmt == "Markdown" else "json")
        folder = Path(tempfile.mkdtemp(prefix="kvforge-export-"))  # private (0700): the conversation is the user's
        path = folder / name
        path.write_text(text)
        path.chmod(0o600)
        return gr.update(value=str(path), visible=True)

    def import_file(self, upload, search: str = ""):
        """A conversation exported as JSON, imported as a new one and shown."""
        import gradio as gr

        path = upload if isinstance(upload, str) else getattr(upload, "name", None)
        if not path:
            raise gr.Error("No file")
        try:
            session_id = self.service.import_conversation(Path(path).read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise gr.Error(f"Not imported: {exc}") from None
        return self.show(session_id, search)

    def choose_preset(self, name: str | None):
        import gradio as gr

        content = self.service.system_prompt(name) if name else None
        return content if content is not None else gr.update()

    def save_preset(self, name: str, system: str):
        """Save the system prompt shown under a name: (presets, name box)."""
        import gradio as gr

        name = (name or "").strip()
        if not name:
            raise gr.Error("Name the preset first")
        try:
            self.service.save_system_prompt(name, system or "")
        except ValueError as exc:
            raise gr.Error(str(exc)) from None
        return gr.update(choices=self.service.system_prompt_names(), value=name), ""

    def delete_preset(self, name: str | None):
        import gradio as gr

        if name:
            self.service.delete_system_prompt(name)
        return gr.update(choices=self.service.system_prompt_names(), value=None)

    async def send(self, message: dict | str | None, session_id: str | None, system: str, temperature: float,
                   top_p: float, max_tokens: int, repetition_guard: bool = True, search: str = ""):
        """Post a message (the chat box's text and its attached or pasted pictures: a vision model's) and stream its
        reply (see _stream)."""
        import gradio as gr

        text = ((message.get("text") if isinstance(message, dict) else message) or "").strip()
        files = (message.get("files") if isinstance(message, dict) else None) or []
        if not text and not files:
            yield (gr.update(),) * 4 + (session_id,) + (gr.update(),) * 3
            return
        pictures = [Path(getattr(f, "path", None) or (f.get("path") if isinstance(f, dict) else f)).read_bytes()
                    for f in files]
        session_id = self._prepare(session_id, system, temperature, top_p, max_tokens, repetition_guard)
        async for shown in self._stream(
                session_id, lambda: self.service.start_turn(session_id, text, {}, pictures=pictures), search):
            yield shown

    async def regenerate(self, session_id: str | None, system: str, temperature: float, top_p: float,
                         max_tokens: int, repetition_guard: bool = True, search: str = ""):
        """Another reply to the last message shown, beside the one there (a branch: "< 2/2 >")."""
        import gradio as gr

        conv = self.service.conversation(session_id)
        if conv is None or not conv.messages:
            raise gr.Error("Nothing to regenerate")
        last = conv.messages[-1]
        session_id = self._prepare(session_id, system, temperature, top_p, max_tokens, repetition_guard)
        async for shown in self._stream(session_id, lambda: self.service.regenerate(session_id, last.id, {}),
                                        search):
            yield shown

    async def edit(self, session_id: str | None, message_ids: list[int], system: str, temperature: float,
                   top_p: float, max_tokens: int, repetition_guard: bool, search: str, edited):
        """A user message edited in the chat: the new text is posted where the old one was (a branch beside it,
        the old one kept: "< 1/2 >") and answered."""
        import gradio as gr

        conv = self.service.conversation(session_id)
        index = edited.index if isinstance(edited.index, int) else edited.index[0]
        if conv is None or not 0 <= index < len(message_ids):
            raise gr.Error("That message is no longer shown")
        original = next((m for m in conv.messages if m.id == message_ids[index]), None)
        text = str(edited.value or "").strip()
        if original is None or original.role != "user" or not text:
            raise gr.Error("Only a user message can be edited, to some text")
        session_id = self._prepare(session_id, system, temperature, top_p, max_tokens, repetition_guard)
        pictures = self.service.message_pictures(original)  # the edited text keeps the message's pictures
        async for shown in self._stream(
                session_id, lambda: self.service.start_turn(session_id, text, {}, parent_id=original.parent_id,
                                                            pictures=pictures), search):
            yield shown

    def _prepare(self, session_id: str | None, system: str, temperature: float, top_p: float, max_tokens: int,
                 repetition_guard: bool) -> str:
        """Before a turn: the conversation (a new one when none is shown) with the settings shown kept as its own
        (where they differ from the model's); gradio's Error when the server is full (nothing stored)."""
        import gradio as gr

        try:
            self.service.check_open()  # a full server refuses before anything is stored (the turn checks again)
        except APIError as exc:
            raise gr.Error(exc.message) from None
        if not session_id:
            session_id = self.service.create_conversation(system).id
        else:
            self.service.keep_system_prompt(session_id, system)
        try:
            self.service.keep_sampling(session_id, {"temperature": float(temperature), "top_p": float(top_p),
                                                    "max_tokens": int(max_tokens),
                                                    "repetition_guard": bool(repetition_guard)})
        except ValueError as exc:
            raise gr.Error(str(exc)) from None
        return session_id

    async def _stream(self, session_id: str, start, search: str):
        """Queue the turn `start()` makes and stream its reply into the chat: yields (chat, textbox, stats,
        conversations listing, session, branches, bubble message ids, tooltips)."""
        import gradio as gr

        try:
            turn = await start()
        except APIError as exc:
            raise gr.Error(exc.message) from None
        before = chat_view(self.service.conversation(session_id), self.service.picture_path)
        reasoning, content, calls = "", "", []
        same = (gr.update(),) * 3
        # a conversation longer than the context: said from the start of the reply, and with its stats
        yield (before.bubbles + message_bubbles("assistant", ""), "", reply_stats_markdown(None, turn.truncation),
               self.listing(session_id, search), session_id, *same)
        async for event in turn.events():
            if event["type"] == "delta":
                reasoning += event.get("reasoning_content", "")
                content += event.get("content", "")
                calls += event.get("tool_calls", [])
                shown = message_bubbles("assistant", content, reasoning, thinking=not (content or calls),
                                        tool_calls=calls)
                yield (before.bubbles + shown, gr.update(), gr.update(), gr.update(), session_id, *same)
            elif event["type"] == "done":
                after = chat_view(self.service.conversation(session_id), self.service.picture_path)
                yield (after.bubbles, gr.update(), reply_stats_markdown(event["message"], turn.truncation),
                       gr.update(), session_id, after.branches, after.message_ids, titles_html(after.titles))

    async def stopped_stats(self, session_id: str | None) -> tuple:
        """After Stop: the cancelled reply is stored as it ends (abort); show it and its stats once it is:
        (stats, branches, bubble message ids, tooltips)."""
        conv = self.service.conversation(session_id)
        for _ in range(40):
            if conv is None:
                return "", [], [], titles_html([])
            last = conv.messages[-1] if conv.messages else None
            if last is not None and last.role == "assistant" and last.finish_reason == "abort":
                break
            await asyncio.sleep(0.05)
            conv = self.service.conversation(session_id)
        view = chat_view(conv, self.service.picture_path)
        return last_stats(conv), view.branches, view.message_ids, titles_html(view.titles)

    def edit_last(self, session_id: str | None):
        # the last user message back into the textbox, the branch shown up to before it (the old turn is kept,
        # a sibling of what is sent next): (chat, textbox, stats, branches, bubble message ids, tooltips)
        text = self.service.drop_last_turn(session_id)
        conv = self.service.conversation(session_id)
        view = chat_view(conv, self.service.picture_path)
        return view.bubbles, text, last_stats(conv), view.branches, view.message_ids, titles_html(view.titles)


def add_chat(blocks: gr.Blocks, service: UIService) -> None:
    """Two columns of the page's row: the conversations, then the chat with its generation settings."""
    import gradio as gr

    on = ChatHandlers(service)
    session = gr.State(None)  # the conversation this tab shows
    listing = gr.State({"groups": [], "selected": None, "search": ""})  # the conversations list's contents
    branches = gr.State([])  # the branch points of the branch shown
    message_ids = gr.State([])  # the message each chat bubble shows
    shown_outputs: list = []  # filled below, once every component exists (the lists rendered later use it)
    with gr.Column(scale=1, min_width=220):
        # enabled by the page's load event: a conversation made before it answers would be unselected by it
        new_button = gr.Button("New chat", elem_id="new-chat", variant="secondary", interactive=False)
        search_box = gr.Textbox(placeholder="Search conversations", show_label=False, elem_id="search",
                                max_lines=1)
        with gr.Column(elem_id="conversations"):
            @gr.render(inputs=[listing])
            def conversations_list(shown: dict):
                """One list per date group ("Today", "Yesterday", ...), the newest first."""
                if not shown["groups"]:
                    gr.Markdown("No conversations match." if shown["search"] else "No conversations yet.",
                                elem_id="no-conversations")
                for label, items in shown["groups"]:
                    ids = [session_id for _, session_id in items]
                    group = gr.Radio(label=label, choices=items, elem_classes=["conversation-group"], interactive=True,
                                     value=shown["selected"] if shown["selected"] in ids else None)
                    group.input(on.show, inputs=[group, search_box], outputs=shown_outputs)

        title_box = gr.Textbox(label="Rename to", elem_id="rename-title", max_lines=1)
        with gr.Row():
            rename_button = gr.Button("Rename", elem_id="rename", size="sm")
            delete_button = gr.Button("Delete", elem_id="delete", size="sm", variant="stop")
        with gr.Accordion("Export / import", open=False):
            export_format = gr.Radio(["JSON", "Markdown"], value="JSON", show_label=False, elem_id="export-format")
            export_button = gr.Button("Export", size="sm", elem_id="export")
            export_file = gr.File(label="Download", visible=False, elem_id="export-file", interactive=False)
            import_button = gr.UploadButton("Import JSON", file_types=[".json"], size="sm", elem_id="import")
    with gr.Column(scale=3):
        chatbot = gr.Chatbot(elem_id="chat", height=460, label="Chat", editable="user", buttons=["copy"])
        titles = gr.HTML(titles_html([]), elem_id="message-titles", container=False, padding=False)
        stats = gr.Markdown(elem_id="reply-stats")

        @gr.render(inputs=[branches])
        def branch_switches(points: list[dict]):
            """Each point of the branch shown where other branches start: "< 2/3 >" to go to a sibling."""
            with gr.Column(elem_id="branches", visible=bool(points)):
                for i, point in enumerate(points):
                    with gr.Row(equal_height=True, elem_classes=["branch-point"]):
                        gr.Markdown(branch_label(point), elem_id=f"branch-{i}", elem_classes=["branch-label"])
                        previous = gr.Button("<", size="sm", elem_id=f"branch-previous-{i}", scale=0, min_width=40,
                                             interactive=point["previous"] is not None)
                        following = gr.Button(">", size="sm", elem_id=f"branch-next-{i}", scale=0, min_width=40,
                                              interactive=point["next"] is not None)
                    for button, target in ((previous, point["previous"]), (following, point["next"])):
                        button.click(on.switch_branch, inputs=[session, gr.State(target), search_box],
                                     outputs=shown_outputs)

        with gr.Row():
            # a picture is attached (or pasted) here for a vision model; a text-only one refuses it with a message
            textbox = gr.MultimodalTextbox(placeholder="Message (Enter to send; attach or paste pictures for a "
                                           "vision model)", show_label=False, scale=5, elem_id="message",
                                           max_lines=8, file_types=["image"], file_count="multiple",
                                           sources=["upload"], submit_btn=False)
            send_button = gr.Button("Send", variant="primary", scale=1, elem_id="send")
            stop_button = gr.Button("Stop", scale=1, elem_id="stop")
        with gr.Row():
            regenerate_button = gr.Button("Regenerate", size="sm", elem_id="regenerate")
            edit_button = gr.Button("Edit last message", size="sm", elem_id="edit-last")
        with gr.Accordion("Generation settings", open=False):
            system_box = gr.Textbox(label="System prompt", lines=2, elem_id="system-prompt")
            with gr.Row():
                presets = gr.Dropdown(service.system_prompt_names(), value=None, label="Presets",
                                      elem_id="presets", scale=2)
                preset_name = gr.Textbox(label="Save as", elem_id="preset-name", max_lines=1, scale=2)
                save_preset = gr.Button("Save preset", size="sm", elem_id="save-preset", scale=1)
                delete_preset = gr.Button("Delete preset", size="sm", elem_id="delete-preset", scale=1)
            defaults = service.sampling_defaults()  # the page's first values; each conversation then shows its own
            temperature = gr.Slider(0, 2, value=defaults["temperature"], step=0.05, label="Temperature",
                                    elem_id="temperature")
            top_p = gr.Slider(0.05, 1, value=defaults["top_p"], step=0.05, label="Top-p", elem_id="top-p")
            max_tokens = gr.Slider(1, 4096, value=defaults["max_tokens"], step=1, label="Max tokens",
                                   elem_id="max-tokens")
            guard = gr.Checkbox(value=defaults["repetition_guard"], label="Stop a reply that repeats itself",
                                elem_id="repetition-guard")
            with gr.Row():
                defaults_note = gr.Markdown(service.model_defaults_note(), elem_id="model-defaults")
                defaults_button = gr.Button("Model defaults", size="sm", elem_id="model-defaults-button")

    sampling = [temperature, top_p, max_tokens, guard]
    shown_outputs += [listing, session, chatbot, stats, system_box, *sampling, defaults_note, branches, message_ids,
                      titles]
    blocks.load(on.on_page_load, outputs=[*shown_outputs, new_button], api_name="on_load")  # its API name as before
    new_button.click(on.new_conversation, inputs=[system_box], outputs=shown_outputs)
    chatbot.clear(on.new_conversation, inputs=[system_box], outputs=shown_outputs)  # its trash icon: the chat stays
    search_box.change(on.search, inputs=[session, search_box], outputs=[listing], show_progress="hidden")
    rename_button.click(on.rename, inputs=[session, title_box, search_box], outputs=[listing, title_box])
    delete_button.click(on.delete, inputs=[session], outputs=shown_outputs)
    export_button.click(on.export, inputs=[session, export_format], outputs=[export_file])
    import_button.upload(on.import_file, inputs=[import_button, search_box], outputs=shown_outputs)
    presets.input(on.choose_preset, inputs=[presets], outputs=[system_box])
    save_preset.click(on.save_preset, inputs=[preset_name, system_box], outputs=[presets, preset_name])
    delete_preset.click(on.delete_preset, inputs=[presets], outputs=[presets])
    defaults_button.click(on.model_defaults, outputs=sampling)

    turn_settings = [system_box, *sampling, search_box]
    turn_outputs = [chatbot, textbox, stats, listing, session, branches, message_ids, titles]
    send_inputs = [textbox, session, *turn_settings]
    sending = [send_button.click(on.send, send_inputs, turn_outputs, concurrency_limit=None),
               textbox.submit(on.send, send_inputs, turn_outputs, concurrency_limit=None),
               regenerate_button.click(on.regenerate, [session, *turn_settings], turn_outputs,
                                       concurrency_limit=None),
               chatbot.retry(on.regenerate, [session, *turn_settings], turn_outputs, concurrency_limit=None)]

    async def edited(session_id, ids, system, temperature, top_p, max_tokens, repetition_guard, search, data):
        async for shown in on.edit(session_id, ids, system, temperature, top_p, max_tokens, repetition_guard,
                                   search, data):
            yield shown
    edited.__annotations__ = {"data": gr.EditData}  # how gradio knows to pass the edit (this module's hints are text)
    sending.append(chatbot.edit(edited, [session, message_ids, *turn_settings], turn_outputs,
                                concurrency_limit=None))
    stop_button.click(None, cancels=sending).then(on.stopped_stats, [session], [stats, branches, message_ids, titles])
    edit_button.click(on.edit_last, [session], [chatbot, textbox, stats, branches, message_ids, titles])
