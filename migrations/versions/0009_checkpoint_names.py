"""checkpoints get a name, unique per run and kind (mode: adapter, merged, state, sampler), and an expiry for
unnamed sampler snapshots; checkpoints saved before this are named step-N after their step

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('checkpoints', sa.Column('name', sa.String(length=128), nullable=False, server_default=''))
    op.add_column('checkpoints', sa.Column('expires_at', sa.DateTime(), nullable=True))
    # One row per (run, mode, step) so far (its path said so): step-N is unique per run and kind.
    op.execute("UPDATE checkpoints SET name = 'step-' || CAST(step AS VARCHAR)")
    op.create_index('ix_checkpoints_run_mode_name', 'checkpoints', ['run_id', 'mode', 'name'], unique=True)


def downgrade() -> None:
    op.drop_index('ix_checkpoints_run_mode_name', table_name='checkpoints')
    with op.batch_alter_table('checkpoints') as batch:
        batch.drop_column('expires_at')
        batch.drop_column('name')
