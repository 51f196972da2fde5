"""A reply's reasoning (the think block of a reasoning model), kept apart from its content.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("reasoning", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("reasoning")
