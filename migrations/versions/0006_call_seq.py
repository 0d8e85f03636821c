"""call_seq on runs: the last ticket handed out, so calls on one run apply in one order across server processes

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # 0: no ticket taken yet (existing runs too); the first call's ticket is 1.
    op.add_column('runs', sa.Column('call_seq', sa.BigInteger(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('call_seq')
