"""Add agents.tools: the tool definitions an agent's conversation carries.

An agent the HTTP server creates for a stateless client is matched to later requests by its
system prompt and tools together; with the tools stored, that key is rebuilt exactly when the
server opens. NULL (every existing row): no tools.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27 23:10:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("agents") as batch_op:
        batch_op.add_column(sa.Column("tools", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    # Batch mode rebuilds agents (copy, drop, rename); migration_transaction keeps FKs off, so
    # the messages and caches that reference agents survive.
    with op.batch_alter_table("agents") as batch_op:
        batch_op.drop_column("tools")
