"""A run's name, tags and note, and when it was archived (issue 18 §1: runs you can tell apart and manage)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04 17:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing runs keep an empty name (the dashboard shows their id), no tags and no note.
    op.add_column('runs', sa.Column('name', sa.String(length=200), nullable=False, server_default=''))
    op.add_column('runs', sa.Column('tags', sa.JSON(), nullable=False, server_default='[]'))
    op.add_column('runs', sa.Column('note', sa.Text(), nullable=False, server_default=''))
    op.add_column('runs', sa.Column('archived_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('archived_at')
        batch.drop_column('note')
        batch.drop_column('tags')
        batch.drop_column('name')
