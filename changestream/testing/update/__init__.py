"""The update layer: update operators, replacement and pipeline updates, and the ``$v: 2``
oplog diffs mongod logs for them.

Operator updates follow mongod's update tree (``update_object_node.cpp``):
:mod:`.parse` builds it, :mod:`.apply` applies it and records every change in a
:class:`~.diff_log.DiffLog`; :mod:`.pipeline` evaluates pipeline-style updates
and projections; :mod:`.diff` diffs two document images.
"""

from __future__ import annotations

from .parse import Outcome, UpdateEnv
from .pipeline import apply_pipeline, project
from .update import Update, is_operator_update

__all__ = ["Outcome", "Update", "UpdateEnv", "apply_pipeline", "is_operator_update", "project"]
