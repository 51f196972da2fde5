"""System-prompt presets: named system prompts a user saves once and picks for any conversation (the browser UI's
preset menu, GET/PUT/DELETE /v1/system_prompts in app/sessions/history_routes.py). Kept in the Store's system_prompts
table
(migration 0005); every call is one short transaction."""

from __future__ import annotations

import time
import unicodedata
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from sqlalchemy import Float, String, Text, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Mapped, mapped_column

from kvforge.app.dialects.openai.fields import MAX_SYSTEM_PROMPT_CHARS
from kvforge.app.sessions.conversations import NotFound
from kvforge.app.sessions.stored_text import Storable
from kvforge.core.store import Base, Store

MAX_NAME_CHARS = 100


def _name(name: str) -> str:
    if not name.strip():
        raise ValueError("must not be blank")
    if name != name.strip():
        raise ValueError("must not start or end with whitespace")
    if "/" in name or any(unicodedata.category(ch) == "Cc" for ch in name):  # a name is one URL path segment
        raise ValueError("must not contain '/' or control characters")
    return name


PresetName = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(_name)]  # _name: not blank
PresetContent = Annotated[str, Field(min_length=1, max_length=MAX_SYSTEM_PROMPT_CHARS), Storable]
_NAME, _CONTENT = TypeAdapter(PresetName), TypeAdapter(PresetContent)


class SystemPromptRequest(BaseModel):
    """PUT /v1/system_prompts/{name}: the preset's text (it creates the preset or replaces its text)."""

    model_config = ConfigDict(extra="forbid")
    content: PresetContent


class SystemPrompt(Base):
    __tablename__ = "system_prompts"
    name: Mapped[str] = mapped_column(String(MAX_NAME_CHARS), primary_key=True)
    content: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "object": "system_prompt", "content": self.content, "created_at": self.created_at,
                "updated_at": self.updated_at}


def checked(adapter: TypeAdapter, field: str, value: Any) -> Any:
    """`value` validated; a ValueError naming `field` ("name: must not be blank") when it is not valid."""
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        message = str((error.get("ctx") or {}).get("error", error["msg"]))
        raise ValueError(f"{field}: {message}") from None


class SystemPrompts:
    """Preset CRUD on a Store its caller owns."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def list(self) -> list[SystemPrompt]:
        """Every preset, by name."""
        with self.store.session() as s:
            return list(s.scalars(select(SystemPrompt).order_by(SystemPrompt.name)))

    def get(self, name: str) -> SystemPrompt:
        """The preset, or NotFound."""
        with self.store.session() as s:
            preset = s.get(SystemPrompt, name)
        if preset is None:
            raise NotFound(f"system prompt {name!r} not found")
        return preset

    def put(self, name: str, content: str) -> SystemPrompt:
        """Create the preset or replace its text (its created_at kept), in one statement, so that two writers of
        one new name cannot both insert; ValueError naming the field for a bad name or content."""
        name, content = checked(_NAME, "name", name), checked(_CONTENT, "content", content)
        now = time.time()
        dialect = postgresql if self.store.engine.dialect.name == "postgresql" else sqlite
        upsert = dialect.insert(SystemPrompt).values(name=name, content=content, created_at=now, updated_at=now)
        upsert = upsert.on_conflict_do_update(index_elements=[SystemPrompt.name],
                                              set_={"content": content, "updated_at": now})
        with self.store.session() as s, s.begin():
            s.execute(upsert)
        return self.get(name)

    def delete(self, name: str) -> None:
        """Delete the preset; NotFound when there is none of that name."""
        with self.store.session() as s, s.begin():
            if s.execute(delete(SystemPrompt).where(SystemPrompt.name == name)).rowcount == 0:
                raise NotFound(f"system prompt {name!r} not found")
