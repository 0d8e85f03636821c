"""A sample's prompt tokens found in the decode cache rather than prefilled (issue 31 §1: cached prefill billed
apart in usage), beside its prompt tokens on the call record

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06 10:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('call_records', sa.Column('tokens_cached', sa.BigInteger(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('call_records') as batch:
        batch.drop_column('tokens_cached')
