"""Add kv_caches.message_count: how many transcript messages a cache covers.

Rows written before this revision get 0 through the server default. Their true coverage is
unknown, so a reader should treat ``message_count == 0`` with ``token_count > 0`` as a cache it
cannot line up with the transcript and rebuild it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 05:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    # NOT NULL needs a default for the rows already there; SQLite adds it without a table copy.
    with op.batch_alter_table("kv_caches") as batch_op:
        batch_op.add_column(
            sa.Column("message_count", sa.Integer(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    """Downgrade schema."""
    # Batch mode rebuilds kv_caches (copy, drop, rename); migration_transaction keeps FKs off.
    with op.batch_alter_table("kv_caches") as batch_op:
        batch_op.drop_column("message_count")
