"""Store: the one database file behind the app's conversations and the persisted-KV index.

One URL selects it: a SQLite file (the default, inside the data directory) or PostgreSQL
(`postgresql+psycopg://...`). The schema (every table: core/migrations) is created and upgraded by Alembic
on open. Its tables are mapped by their owners on the declarative `Base` here: the KV index rows by
core/kv/sql_index.py, conversations and messages by app/sessions/conversations.py. Every write is one short
transaction, so a process killed at any moment leaves the database consistent (SQLite runs in WAL mode).
Timestamps are Unix seconds, like the OpenAI API's.

There is no process-wide cache: whoever opens a Store owns it, passes it on, and closes it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import platformdirs
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from kvforge.core.private_files import DIR_MODE, private_file

MIGRATIONS = Path(__file__).parent / "migrations"


def default_data_dir() -> Path:
    """$KVFORGE_DATA_DIR, else the user's data directory (~/.local/share/kvforge on Linux)."""
    env = os.environ.get("KVFORGE_DATA_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_data_dir("kvforge", appauthor=False))


def default_db_url(data_dir: Path) -> str:
    return f"sqlite:///{data_dir / 'kvforge.db'}"


# Schema objects the migrations make that no model maps: the conversation search index (migration 0005: SQLite
# FTS5 tables with their shadow tables, PostgreSQL expression indexes). Autogenerate and compare_metadata skip them.
UNMAPPED_PREFIXES = ("messages_fts", "conversations_fts", "ix_messages_content_fts", "ix_conversations_title_fts")


def mapped_schema_object(name: str | None, type_: str, parent_names: dict[str, Any]) -> bool:
    """Alembic's include_name hook: False for the schema objects no model maps (UNMAPPED_PREFIXES)."""
    return not (type_ in ("table", "index") and name is not None and name.startswith(UNMAPPED_PREFIXES))


class Base(DeclarativeBase):
    """The data file's ORM models, whoever owns them: one metadata, the one the migrations describe."""


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer; crash-consistent
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def upgrade(engine: Engine) -> None:
    """Create or upgrade the schema to the newest migration (Alembic, scripts in core/migrations)."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


class Store:
    """An open database: its schema at the newest migration, short sessions from any thread."""

    def __init__(self, url: str) -> None:
        self.url = url
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            path = Path(url.removeprefix("sqlite:///")).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)  # a new one is private; a given one kept
            private_file(path)  # SQLite gives its -wal / -shm / -journal files the database file's mode
        self.engine = create_engine(url, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        upgrade(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def session(self) -> Session:
        return self._sessions()

    def close(self) -> None:
        """Close every pooled connection (SQLite checkpoints its WAL into the file)."""
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
