"""Tinker's wire (/api/v1): sessions, the model and sampling-session ids mapped to runs, and persisted futures

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'tinker_sessions',
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('user_id', sa.String(length=36), nullable=False),
        sa.Column('display_name', sa.String(length=200), nullable=False),
        sa.Column('user_metadata', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_tinker_sessions_user_id', 'tinker_sessions', ['user_id'])
    op.create_table(
        'tinker_models',
        sa.Column('id', sa.String(length=160), nullable=False),
        sa.Column('session_id', sa.String(length=64), nullable=False),
        sa.Column('user_id', sa.String(length=36), nullable=False),
        sa.Column('kind', sa.String(length=8), nullable=False),
        sa.Column('run_id', sa.String(length=36), nullable=True),
        sa.Column('base_model', sa.String(length=300), nullable=False),
        sa.Column('model_path', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_tinker_models_session_id', 'tinker_models', ['session_id'])
    op.create_index('ix_tinker_models_user_id', 'tinker_models', ['user_id'])
    op.create_index('ix_tinker_models_run_id', 'tinker_models', ['run_id'])
    op.create_table(
        'tinker_futures',
        sa.Column('request_id', sa.String(length=36), nullable=False),
        sa.Column('user_id', sa.String(length=36), nullable=False),
        sa.Column('key_kind', sa.String(length=8), nullable=False),
        sa.Column('key_scope', sa.String(length=160), nullable=False),
        sa.Column('key_seq', sa.BigInteger(), nullable=False),
        sa.Column('request_type', sa.String(length=40), nullable=False),
        sa.Column('state', sa.String(length=10), nullable=False),
        sa.Column('media_type', sa.String(length=40), nullable=False),
        sa.Column('result', sa.LargeBinary(), nullable=True),
        sa.Column('sample_sequence_ids', sa.JSON(), nullable=False),
        sa.Column('owner', sa.String(length=64), nullable=False),
        sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('request_id'),
    )
    op.create_index('ix_tinker_futures_user_id', 'tinker_futures', ['user_id'])
    op.create_index('ix_tinker_futures_state', 'tinker_futures', ['state'])
    op.create_index('ix_tinker_futures_key', 'tinker_futures', ['key_kind', 'key_scope', 'key_seq'], unique=True)


def downgrade() -> None:
    op.drop_table('tinker_futures')
    op.drop_table('tinker_models')
    op.drop_table('tinker_sessions')
