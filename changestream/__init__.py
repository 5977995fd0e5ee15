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

if TYPE_CHECKING:  # what the public names are; at run time each is imported on first use
    from . import aio, spark_adapter
    from ._consumer.handler_errors import OnError
    from ._consumer.history import HistoryGap
    from ._consumer.run import ConsumeResult
    from ._hub_items import Gap, SubscriberDisconnected
    from ._lanes import BARRIER
    from ._merge import MergeBatch, MergeRow, MissingDocumentError, merge_ready
    from ._metrics import ConsumeStats
    from ._position import Position
    from ._snapshot import SnapshotError
    from ._snapshot_read import read_snapshot
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

__version__ = "0.1.0"

_HOMES: dict[str, str] = {
    "Client": "._sync._api",
    "Collection": "._sync._api",
    "Database": "._sync._api",
    "watch": "._sync._api",
    "consume": "._sync._consume",
    "ConsumeResult": "._consumer.run",
    "Hub": "._sync._hub",
    "Subscription": "._sync._hub",
    "Gap": "._hub_items",
    "SubscriberDisconnected": "._hub_items",
    "BARRIER": "._lanes",
    "MergeBatch": "._merge",
    "MergeRow": "._merge",
    "MissingDocumentError": "._merge",
    "merge_ready": "._merge",
    "ConsumeStats": "._metrics",
    "HistoryGap": "._consumer.history",
    "OnError": "._consumer.handler_errors",
    "Position": "._position",
    "SnapshotError": "._snapshot",
    "read_snapshot": "._snapshot_read",
    "SnapshotThenWatch": "._sync._snapshot_watch",
    "snapshot_then_watch": "._sync._snapshot_watch",
    "ChangeStream": "._sync._stream",
    "token_cluster_time": "._token",
    "token_from_json": "._token",
    "token_to_json": "._token",
    "AsyncWatchOptions": "._watch_types",
    "WatchOptions": "._watch_types",
    "ChangeStreamError": ".errors",
    "ConsumeError": ".errors",
    "EventTooLargeError": ".errors",
    "HistoryLostError": ".errors",
    "InvalidResumeTokenError": ".errors",
    "MalformedReplyError": ".errors",
    "MissingResumeTokenError": ".errors",
    "NotResumableError": ".errors",
    "RetriesExhaustedError": ".errors",
    "SplitEventError": ".errors",
    "StreamInvalidatedError": ".errors",
    "describe_error": ".errors",
    "one_line": ".errors",
    "AsyncMongoTokenStore": ".stores",
    "AsyncTokenStore": ".stores",
    "FileTokenStore": ".stores",
    "MemoryTokenStore": ".stores",
    "MongoTokenStore": ".stores",
    "StoredToken": ".stores",
    "TokenStore": ".stores",
    "TokenStoreError": ".stores",
}
"""Where each public name lives (``tests/client/test_public_api.py`` checks it against the
imports above). Importing on first use keeps ``import changestream`` cheap: the command
line is then ready for a Ctrl-C before PyMongo is loaded."""

_LAZY_SUBPACKAGES = frozenset({"aio", "spark_adapter", "errors", "events", "stores"})
"""Public modules reachable as attributes (``changestream.errors.X``) without importing them."""


def __getattr__(name: str) -> Any:
    """Import a public name or module on first access (PEP 562)."""
    import importlib

    if name in _LAZY_SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # the next access is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

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
    "read_snapshot",
    "snapshot_then_watch",
    "spark_adapter",
    "token_cluster_time",
    "token_from_json",
    "token_to_json",
    "watch",
]
