"""Add kv_blocks.segment and segment_index: blocks written together share one file.

A save writes its new blocks (a run of consecutive blocks) as one *segment* file,
``_blocks/<last key[:2]>/<last key>-<count>.safetensors``, so a resume opens a few files
rather than one per block. A row with ``segment`` NULL is a block in its own file
``<key>.safetensors`` (written before 0005), still read as it is.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 07:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column("kv_blocks", sa.Column("segment", sa.String(length=80), nullable=True))
    op.add_column("kv_blocks", sa.Column("segment_index", sa.Integer(), nullable=True))
    op.create_index("ix_kv_blocks_segment", "kv_blocks", ["segment"])


def downgrade() -> None:
    """Downgrade schema."""
    # Blocks in segment files cannot be read before 0005: drop them and the caches that list
    # them, so those agents rebuild from their transcripts. Their tails are swept at the next
    # open; the segment files (caches/_blocks/*/*-*.safetensors) are names the code before 0005
    # does not know, so it leaves them: delete them by hand.
    op.execute(
        "DELETE FROM kv_caches WHERE agent_id IN (SELECT c.agent_id FROM kv_cache_blocks c "
        "JOIN kv_blocks b ON b.key = c.block_key WHERE b.segment IS NOT NULL)"
    )
    op.execute("DELETE FROM kv_cache_blocks WHERE agent_id NOT IN (SELECT agent_id FROM kv_caches)")
    op.execute("DELETE FROM kv_blocks WHERE segment IS NOT NULL")
    op.drop_index("ix_kv_blocks_segment", table_name="kv_blocks")
    with op.batch_alter_table("kv_blocks") as batch:
        batch.drop_column("segment_index")
        batch.drop_column("segment")
