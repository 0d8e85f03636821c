"""dashboard sign-in: login links, Google login attempts, user ids wide enough for Supabase UUIDs

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 19:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

# Every column holding a user id: 32 hex characters today, 36 for a Supabase (dashed UUID) id.
USER_ID_COLUMNS = [("users", "id"), ("api_keys", "user_id"), ("runs", "user_id")]


def _widen(length_from: int, length_to: int) -> None:
    if op.get_bind().dialect.name == "sqlite":
        # SQLite does not enforce VARCHAR lengths, and rebuilding `users` in batch mode would risk
        # cascading deletes into its children: nothing to do there.
        return
    for table, column in USER_ID_COLUMNS:
        op.alter_column(table, column, type_=sa.String(length=length_to),
                        existing_type=sa.String(length=length_from), existing_nullable=False)


def upgrade() -> None:
    _widen(32, 36)
    op.create_table('login_links',
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('user_id', sa.String(length=36), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('used_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('token_hash')
    )
    op.create_index(op.f('ix_login_links_user_id'), 'login_links', ['user_id'], unique=False)
    op.create_table('login_attempts',
    sa.Column('state', sa.String(length=64), nullable=False),
    sa.Column('code_verifier', sa.String(length=200), nullable=False),
    sa.Column('next_path', sa.String(length=500), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('used_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('state')
    )


def downgrade() -> None:
    op.drop_table('login_attempts')
    op.drop_index(op.f('ix_login_links_user_id'), table_name='login_links')
    op.drop_table('login_links')
    _widen(36, 32)
