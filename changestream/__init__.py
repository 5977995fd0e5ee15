"""changestream: a spec-complete MongoDB change stream client.

``changestream.watch(coll)`` is a drop-in for PyMongo's ``coll.watch()``;
``changestream.aio.watch(async_coll)`` is its asyncio twin;
``changestream.consume(...)`` handles every change at least once with a
durable resume token (:mod:`changestream.stores`).
"""

from __future__ import annotations

from . import aio
from .api import Client, Collection, Database, watch
from .consume import (
    ConsumeError,
    ConsumeResult,
    HistoryLostError,
    NotResumableError,
    RetriesExhaustedError,
    StreamInvalidatedError,
    consume,
)
from .errors import ChangeStreamError, MissingResumeTokenError, SplitEventError
from .stores import (
    AsyncMongoTokenStore,
    AsyncTokenStore,
    FileTokenStore,
    MemoryTokenStore,
    MongoTokenStore,
    StoredToken,
    TokenStore,
    TokenStoreError,
)
from .stream import ChangeStream
from .token import token_cluster_time, token_from_json, token_to_json

__version__ = "0.1.0"

__all__ = [
    "AsyncMongoTokenStore",
    "AsyncTokenStore",
    "ChangeStream",
    "ChangeStreamError",
    "Client",
    "Collection",
    "ConsumeError",
    "ConsumeResult",
    "Database",
    "FileTokenStore",
    "HistoryLostError",
    "MemoryTokenStore",
    "MissingResumeTokenError",
    "MongoTokenStore",
    "NotResumableError",
    "RetriesExhaustedError",
    "SplitEventError",
    "StoredToken",
    "StreamInvalidatedError",
    "TokenStore",
    "TokenStoreError",
    "__version__",
    "aio",
    "consume",
    "token_cluster_time",
    "token_from_json",
    "token_to_json",
    "watch",
]
