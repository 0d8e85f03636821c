"""hub_url on checkpoints: where save_state(push_to_hub=True) uploaded it, so the dashboard and API can link it

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 10:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('checkpoints', sa.Column('hub_url', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('checkpoints') as batch:
        batch.drop_column('hub_url')
