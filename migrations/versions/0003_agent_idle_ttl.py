"""Add agents.idle_ttl_s: agents that expire after that many seconds without a turn.

NULL (every existing row) keeps an agent until it is deleted. The HTTP server gives the agents
it creates for stateless clients a TTL, so conversations nobody resumes do not pile up.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 02:20:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("agents") as batch_op:
        batch_op.add_column(sa.Column("idle_ttl_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    # Batch mode rebuilds agents (copy, drop, rename); migration_transaction keeps FKs off, so
    # the messages and caches that reference agents survive.
    with op.batch_alter_table("agents") as batch_op:
        batch_op.drop_column("idle_ttl_s")
