"""Where a change stream is, and how far behind the server it is (no I/O).

Two cluster times, both read from what the server sent, so client clock skew
never enters:

* ``token_time``: the cluster time inside the stream's resume token, i.e. the
  last event delivered (or, between events, the ``postBatchResumeToken`` the
  server says the stream has reached);
* ``server_time``: the newest cluster time seen in any reply of the stream
  (``operationTime`` and ``$clusterTime``; the ``postBatchResumeToken`` only from a
  reply without either: a server echoes a token it has not reached yet as its
  ``postBatchResumeToken``, so it is no reading of the server's clock).

Their difference is how far behind the stream was *when the last reply
arrived*. Server time arrives only with a reply, and none arrives while a big
batch is being handled or while the deployment is down, so ``lag`` adds the
local monotonic time since that reply (``reply_age``): a difference of two
readings of this process's own clock, so skew still never enters (counted
from when the newest server time was first seen: an idle deployment's cluster
time stands still while its wall clock runs on). While a
batch is handled (events buffered, or its last event not yet done) all of it
counts. Once everything received is handled and the caller asks for more,
only the time past the getMore's await (``max_await_time_ms``, 1 s by
default) counts: an overdue reply, so the lag keeps growing through an
outage. After a getMore that came back empty the token is its
``postBatchResumeToken``, and the lag is the reply's cluster time minus that
token's: 0 on a replica set that has sent everything, the part of the oplog a
busy server has not scanned yet otherwise (on a sharded cluster an idle shard
holds the token back by up to its no-op interval, 10 s by default). A token
ahead of the server's cluster time (from another deployment, or corrupted) gives
a negative lag: the stream skips every change until the server reaches it.
Cluster times have one-second
resolution, so the lag is the true lag (now minus the wall time of the
oldest change not yet handled) to within about a second plus the await time
(tested within 2 s, ``tests/client/test_lag_truth.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from bson.timestamp import Timestamp

from ._token import token_cluster_time

__all__ = ["Position", "newest_reply_time", "reply_cluster_time"]


def _later(a: Timestamp | None, b: Timestamp | None) -> Timestamp | None:
    if a is None:
        return b
    if b is None:
        return a
    return b if (b.time, b.inc) > (a.time, a.inc) else a


def _as_timestamp(value: Any) -> Timestamp | None:
    return value if isinstance(value, Timestamp) else None


def reply_cluster_time(reply: Mapping[str, Any]) -> Timestamp | None:
    """The server's clock as a reply reads it: the later of ``operationTime`` and
    ``$clusterTime`` (``None``: neither)."""
    newest = _as_timestamp(reply.get("operationTime"))
    gossip = reply.get("$clusterTime")
    if isinstance(gossip, Mapping):
        newest = _later(newest, _as_timestamp(gossip.get("clusterTime")))
    return newest


def newest_reply_time(reply: Mapping[str, Any], previous: Timestamp | None) -> Timestamp | None:
    """``previous`` moved forward to the newest cluster time a command reply carries.

    The ``postBatchResumeToken`` counts only in a reply without a cluster time: a
    server opened from a token it has not reached yet echoes that token, which says
    nothing of where the server is.
    """
    newest = reply_cluster_time(reply)
    if newest is None:
        cursor = reply.get("cursor")
        if isinstance(cursor, Mapping):
            pbrt = cursor.get("postBatchResumeToken")
            if isinstance(pbrt, Mapping):
                newest = token_cluster_time(pbrt)
    return _later(previous, newest)


def _to_datetime(ts: Timestamp | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts.time, tz=timezone.utc)


@dataclasses.dataclass(frozen=True)
class Position:
    """A stream's progress: see the module docstring. Cheap to build; take one when needed."""

    token_time: Timestamp | None
    """Cluster time of the resume token (``None``: no token yet, or one that cannot be read)."""
    server_time: Timestamp | None
    """Newest cluster time seen in a reply (``None``: no reply carried one)."""
    reply_age: float | None = None
    """Seconds (local monotonic clock) since the stream's last reply; ``None``: not counted."""
    waiting: bool = False
    """Everything received is handled and more was asked for: only the part of
    :attr:`reply_age` past :attr:`await_seconds` counts (the reply is overdue)."""
    caught_up: bool = False
    """Waiting after a getMore that came back empty (the token is its postBatchResumeToken)."""
    await_seconds: float = 1.0
    """How long a getMore may wait for changes (``max_await_time_ms``): a caught-up stream's
    next reply is due within it."""

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
        """How far behind the stream is now (see the module docstring).

        ``server_time - token_time`` plus the time since the reply (waiting for
        a reply, only the time past the await). Negative when the token is
        ahead of the server (:attr:`ahead`). ``None`` while either cluster time
        is unknown.
        """
        if self.token_time is None or self.server_time is None:
            return None
        age = 0.0 if self.reply_age is None else max(0.0, self.reply_age)
        if self.waiting or self.caught_up:
            age = max(0.0, age - self.await_seconds)
        return timedelta(seconds=self.server_time.time - self.token_time.time + age)

    @property
    def ahead(self) -> timedelta | None:
        """How far the token is ahead of the newest server time (``None``: it is not, or
        unknown): the server skips every change until its clock reaches the token."""
        if self.token_time is None or self.server_time is None:
            return None
        if self.token_time.time <= self.server_time.time:
            return None
        return timedelta(seconds=self.token_time.time - self.server_time.time)

    @classmethod
    def of(
        cls,
        token: Mapping[str, Any] | None,
        server_time: Timestamp | None,
        *,
        reply_age: float | None = None,
        waiting: bool = False,
        caught_up: bool = False,
        await_seconds: float = 1.0,
    ) -> Position:
        """The position for a stream holding ``token`` that has seen ``server_time``."""
        token_time = None if token is None else token_cluster_time(token)
        return cls(token_time, server_time, reply_age, waiting, caught_up, await_seconds)
