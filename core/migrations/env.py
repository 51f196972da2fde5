"""Alembic environment: migrations run on the connection Store hands over (no alembic.ini)."""

from alembic import context

from kvforge.core.store import Base, mapped_schema_object

# Base.metadata holds the models imported so far (core/kv/sql_index.py, app/sessions/conversations.py,
# app/sessions/system_prompts.py): import them all before autogenerating a revision, or it proposes dropping the
# tables of
# the missing ones.

connection = context.config.attributes["connection"]
# render_as_batch: SQLite cannot ALTER most things in place; batch mode copies the table instead. The search
# index's tables and indexes are no model's (core/store.py's mapped_schema_object).
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True,
                  include_name=mapped_schema_object)
with context.begin_transaction():
    context.run_migrations()
