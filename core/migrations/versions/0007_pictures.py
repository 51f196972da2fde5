"""Pictures in conversations: a user message's pictures (a vision model's chat) as the SHA-256 of each, in order,
and each picture's bytes once in `pictures`, whichever messages show it (app/sessions/pictures.py). NULL: a message
without pictures (every message before this revision).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("pictures",
                    sa.Column("sha256", sa.String(64), primary_key=True),
                    sa.Column("data", sa.LargeBinary, nullable=False),
                    sa.Column("created_at", sa.Float, nullable=False))
    with op.batch_alter_table("messages") as batch:  # an added column: in place, no copy, on SQLite too
        batch.add_column(sa.Column("images", sa.JSON))


def downgrade() -> None:
    op.drop_column("messages", "images")  # in place (see 0006)
    op.drop_table("pictures")
