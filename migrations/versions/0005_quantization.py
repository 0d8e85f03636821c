"""quantization on runs: a quantized base ("8bit" | "4bit") is its own pool

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 09:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Empty string: the base in its own precision (existing runs).
    op.add_column('runs', sa.Column('quantization', sa.String(length=8), nullable=False, server_default=''))


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('quantization')
