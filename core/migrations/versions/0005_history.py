"""Conversation search and system-prompt presets (issue 26).

- system_prompts: presets saved by name (app/sessions/system_prompts.py).
- A full-text index over message contents and conversation titles (app/sessions/search.py):
  - SQLite: FTS5 tables kept by triggers. messages_fts is an external-content table over messages.content
    (rowid = messages.id, an INTEGER PRIMARY KEY, so it is stable); conversations_fts keeps its own copy of each
    title with the conversation's id (conversations' implicit rowids may change on VACUUM). A SQLite without
    FTS5 gets neither: search then falls back to LIKE (detected at runtime). A database made with FTS5 needs it
    to write messages afterwards (the triggers use it).
  - PostgreSQL: GIN expression indexes on to_tsvector('simple', ...), which the server keeps itself.
  A later migration that batch-copies messages or conversations on SQLite drops their triggers with the old
  table: it must create them again and rebuild the index ("rebuild" / refill), as upgrade() does here.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# unicode61 with diacritics folded: "cafe" finds "café"; no stemming, as PostgreSQL's 'simple' configuration
TOKENIZE = "unicode61 remove_diacritics 2"

SQLITE_INDEX = [
    f"CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', content_rowid='id', "
    f"tokenize='{TOKENIZE}')",
    "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN "
    "INSERT INTO messages_fts (rowid, content) VALUES (new.id, new.content); END",
    "CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN "
    "INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.id, old.content); END",
    "CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN "
    "INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.id, old.content); "
    "INSERT INTO messages_fts (rowid, content) VALUES (new.id, new.content); END",
    "INSERT INTO messages_fts (messages_fts) VALUES ('rebuild')",
    f"CREATE VIRTUAL TABLE conversations_fts USING fts5(title, conversation_id UNINDEXED, tokenize='{TOKENIZE}')",
    "CREATE TRIGGER conversations_fts_insert AFTER INSERT ON conversations BEGIN "
    "INSERT INTO conversations_fts (title, conversation_id) VALUES (new.title, new.id); END",
    "CREATE TRIGGER conversations_fts_delete AFTER DELETE ON conversations BEGIN "
    "DELETE FROM conversations_fts WHERE conversation_id = old.id; END",
    "CREATE TRIGGER conversations_fts_update AFTER UPDATE OF title ON conversations BEGIN "
    "UPDATE conversations_fts SET title = new.title WHERE conversation_id = old.id; END",
    "INSERT INTO conversations_fts (title, conversation_id) SELECT title, id FROM conversations",
]
SQLITE_INDEX_DROP = [f"DROP TRIGGER IF EXISTS {table}_fts_{event}" for table in ("messages", "conversations")
                     for event in ("insert", "delete", "update")] + [
    "DROP TABLE IF EXISTS messages_fts", "DROP TABLE IF EXISTS conversations_fts"]

# the same expressions as the queries' (app/sessions/search.py), or the planner does not use them
POSTGRES_INDEX = [
    "CREATE INDEX ix_messages_content_fts ON messages USING gin (to_tsvector('simple'::regconfig, content))",
    "CREATE INDEX ix_conversations_title_fts ON conversations USING gin (to_tsvector('simple'::regconfig, title))",
]
POSTGRES_INDEX_DROP = ["DROP INDEX IF EXISTS ix_messages_content_fts",
                       "DROP INDEX IF EXISTS ix_conversations_title_fts"]


def _sqlite_has_fts5(bind) -> bool:
    try:  # a failed CREATE has no effect on SQLite's transaction
        bind.exec_driver_sql("CREATE VIRTUAL TABLE temp.kvforge_fts5_probe USING fts5(x)")
    except sa.exc.DatabaseError:
        return False
    bind.exec_driver_sql("DROP TABLE temp.kvforge_fts5_probe")
    return True


def upgrade() -> None:
    op.create_table(
        "system_prompts",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("content", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        statements = POSTGRES_INDEX
    elif bind.dialect.name == "sqlite" and _sqlite_has_fts5(bind):
        statements = SQLITE_INDEX
    else:
        statements = []  # search scans with LIKE
    for statement in statements:
        op.execute(statement)


def downgrade() -> None:
    bind = op.get_bind()
    for statement in POSTGRES_INDEX_DROP if bind.dialect.name == "postgresql" else SQLITE_INDEX_DROP:
        op.execute(statement)
    op.drop_table("system_prompts")
