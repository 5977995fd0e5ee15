"""Where a change stream is, and how far behind the server it is (no I/O).

Two cluster times, both read from what the server sent, so client clock skew
never enters:

* ``token_time``: the cluster time inside the stream's resume token, i.e. the
  last event delivered (or, between events, the ``postBatchResumeToken`` the
  server says the stream has reached);
* ``server_time``: the newest cluster time seen in any reply of the stream
  (``operationTime``, ``$clusterTime`` and the ``postBatchResumeToken``).

``lag`` is their difference. It grows when the consumer falls behind (the
server keeps answering getMores with newer times while the token stays on old
events) and drops to zero once it has caught up. Cluster times have
one-second resolution, and an idle deployment advances its cluster time only
with writes (mongod writes a no-op every 10 s), so ``lag`` is precise to about
a second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from bson.timestamp import Timestamp

from ._token import token_cluster_time

__all__ = ["Position", "newest_reply_time"]


def _later(a: Timestamp | None, b: Timestamp | None) -> Timestamp | None:
    if a is None:
        return b
    if b is None:
        return a
    return b if (b.time, b.inc) > (a.time, a.inc) else a


def _as_timestamp(value: Any) -> Timestamp | None:
    return value if isinstance(value, Timestamp) else None


def newest_reply_time(reply: Mapping[str, Any], previous: Timestamp | None) -> Timestamp | None:
    """``previous`` moved forward to the newest cluster time a command reply carries."""
    newest = _later(previous, _as_timestamp(reply.get("operationTime")))
    gossip = reply.get("$clusterTime")
    if isinstance(gossip, Mapping):
        newest = _later(newest, _as_timestamp(gossip.get("clusterTime")))
    cursor = reply.get("cursor")
    if isinstance(cursor, Mapping):
        pbrt = cursor.get("postBatchResumeToken")
        if isinstance(pbrt, Mapping):
            newest = _later(newest, token_cluster_time(pbrt))
    return newest


def _to_datetime(ts: Timestamp | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts.time, tz=timezone.utc)


@dataclasses.dataclass(frozen=True)
class Position:
    """A stream's progress: see the module docstring. Cheap to build; take one when needed."""

    token_time: Timestamp | None
    """Cluster time of the resume token (``None``: no token yet, or one that cannot be read)."""
    server_time: Timestamp | None
    """Newest cluster time seen in a reply (``None``: no reply carried one)."""

    @property
    def token_datetime(self) -> datetime | None:
        """:attr:`token_time` as an aware UTC ``datetime`` (second resolution)."""
        return _to_datetime(self.token_time)

    @property
    def server_datetime(self) -> datetime | None:
        """:attr:`server_time` as an aware UTC ``datetime`` (second resolution)."""
        return _to_datetime(self.server_time)

    @property
    def lag(self) -> timedelta | None:
        """``server_time - token_time`` (never negative); ``None`` if either is unknown."""
        if self.token_time is None or self.server_time is None:
            return None
        return timedelta(seconds=max(0, self.server_time.time - self.token_time.time))

    @classmethod
    def of(cls, token: Mapping[str, Any] | None, server_time: Timestamp | None) -> Position:
        """The position for a stream holding ``token`` that has seen ``server_time``."""
        token_time = None if token is None else token_cluster_time(token)
        return cls(token_time, _later(server_time, token_time))
