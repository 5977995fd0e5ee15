"""changestream: a spec-complete MongoDB change stream client.

``changestream.watch(coll)`` is a drop-in for PyMongo's ``coll.watch()``.
"""

from __future__ import annotations

from .api import Client, Collection, Database, watch
from .errors import ChangeStreamError, MissingResumeTokenError, SplitEventError
from .stream import ChangeStream
from .token import token_cluster_time, token_from_json, token_to_json

__version__ = "0.1.0"

__all__ = [
    "ChangeStream",
    "ChangeStreamError",
    "Client",
    "Collection",
    "Database",
    "MissingResumeTokenError",
    "SplitEventError",
    "__version__",
    "token_cluster_time",
    "token_from_json",
    "token_to_json",
    "watch",
]
