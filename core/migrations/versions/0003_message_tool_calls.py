"""A reply's tool calls, and the call a tool message answers.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("tool_calls", sa.JSON))
        batch.add_column(sa.Column("tool_call_id", sa.String(200)))


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("tool_call_id")
        batch.drop_column("tool_calls")
