"""asyncio twin of :mod:`changestream`: the same streams over PyMongo's ``AsyncMongoClient``.

``await changestream.aio.watch(async_coll)`` returns an
:class:`AsyncChangeStream` driven by the same spec state machine as the
sync :class:`changestream.ChangeStream`; :func:`consume` is the async
at-least-once loop.
"""

from __future__ import annotations

from ._api import watch
from ._consume import consume
from ._snapshot_watch import AsyncSnapshotThenWatch, snapshot_then_watch
from ._stream import AsyncChangeStream, TokenCallback

__all__ = [
    "AsyncChangeStream",
    "AsyncSnapshotThenWatch",
    "TokenCallback",
    "consume",
    "snapshot_then_watch",
    "watch",
]
