"""changestream: a spec-complete MongoDB change stream client.

``changestream.watch(coll)`` is a drop-in for PyMongo's ``coll.watch()``;
``changestream.aio.watch(async_coll)`` is its asyncio twin;
``changestream.consume(...)`` handles every change at least once with a
durable resume token (:mod:`changestream.stores`).

The public face: this module, :mod:`changestream.aio`, :mod:`changestream.events`,
:mod:`changestream.errors`, :mod:`changestream.stores`, :mod:`changestream.testing`
and :mod:`changestream.spark_adapter`. Modules whose names start with ``_`` are
internal and may change in any release. ``aio`` and ``spark_adapter`` are imported
on first use, so ``import changestream`` loads neither asyncio code nor PySpark.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._consumer.handler_errors import OnError
from ._consumer.history import HistoryGap
from ._consumer.run import ConsumeResult
from ._hub_items import Gap, SubscriberDisconnected
from ._lanes import BARRIER
from ._merge import MergeBatch, MergeRow, MissingDocumentError, merge_ready
from ._metrics import ConsumeStats
from ._position import Position
from ._snapshot import SnapshotError
from ._sync._api import Client, Collection, Database, watch
from ._sync._consume import consume
from ._sync._hub import Hub, Subscription
from ._sync._snapshot_watch import SnapshotThenWatch, snapshot_then_watch
from ._sync._stream import ChangeStream
from ._token import token_cluster_time, token_from_json, token_to_json
from ._watch_types import AsyncWatchOptions, WatchOptions
from .errors import (
    ChangeStreamError,
    ConsumeError,
    EventTooLargeError,
    HistoryLostError,
    InvalidResumeTokenError,
    MalformedReplyError,
    MissingResumeTokenError,
    NotResumableError,
    RetriesExhaustedError,
    SplitEventError,
    StreamInvalidatedError,
    describe_error,
    one_line,
)
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

if TYPE_CHECKING:
    from . import aio, spark_adapter

__version__ = "0.1.0"

_LAZY_SUBPACKAGES = frozenset({"aio", "spark_adapter"})


def __getattr__(name: str) -> Any:
    """Import ``aio`` and ``spark_adapter`` on first access (PEP 562)."""
    if name in _LAZY_SUBPACKAGES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "BARRIER",
    "AsyncMongoTokenStore",
    "AsyncTokenStore",
    "AsyncWatchOptions",
    "ChangeStream",
    "ChangeStreamError",
    "Client",
    "Collection",
    "ConsumeError",
    "ConsumeResult",
    "ConsumeStats",
    "Database",
    "EventTooLargeError",
    "FileTokenStore",
    "Gap",
    "HistoryGap",
    "HistoryLostError",
    "Hub",
    "InvalidResumeTokenError",
    "MalformedReplyError",
    "MemoryTokenStore",
    "MergeBatch",
    "MergeRow",
    "MissingDocumentError",
    "MissingResumeTokenError",
    "MongoTokenStore",
    "NotResumableError",
    "OnError",
    "Position",
    "RetriesExhaustedError",
    "SnapshotError",
    "SnapshotThenWatch",
    "SplitEventError",
    "StoredToken",
    "StreamInvalidatedError",
    "SubscriberDisconnected",
    "Subscription",
    "TokenStore",
    "TokenStoreError",
    "WatchOptions",
    "__version__",
    "aio",
    "consume",
    "describe_error",
    "merge_ready",
    "one_line",
    "snapshot_then_watch",
    "spark_adapter",
    "token_cluster_time",
    "token_from_json",
    "token_to_json",
    "watch",
]
