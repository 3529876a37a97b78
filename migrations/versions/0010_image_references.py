"""Add message_images (which message shows which image) and images.used_at.

An image no message shows any more (its agents deleted, its turns replaced) can then be found
with one indexed query and deleted, unless a turn stored or reused it lately (``used_at``): a
turn stores its images before its messages. Existing rows: each message's parts give its
images; ``used_at`` is the image's ``created_at``.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-29 12:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "message_images",
        sa.Column("message_id", sa.Integer(), nullable=False),
        sa.Column("image_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["message_id"],
            ["messages.id"],
            name=op.f("fk_message_images_message_id_messages"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["image_id"], ["images.id"], name=op.f("fk_message_images_image_id_images")
        ),
        sa.PrimaryKeyConstraint("message_id", "image_id", name=op.f("pk_message_images")),
    )
    op.create_index(op.f("ix_message_images_image_id"), "message_images", ["image_id"])
    with op.batch_alter_table("images") as batch_op:
        batch_op.add_column(sa.Column("used_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE images SET used_at = created_at")  # (NULL: an image never collected)
    # Each message's parts name its images (SQL alone, so that --sql scripts backfill too).
    if op.get_context().dialect.name == "postgresql":
        elements = "json_array_elements(m.parts) AS j"
        image, kind = "(j.value ->> 'image')::integer", "j.value ->> 'type'"
    else:
        elements = "json_each(m.parts) AS j"
        image, kind = "json_extract(j.value, '$.image')", "json_extract(j.value, '$.type')"
    op.execute(
        "INSERT INTO message_images (message_id, image_id) "
        f"SELECT DISTINCT m.id, {image} FROM messages AS m, {elements} "
        f"WHERE m.parts IS NOT NULL AND {kind} = 'image'"
    )


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("images") as batch_op:
        batch_op.drop_column("used_at")
    op.drop_index(op.f("ix_message_images_image_id"), table_name="message_images")
    op.drop_table("message_images")
