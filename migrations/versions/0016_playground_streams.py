"""The playground's pending streams in the database (issue 18 §4): a POST and its stream's GET may reach different
server processes, so the validated request waits in `playground_streams`, not in one process's memory

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05 02:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'playground_streams',
        sa.Column('id_hash', sa.String(length=64), nullable=False),
        sa.Column('user_id', sa.String(length=36), nullable=False),
        sa.Column('panes', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('opened_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id_hash'),
    )
    op.create_index('ix_playground_streams_user_id', 'playground_streams', ['user_id'])


def downgrade() -> None:
    op.drop_index('ix_playground_streams_user_id', table_name='playground_streams')
    op.drop_table('playground_streams')
