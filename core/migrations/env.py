"""Alembic environment: migrations run on the connection Store hands over (no alembic.ini)."""

from alembic import context

from kvforge.core.store import Base

# Base.metadata holds the models imported so far (core/kv/sql_index.py, app/conversations.py): import both
# before autogenerating a revision, or it proposes dropping the tables of the missing one.

connection = context.config.attributes["connection"]
# render_as_batch: SQLite cannot ALTER most things in place; batch mode copies the table instead.
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
