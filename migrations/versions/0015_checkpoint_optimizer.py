"""A checkpoint's with_optimizer and pending_excluded, as the runtime's SaveStateResult gives them (issue 14: the
drift test found that saveState's answer dropped both)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04 20:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Rows saved before read as the runtime's own defaults: no AdamW state recorded, nothing excluded.
    op.add_column('checkpoints', sa.Column('with_optimizer', sa.Boolean(), nullable=False, server_default=sa.false()))
    op.add_column('checkpoints', sa.Column('pending_excluded', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('checkpoints') as batch:
        batch.drop_column('pending_excluded')
        batch.drop_column('with_optimizer')
