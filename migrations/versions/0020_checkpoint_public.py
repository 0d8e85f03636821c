"""public on checkpoints: its owner published it (Tinker's publish_checkpoint_from_tinker_path), so any signed-in
user may read it by its tinker:// path; never write it

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # false: every checkpoint saved before publishing existed stays its owner's alone.
    op.add_column('checkpoints', sa.Column('public', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('checkpoints') as batch:
        batch.drop_column('public')
