"""What a reply's prompt left out: a conversation longer than the context loses its oldest whole turns from the prompt
(app/generate/context_fit.py), and the reply keeps {"dropped_messages", "dropped_turns"} so that the chat says so
again when the conversation is reloaded, exported or imported. NULL: nothing was left out (every reply before this
revision).

On SQLite both directions alter the table in place (ADD / DROP COLUMN, SQLite >= 3.35): a batch copy of messages
would drop the search index's triggers with the old table (see 0005).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:  # an added column: in place, no copy, on SQLite too
        batch.add_column(sa.Column("context_truncated", sa.JSON))


def downgrade() -> None:
    # not batch mode: SQLite's batch drops a column by copying the table; ALTER TABLE DROP COLUMN keeps it in place
    op.drop_column("messages", "context_truncated")
