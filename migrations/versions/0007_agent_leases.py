"""Add agents.version and agent_leases: fencing the turns of an agent to one worker at a time.

the ``version`` column of ``agents`` counts the changes of an agent's transcript and system prompt
(existing agents start at 0); a turn stores itself only while the agent is at the version it read.
``agent_leases`` holds, per agent, the worker running its turns and until when;
``kv_blocks.pinned_until`` keeps a stored prefix through every worker's garbage collection
until then. On PostgreSQL
the file sizes (``kv_caches.nbytes``, ``kv_blocks.nbytes`` and ``window_nbytes``) become
64-bit, as SQLite's INTEGER already is.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 10:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("agents") as batch:
        batch.add_column(sa.Column("version", sa.Integer(), server_default="0", nullable=False))
    op.create_table(
        "agent_leases",
        sa.Column("agent_id", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("worker_id", sa.String(length=64), nullable=False),
        sa.Column("token", sa.Integer(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["agent_id"],
            ["agents.id"],
            name=op.f("fk_agent_leases_agent_id_agents"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("agent_id", name=op.f("pk_agent_leases")),
    )
    op.create_index(op.f("ix_agent_leases_holder"), "agent_leases", ["holder"])
    op.add_column("kv_blocks", sa.Column("pinned_until", sa.DateTime(timezone=True)))
    _file_sizes(sa.BigInteger())


def downgrade() -> None:
    """Downgrade schema."""
    _file_sizes(sa.Integer())
    with op.batch_alter_table("kv_blocks") as batch:
        batch.drop_column("pinned_until")
    op.drop_index(op.f("ix_agent_leases_holder"), table_name="agent_leases")
    op.drop_table("agent_leases")
    with op.batch_alter_table("agents") as batch:
        batch.drop_column("version")


def _file_sizes(type_: sa.types.TypeEngine) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite: INTEGER holds 64 bits whatever the declared type
    for table, column in (
        ("kv_caches", "nbytes"),
        ("kv_blocks", "nbytes"),
        ("kv_blocks", "window_nbytes"),
    ):
        op.alter_column(table, column, type_=type_)
