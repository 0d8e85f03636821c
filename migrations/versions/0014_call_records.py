"""One row per applied call (issue 19 §5: applied means recorded, once), written in the transaction that records
the call; the usage view reads them (issue 18 §6)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04 20:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Calls applied before this revision have no row: usage starts here (runs.compute_seconds keeps their total).
    op.create_table(
        'call_records',
        sa.Column('key', sa.String(length=200), nullable=False),
        sa.Column('user_id', sa.String(length=36), nullable=False),
        sa.Column('run_id', sa.String(length=36), nullable=True),
        sa.Column('request_id', sa.String(length=128), nullable=False),
        sa.Column('operation', sa.String(length=32), nullable=False),
        sa.Column('base_model', sa.String(length=300), nullable=False),
        sa.Column('compute_seconds', sa.Float(), nullable=False),
        sa.Column('device', sa.String(length=40), nullable=False),
        sa.Column('gpu_type', sa.String(length=40), nullable=False),
        sa.Column('gpu_count', sa.Integer(), nullable=False),
        sa.Column('gpu_seconds', sa.Float(), nullable=False),
        sa.Column('credits', sa.Float(), nullable=False),
        sa.Column('tokens_in', sa.BigInteger(), nullable=False),
        sa.Column('tokens_out', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('key'),
    )
    op.create_index('ix_call_records_user_id', 'call_records', ['user_id'])
    op.create_index('ix_call_records_run_id', 'call_records', ['run_id'])
    op.create_index('ix_call_records_created_at', 'call_records', ['created_at'])


def downgrade() -> None:
    op.drop_index('ix_call_records_created_at', table_name='call_records')
    op.drop_index('ix_call_records_run_id', table_name='call_records')
    op.drop_index('ix_call_records_user_id', table_name='call_records')
    op.drop_table('call_records')
