"""billing hooks: compute seconds on runs, and the outbox of deductions owed to the billing backend

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-10 13:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain ADD COLUMN with a default (no batch rebuild): existing runs start at 0 seconds.
    op.add_column('runs', sa.Column('compute_seconds', sa.Float(), nullable=False, server_default='0'))
    op.create_table('billing_outbox',
    sa.Column('idempotency_key', sa.String(length=200), nullable=False),
    sa.Column('user_id', sa.String(length=36), nullable=False),
    sa.Column('run_id', sa.String(length=36), nullable=False),
    sa.Column('operation', sa.String(length=32), nullable=False),
    sa.Column('compute_seconds', sa.Float(), nullable=False),
    sa.Column('gpu_type', sa.String(length=40), nullable=False),
    sa.Column('gpu_count', sa.Integer(), nullable=False),
    sa.Column('gpu_seconds', sa.Float(), nullable=False),
    sa.Column('credits', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('sent_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('idempotency_key')
    )
    op.create_index(op.f('ix_billing_outbox_user_id'), 'billing_outbox', ['user_id'], unique=False)
    op.create_index(op.f('ix_billing_outbox_sent_at'), 'billing_outbox', ['sent_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_billing_outbox_sent_at'), table_name='billing_outbox')
    op.drop_index(op.f('ix_billing_outbox_user_id'), table_name='billing_outbox')
    op.drop_table('billing_outbox')
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('compute_seconds')
