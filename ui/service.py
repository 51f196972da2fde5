"""UIService: what the browser UI needs from the app, as typed methods, so that the chat, settings and dashboard
views never reach into the store, the model host or the engine themselves.

Conversations are the session store's, through the same ChatService as /v1/sessions (one admission gate, one
way a turn is stored), branches included: a conversation's `messages` are the branch shown, each with its
`parent_id` and `siblings` (the branches at that point, for "< 2/3 >"), and editing or regenerating keeps the
old branch; model choices and swaps go through the same ModelHost as the admin API; the dashboard's
figures come from the one server-side DashboardSampler.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvforge.app.generate.pictures import data_url, picture_media_type
from kvforge.app.http.errors import validation_message
from kvforge.app.models.spec import ModelSpec
from kvforge.app.sessions.conversations import (
    CURRENT,
    Conversation,
    Leaf,
    Message,
    MessageNotFound,
    NotFound,
    shown_pictures,
)
from kvforge.app.sessions.date_groups import group_by_date
from kvforge.app.sessions.history import ConversationExport, export_conversation, export_filename, import_conversation
from kvforge.app.sessions.markdown import conversation_markdown
from kvforge.app.sessions.protocol import check_sampling
from kvforge.app.sessions.search import ConversationSearch
from kvforge.app.sessions.service import DEFAULT_TITLE, ChatService, Turn
from kvforge.app.sessions.system_prompts import SystemPrompts
from kvforge.core.config import EngineConfig
from kvforge.core.loader import EMBEDDED_ALIASES, embedded_gguf_path, resolve_model
from kvforge.core.private_files import open_private, private_dir
from kvforge.core.sampling import SamplingParams

if TYPE_CHECKING:
    from kvforge.ui.dashboard import DashboardSampler, Sample

# the browser's replies end a loop (core/repetition.py) unless the conversation turns it off; the API's do not
UI_REPETITION_GUARD = True
UI_MAX_TOKENS = 1024  # a reply's length when neither the server (--default-max-tokens) nor the model sets one
PICTURE_SUFFIXES = {"image/png": ".png", "image/jpeg": ".jpg", "image/gif": ".gif", "image/webp": ".webp",
                    "image/bmp": ".bmp"}  # a picture file's name as the browser's type sniffing expects it


class UIService:
    def __init__(self, chat: ChatService, sampler: DashboardSampler) -> None:
        self._chat, self._sampler = chat, sampler
        self._conversations, self._host = chat.conversations, chat.context.host

    # ---- conversations ------------------------------------------------------------------------------

    def conversation_choices(self) -> list[tuple[str, str]]:
        """(title, id) of every conversation, the most recently updated first."""
        return [(c.title, c.id) for c in self._conversations.list()]

    def conversation(self, session_id: str | None) -> Conversation | None:
        """The conversation with its messages, or None (no id, or deleted meanwhile)."""
        if not session_id:
            return None
        try:
            return self._conversations.get(session_id)
        except NotFound:
            return None

    def create_conversation(self, system_prompt: str | None) -> Conversation:
        return self._conversations.create(DEFAULT_TITLE, self._host.name, {"system_prompt": system_prompt or None})

    def rename_conversation(self, session_id: str, title: str) -> None:
        self._conversations.update(session_id, title=title)

    def delete_conversation(self, session_id: str) -> None:
        """Delete it; one already gone (another tab, the API) is not an error."""
        try:
            self._conversations.delete(session_id)
        except NotFound:
            pass

    def keep_system_prompt(self, session_id: str, system_prompt: str | None) -> None:
        """Store the system prompt with the conversation when it changed; NotFound for an unknown one."""
        conv = self._conversations.get(session_id)
        if ((conv.settings or {}).get("system_prompt") or "") != (system_prompt or ""):
            self._conversations.update(session_id, settings={**(conv.settings or {}),
                                                             "system_prompt": system_prompt or None})

    def drop_last_turn(self, session_id: str | None) -> str:
        """Show the branch up to (without) the last user message shown, which is returned: the next message sent
        starts a branch beside it (an edit), and the old turn stays reachable (switch_branch)."""
        if not session_id:
            return ""
        messages = self._conversations.get(session_id).messages
        users = [m for m in messages if m.role == "user"]
        if not users:
            return ""
        self._conversations.set_current(session_id, users[-1].parent_id)
        return users[-1].content

    def switch_branch(self, session_id: str, message_id: int) -> Conversation | None:
        """Show the branch through `message_id` (e.g. a sibling from a message's `siblings`) down to its most
        recent reply; the conversation as then shown, or None (deleted meanwhile); MessageNotFound for an id not
        in it."""
        try:
            return self._conversations.switch(session_id, message_id)
        except MessageNotFound:
            raise
        except NotFound:  # the conversation is gone
            return None

    def all_messages(self, session_id: str) -> list[Message]:
        """Every message of every branch, in creation order (each with parent_id and siblings)."""
        return self._conversations.tree(session_id)

    def check_open(self) -> None:
        """APIError when the server is full: a turn is refused before anything is stored."""
        self._chat.admission.check_open()

    async def start_turn(self, session_id: str, message: str, overrides: dict[str, Any],
                         parent_id: int | None | Leaf = CURRENT, pictures: list[bytes] | None = None) -> Turn:
        """Post a user message after `parent_id` (None: a new first message; by default the last one shown: an
        edit of a message passes the id of the message the old text followed), with its `pictures` (a vision
        model's; their files' bytes), and queue its reply."""
        images = [data_url(data) for data in pictures or ()]
        return await self._chat.start_turn(session_id, message, overrides, parent_id=parent_id, images=images)

    def message_pictures(self, message) -> list[bytes]:
        """A stored message's pictures' bytes, in order."""
        kept = self._conversations.pictures(shown_pictures([message]))
        return [kept[digest] for digest in message.images or () if digest in kept]

    def picture_path(self, digest: str) -> str:
        """A file of the picture kept under `digest`, for the chat to show: written once into gradio's (private)
        directory, which gradio serves from."""
        folder = private_dir(Path(os.environ.get("GRADIO_TEMP_DIR", tempfile.gettempdir())) / "kvforge-pictures")
        written = next(folder.glob(f"{digest}*"), None)  # each render of the chat shows it: read from the store once
        if written is not None:
            return str(written)
        data = self._conversations.pictures([digest]).get(digest, b"")
        path = folder / f"{digest}{PICTURE_SUFFIXES.get(picture_media_type(data), '')}"
        with open_private(path) as file:
            file.write(data)
        return str(path)

    async def regenerate(self, session_id: str, message_id: int, overrides: dict[str, Any]) -> Turn:
        """Another reply to a user message (or to the message an assistant reply answers), beside the earlier
        replies; APIError when it cannot be."""
        return await self._chat.regenerate(session_id, message_id, overrides)

    # ---- generation settings ------------------------------------------------------------------------

    def sampling_defaults(self) -> dict[str, Any]:
        """What a conversation's reply samples with when the conversation sets nothing: the served model's defaults
        (core/generation_defaults.py) over SamplingParams' and the server's, and the UI's repetition guard."""
        engine = self._host.engine
        model = engine.engine.generation_defaults.values if engine is not None else {}
        base = {name: SamplingParams.default(name) for name in ("temperature", "top_p")}
        max_tokens = self._chat.context.default_max_tokens or UI_MAX_TOKENS
        base |= {"max_tokens": max_tokens, "repetition_guard": UI_REPETITION_GUARD}
        return base | {k: v for k, v in model.items() if k in base}

    def model_defaults_note(self) -> str:
        engine = self._host.engine
        if engine is None:
            return ""
        defaults = engine.engine.generation_defaults
        shown = ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in defaults.values.items()) or "neutral"
        return f"Model defaults: {shown} ({defaults.source})"

    def sampling_view(self, conv: Conversation | None) -> dict[str, Any]:
        """The generation settings a conversation's next reply uses: its own over sampling_defaults()."""
        stored = ((conv.settings or {}).get("sampling") or {}) if conv is not None else {}
        defaults = self.sampling_defaults()
        return defaults | {k: v for k, v in stored.items() if k in defaults}

    def keep_sampling(self, session_id: str, values: dict[str, Any]) -> None:
        """Store the settings shown as the conversation's own where they differ from sampling_defaults() (one equal
        to the default is dropped: the conversation follows the model's again); its other sampling settings (set
        through the sessions API) are kept. ValueError (naming the field) for values out of bounds."""
        conv = self._conversations.get(session_id)
        defaults = self.sampling_defaults()
        stored = dict((conv.settings or {}).get("sampling") or {})
        for name, value in values.items():
            if value == defaults.get(name):
                stored.pop(name, None)
            else:
                stored[name] = value
        if stored != ((conv.settings or {}).get("sampling") or {}):
            self._conversations.update(session_id, settings={**(conv.settings or {}),
                                                             "sampling": check_sampling(stored)})

    # ---- the model host -----------------------------------------------------------------------------

    def model_name(self) -> str | None:
        """The served model's name; None when no model is loaded."""
        return self._host.name

    def model_choice(self) -> str:
        """The last loaded model as the settings panel lists it (the embedded default, or a models-dir entry)."""
        return self._host.spec.entry

    def available_models(self) -> list[str]:
        return self._host.available()

    def last_spec(self) -> ModelSpec:
        """What the last load asked for (the server's own settings before any swap)."""
        return self._host.spec

    def running_config(self) -> EngineConfig | None:
        """The configuration the running engine was built with (None: no model loaded)."""
        engine = self._host.engine
        return engine.config if engine is not None else None

    def kv_pool_bytes(self) -> int | None:
        """The running engine's KV pool size (None: no model loaded)."""
        return self._host.engine.stats().kv_cache_bytes if self._host.engine is not None else None

    def gguf_file(self, model: str) -> Path | None:
        """The GGUF file a listed model is (the embedded default is one), else None."""
        if model in EMBEDDED_ALIASES:
            return embedded_gguf_path()
        models_dir = self._host.models_dir
        if models_dir is not None and model.endswith(".gguf") and model in self._host.available():  # listed only:
            return models_dir / model  # no path outside the models directory, no FIFO (app/models/catalog.py)
        return None

    def local_model_dir(self, model: str) -> Path | None:
        """The converted checkpoint of a listed model, readable before it is loaded (None: a GGUF file not
        converted yet)."""
        models_dir = self._host.models_dir
        if model in EMBEDDED_ALIASES:
            return resolve_model(None)
        if models_dir is not None and model in self._host.available() and (models_dir / model).is_dir():
            return models_dir / model
        return None

    async def load_model(self, spec: ModelSpec) -> None:
        """Swap to `spec` (in-flight replies finish first); raises when refused."""
        await self._host.load(spec)

    def replies_in_flight(self) -> int:
        return self._host.in_flight

    # ---- the dashboard's figures --------------------------------------------------------------------

    def latest_sample(self) -> Sample:
        return self._sampler.latest()

    def sample_history(self) -> list[Sample]:
        return self._sampler.history()

    def recent_ttfts(self) -> list[float]:
        return self._sampler.recent_ttfts()

    # ---- history: the sidebar's groups and search, export and import, system-prompt presets ----------------------

    @cached_property
    def _search(self) -> ConversationSearch:
        return ConversationSearch(self._conversations.store)

    @cached_property
    def _presets(self) -> SystemPrompts:
        return SystemPrompts(self._conversations.store)

    def conversation_groups(self, search: str = "") -> list[tuple[str, list[tuple[str, str]]]]:
        """(group label, [(title, id)]) by last update in local time ("Today", "Yesterday", "Previous 7 days",
        "Previous 30 days", "November 2026"...), newest first; with `search`, only the conversations whose title or
        messages (any branch) hold its words. ValueError for a search over 500 characters or 16 words."""
        found = [hit.conversation for hit in self._search.search(search)] if search.strip() \
            else self._conversations.list()
        return [(label, [(c.title, c.id) for c in group])
                for label, group in group_by_date(found, lambda c: c.updated_at, datetime.now())]

    def export_conversation(self, session_id: str, fmt: str) -> tuple[str, str]:
        """(file name, text) of the conversation as "json" (every branch: app/sessions/history.py's format,
        importable) or
        "markdown" (the branch shown); NotFound for an unknown conversation, ValueError for another format."""
        conv = self._conversations.get(session_id)
        if fmt == "json":
            pictures = self._conversations.pictures(shown_pictures(conv.nodes))
            return export_filename(conv.title, "json"), json.dumps(export_conversation(conv, pictures), indent=2,
                                                                  ensure_ascii=False)
        if fmt == "markdown":
            return export_filename(conv.title, "md"), conversation_markdown(conv)
        raise ValueError(f"unknown export format {fmt!r} (json or markdown)")

    def import_conversation(self, text: str) -> str:
        """A JSON export (a file's text) stored as a new conversation: its id. ValueError naming what is wrong
        ("not valid JSON...", "messages.3.role: ...") when it is not one; nothing is stored then."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"not a kvforge conversation export: not valid JSON ({exc})") from None
        try:
            export = ConversationExport.model_validate(data)
        except ValidationError as exc:
            message, _ = validation_message(RequestValidationError(exc.errors(), body=data))
            raise ValueError(f"not a kvforge conversation export: {message}") from None
        return import_conversation(self._conversations.store, export)

    def system_prompt_names(self) -> list[str]:
        return [preset.name for preset in self._presets.list()]

    def system_prompt(self, name: str) -> str | None:
        """The preset's text, or None when there is none of that name."""
        try:
            return self._presets.get(name).content
        except NotFound:
            return None

    def save_system_prompt(self, name: str, content: str) -> None:
        """Create the preset or replace its text (the name trimmed); ValueError naming the field ("name: must not be
        blank", "content: ...")."""
        self._presets.put(name.strip(), content)

    def delete_system_prompt(self, name: str) -> None:
        """Delete the preset; one already gone (another tab, the API) is not an error."""
        try:
            self._presets.delete(name)
        except NotFound:
            pass
