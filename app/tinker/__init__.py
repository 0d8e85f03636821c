"""Tinker's wire (/api/v1) on Signal's app: the unmodified `tinker` SDK trains and samples here (docs/TINKER.md).

Never `import tinker` here: its package imports torch. app/tinker/proto.py loads only its generated protobuf module.
"""

from app.tinker.routes import routes

__all__ = ["routes"]
