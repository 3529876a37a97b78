"""Add responses: OpenAI Responses API responses kept for ``previous_response_id``.

A response names the agent and the reply message that answered it (the agent's deletion
leaves the response, ``agent_id`` NULL) and the response it continues (``previous_id``).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 08:30:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("agent_id", sa.String(length=64), nullable=True),
        sa.Column("message_id", sa.Integer(), nullable=True),
        sa.Column("previous_id", sa.String(length=64), nullable=True),
        sa.Column("input", sa.Text(), nullable=False),
        sa.Column("output", sa.Text(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["agent_id"],
            ["agents.id"],
            name=op.f("fk_responses_agent_id_agents"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_responses")),
    )
    op.create_index(op.f("ix_responses_agent_id"), "responses", ["agent_id"])
    op.create_index(op.f("ix_responses_previous_id"), "responses", ["previous_id"])
    op.create_index(op.f("ix_responses_created_at"), "responses", ["created_at"])


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index(op.f("ix_responses_created_at"), table_name="responses")
    op.drop_index(op.f("ix_responses_previous_id"), table_name="responses")
    op.drop_index(op.f("ix_responses_agent_id"), table_name="responses")
    op.drop_table("responses")
