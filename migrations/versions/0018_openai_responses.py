"""/v1/responses' stored responses in the database (issue 35): `previous_response_id` outlives a restart and reaches
every server process, per user, deleted with the run

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'openai_responses',
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('user_id', sa.String(length=36), nullable=False),
        sa.Column('run_id', sa.String(length=36), nullable=True),
        sa.Column('messages', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_openai_responses_user_id', 'openai_responses', ['user_id'])
    op.create_index('ix_openai_responses_run_id', 'openai_responses', ['run_id'])


def downgrade() -> None:
    op.drop_index('ix_openai_responses_run_id', table_name='openai_responses')
    op.drop_index('ix_openai_responses_user_id', table_name='openai_responses')
    op.drop_table('openai_responses')
