"""Conversations, messages and the persisted-KV index.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("title", sa.String(200), nullable=False),
        sa.Column("model", sa.String(200)),
        sa.Column("settings", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_index("ix_conversations_updated_at", "conversations", ["updated_at"])
    op.create_table(
        "messages",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("conversation_id", sa.String(32), sa.ForeignKey("conversations.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("content", sa.Text, nullable=False),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("completion_tokens", sa.Integer),
        sa.Column("cached_tokens", sa.Integer),
        sa.Column("finish_reason", sa.String(16)),
        sa.Column("ttft_s", sa.Float),
        sa.Column("tokens_per_s", sa.Float),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.UniqueConstraint("conversation_id", "position"),
    )
    op.create_index("ix_messages_conversation_id", "messages", ["conversation_id"])
    op.create_table(
        "kv_blocks",
        sa.Column("hash", sa.LargeBinary(16), primary_key=True),
        sa.Column("parent_hash", sa.LargeBinary(16), nullable=False),
        sa.Column("fingerprint", sa.LargeBinary(16), nullable=False),
        sa.Column("token_digest", sa.LargeBinary(16), nullable=False),
        sa.Column("num_tokens", sa.Integer, nullable=False),
        sa.Column("file", sa.String(200), nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("checksum", sa.LargeBinary(32), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("last_access", sa.Float, nullable=False),
    )
    op.create_index("ix_kv_blocks_fingerprint", "kv_blocks", ["fingerprint"])
    op.create_index("ix_kv_blocks_last_access", "kv_blocks", ["last_access"])


def downgrade() -> None:
    op.drop_table("kv_blocks")
    op.drop_table("messages")
    op.drop_table("conversations")
