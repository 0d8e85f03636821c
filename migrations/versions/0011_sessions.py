"""Dashboard sessions on the server (issue 18 §5): a `sessions` row per signed-in browser, and users.disabled

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 05:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'sessions',
        sa.Column('id_hash', sa.String(length=64), nullable=False),
        sa.Column('user_id', sa.String(length=36), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('last_seen_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('user_agent', sa.String(length=300), nullable=False),
        sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id_hash'),
    )
    op.create_index('ix_sessions_user_id', 'sessions', ['user_id'])
    with op.batch_alter_table('users') as batch:
        batch.add_column(sa.Column('disabled', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('users') as batch:
        batch.drop_column('disabled')
    op.drop_index('ix_sessions_user_id', table_name='sessions')
    op.drop_table('sessions')
