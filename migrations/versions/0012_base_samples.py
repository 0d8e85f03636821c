"""A per-user history of base-model samples (issue 17's records: a /v1 request on a base model has no run whose
history could keep it)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-08 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'base_samples',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('user_id', sa.String(length=36), nullable=False),
        sa.Column('base_model', sa.String(length=300), nullable=False),
        sa.Column('prompt', sa.Text(), nullable=False),
        sa.Column('output', sa.Text(), nullable=False),
        sa.Column('params', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_base_samples_user_id', 'base_samples', ['user_id'])


def downgrade() -> None:
    op.drop_index('ix_base_samples_user_id', table_name='base_samples')
    op.drop_table('base_samples')
