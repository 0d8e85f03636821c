"""Callers' numbered sessions per run in the database (issue 14 §4): a pipelined call's successor may reach another
server process, so the last number that holds a ticket lives beside the run's ticket (`runs.call_seq`)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05 05:45:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'run_sessions',
        sa.Column('run_id', sa.String(length=36), nullable=False),
        sa.Column('session', sa.String(length=64), nullable=False),
        sa.Column('last_seq', sa.BigInteger(), nullable=False),
        sa.Column('ticket', sa.BigInteger(), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'session'),
    )


def downgrade() -> None:
    op.drop_table('run_sessions')
