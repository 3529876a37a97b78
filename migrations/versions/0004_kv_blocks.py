"""Add kv_blocks and kv_cache_blocks: paged, content-addressed KV caches.

A cache saved in format 2 is a small per-agent file (the tokens after the last full block, the
global layers' positions there and the sliding-window layers' state) plus the blocks it lists
in ``kv_cache_blocks``. Blocks are shared between agents and deleted when no row lists them.
Existing format-1 caches stay readable; an agent's next save replaces its file with format 2.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 04:30:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "kv_blocks",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("nbytes", sa.Integer(), nullable=False),
        sa.Column("checksum", sa.String(length=64), nullable=False),
        sa.Column("window_nbytes", sa.Integer(), nullable=True),
        sa.Column("window_checksum", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_kv_blocks")),
    )
    op.create_table(
        "kv_cache_blocks",
        sa.Column("agent_id", sa.String(length=64), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("block_key", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["agent_id"],
            ["agents.id"],
            name=op.f("fk_kv_cache_blocks_agent_id_agents"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["block_key"], ["kv_blocks.key"], name=op.f("fk_kv_cache_blocks_block_key_kv_blocks")
        ),
        sa.PrimaryKeyConstraint("agent_id", "position", name=op.f("pk_kv_cache_blocks")),
    )
    op.create_index("ix_kv_cache_blocks_block_key", "kv_cache_blocks", ["block_key"])


def downgrade() -> None:
    """Downgrade schema."""
    # Format-2 cache entries point at files that need their blocks: drop them, so agents
    # rebuild from their transcripts. Their tails are swept as unreferenced on the next open;
    # nothing before 0004 reads caches/_blocks, which can then be deleted by hand.
    op.execute("DELETE FROM kv_caches WHERE format_version >= 2")
    op.drop_index("ix_kv_cache_blocks_block_key", table_name="kv_cache_blocks")
    op.drop_table("kv_cache_blocks")
    op.drop_table("kv_blocks")
