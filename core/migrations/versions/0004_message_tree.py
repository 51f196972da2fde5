"""Messages form a tree: editing a message or regenerating a reply starts a branch beside the old one.

A message's parent is the message it follows (NULL: a root); a conversation's current_message_id is the last
message of the branch shown. position becomes the depth (the parent's + 1, a root's 1), so it is no longer
unique within a conversation. Existing conversations become one branch each: every message follows the one
before it, and the last is current.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# SQLite keeps 0001's unique constraint unnamed: batch mode names it by this convention so it can be dropped
NAMING = {"uq": "uq_%(table_name)s_%(column_0_name)s"}
UNIQUE_POSITIONS = ("conversation_id", "position")


def _unique_positions_name() -> str:
    bind = op.get_bind()
    for constraint in sa.inspect(bind).get_unique_constraints("messages"):
        if tuple(constraint["column_names"]) == UNIQUE_POSITIONS:
            return constraint["name"] or "uq_messages_conversation_id"
    raise RuntimeError("messages has no unique (conversation_id, position) constraint to drop")


def upgrade() -> None:
    unique_name = _unique_positions_name()
    # parent_id is added empty: SQLite's batch copy drops the old table, and a row referencing it then would
    # be cascaded away with it
    with op.batch_alter_table("messages", naming_convention=NAMING) as batch:
        batch.add_column(sa.Column("parent_id", sa.Integer, nullable=True))
        batch.create_foreign_key("fk_messages_parent_id_messages", "messages", ["parent_id"], ["id"],
                                 ondelete="CASCADE")
        batch.create_index("ix_messages_parent_id", ["parent_id"])
        batch.drop_constraint(unique_name, type_="unique")
        batch.create_index("ix_messages_conversation_id_position", list(UNIQUE_POSITIONS))
    # a plain integer, no foreign key (conversations and messages would reference each other), added in place:
    # a SQLite batch copy of conversations would cascade the old table's drop to every message
    op.add_column("conversations", sa.Column("current_message_id", sa.Integer, nullable=True))

    # every message follows the one before it; the last one is shown
    op.execute("UPDATE messages SET parent_id = (SELECT p.id FROM messages p WHERE p.conversation_id = "
               "messages.conversation_id AND p.position < messages.position ORDER BY p.position DESC LIMIT 1)")
    op.execute("UPDATE conversations SET current_message_id = (SELECT m.id FROM messages m WHERE "
               "m.conversation_id = conversations.id ORDER BY m.position DESC LIMIT 1)")


def downgrade() -> None:
    # one branch per conversation again: the one shown (none shown: the newest message's) is kept, the others
    # are deleted; positions are depths, so the kept branch's are 1, 2, 3... already
    bind = op.get_bind()
    parents = dict(bind.execute(sa.text("SELECT id, parent_id FROM messages")).all())
    kept: set[int] = set()
    for (current,) in bind.execute(sa.text(
            "SELECT coalesce(current_message_id, (SELECT max(m.id) FROM messages m "
            "WHERE m.conversation_id = conversations.id)) FROM conversations")).all():
        while current is not None and current not in kept:
            kept.add(current)
            current = parents.get(current)
    # the links go first: SQLite's batch copy below must not find rows referencing the table it drops
    op.execute("UPDATE messages SET parent_id = NULL")
    doomed = [m for m in parents if m not in kept]
    delete = sa.text("DELETE FROM messages WHERE id IN :ids").bindparams(sa.bindparam("ids", expanding=True))
    for start in range(0, len(doomed), 500):
        bind.execute(delete, {"ids": doomed[start:start + 500]})

    # not in batch mode: SQLite would copy conversations, and dropping the old table cascades to its messages
    op.drop_column("conversations", "current_message_id")
    with op.batch_alter_table("messages") as batch:
        batch.drop_index("ix_messages_conversation_id_position")
        # PostgreSQL's default name, as 0001 made it (SQLite's was unnamed: batch mode needs one)
        name = "messages_conversation_id_position_key"
        batch.create_unique_constraint("uq_messages_conversation_id" if bind.dialect.name == "sqlite" else name,
                                       list(UNIQUE_POSITIONS))
        batch.drop_index("ix_messages_parent_id")
        batch.drop_constraint("fk_messages_parent_id_messages", type_="foreignkey")
        batch.drop_column("parent_id")
