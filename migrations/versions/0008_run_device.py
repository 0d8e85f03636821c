"""device on runs and deductions: what the run trains on ("cpu", "cuda:0"), apart from gpu_config (the requested
allocation), so a run on the CPU is billed at the CPU rate

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # "": not known for runs created before this column (billed, as before, by their gpu_config).
    for table in ('runs', 'billing_outbox'):
        op.add_column(table, sa.Column('device', sa.String(length=40), nullable=False, server_default=''))


def downgrade() -> None:
    for table in ('billing_outbox', 'runs'):
        with op.batch_alter_table(table) as batch:
            batch.drop_column('device')
