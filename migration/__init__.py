"""The request path, all of it there to survive failures: the OpenAI-compatible router, its client to
workers, request journals, coalesced checkpoints to etcd, resume rules and stream stitching.

Start one with ``fleetward router`` (or :func:`fleetward.migration.server.serve_router`); see
:mod:`fleetward.migration.router` for the request life and :mod:`fleetward.migration.journal` for what
resumes exactly.
"""

from fleetward.migration.journal import Journal, Kind
from fleetward.migration.router import Router, RouterError

__all__ = ["Journal", "Kind", "Router", "RouterError"]
