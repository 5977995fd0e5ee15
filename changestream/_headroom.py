"""Oplog headroom: how far a stream's token is from the oldest oplog entry, as time (no I/O).

When the oplog rolls past a stored token, history is lost (code 286). The
headroom, ``token cluster time - oldest oplog entry's ts``, says how close that
is, but only once the oplog is full: until it reaches its size limit nothing is
truncated, and on a new deployment the oldest entry is seconds old while
nothing is at risk. So two reads: the oplog's size and limit
(``$collStats`` storage stats of ``local.oplog.rs``: ``size``, ``maxSize``) and
its first entry (``$natural`` order). Not full (below :data:`FULL_FRACTION` of
``maxSize``, or no limit): no headroom, "not full". Cannot tell how full (the
stats unreadable): unknown, never 0. Only a replica-set member can tell: through
mongos (sharded clusters, most load balancers) the ``local`` database is not
readable, and without the privilege the reads fail: then the metric stays
absent and one log line says why. :class:`HeadroomProbe` decides when to read
(every :data:`PROBE_EVERY` seconds), what a result or an error means, and when
to warn; the stats timer (``aio/_stats_timer.py``) does the reads.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from bson.timestamp import Timestamp
from pymongo.errors import OperationFailure

from ._position import Position
from ._probe import PeriodicRead
from ._stream_view import StreamView
from .errors import describe_error

__all__ = [
    "FULL_FRACTION",
    "HEADROOM_WARNING",
    "OPLOG_STATS",
    "PROBE_EVERY",
    "HeadroomProbe",
    "OplogFill",
    "oplog_client",
    "oplog_fill",
]

log = logging.getLogger("changestream.consume")

PROBE_EVERY = 60.0
"""Seconds between reads of the oldest oplog entry (it moves slowly; the token's time is live)."""
HEADROOM_WARNING = timedelta(hours=1)
"""Below this headroom a WARNING is logged (once per crossing)."""
OPLOG_QUERY: Mapping[str, Any] = {"projection": {"ts": 1, "_id": 0}, "sort": [("$natural", 1)]}
"""``find_one`` keyword arguments for the oldest oplog entry."""
OPLOG_STATS: Mapping[str, Any] = {
    "aggregate": "oplog.rs", "pipeline": [{"$collStats": {"storageStats": {}}}], "cursor": {},
}
"""The command (on ``local``) that reads the oplog's size and size limit."""
FULL_FRACTION = 0.9
"""An oplog at this fraction of ``maxSize`` or more is full: mongod truncates it in chunks
(truncate markers), so a full oplog's size moves a little below the limit."""
_GIVE_UP_CODES = (13, 20, 59, 115, 8000)
"""13 Unauthorized; 20 IllegalOperation (mongos); 59 CommandNotFound, 115 CommandNotSupported
(a server without the stage); 8000 Atlas' own "not allowed"."""


@dataclasses.dataclass(frozen=True)
class OplogFill:
    """How full the oplog is: ``size`` bytes of ``max_size`` (``None``: no size limit)."""

    size: int
    max_size: int | None

    @property
    def full(self) -> bool:
        """At its limit: entries are being truncated, the oldest one is what a token races."""
        return self.max_size is not None and self.size >= FULL_FRACTION * self.max_size

    def describe(self) -> str:
        if self.max_size is None:
            return "the oplog has no size limit"
        percent = 100 * self.size / self.max_size if self.max_size else 100.0
        return (f"the oplog is not full ({percent:.0f}%: {self.size / 2**20:.1f} of "
                f"{self.max_size / 2**20:.1f} MiB), and nothing is truncated until it is")


def oplog_fill(reply: Mapping[str, Any]) -> OplogFill | None:
    """The oplog's fill from the reply to :data:`OPLOG_STATS` (``None``: not in it)."""
    cursor = reply.get("cursor")
    batch = cursor.get("firstBatch") if isinstance(cursor, Mapping) else None
    stats = batch[0].get("storageStats") if isinstance(batch, list) and batch and isinstance(
        batch[0], Mapping) else None
    if not isinstance(stats, Mapping):
        return None
    size, max_size = stats.get("size"), stats.get("maxSize")
    if isinstance(size, bool) or not isinstance(size, (int, float)):
        return None
    capped = stats.get("capped", True)
    if not capped or isinstance(max_size, bool) or not isinstance(max_size, (int, float)) or (
            max_size <= 0):
        return OplogFill(int(size), None)
    return OplogFill(int(size), int(max_size))


def oplog_client(stream: StreamView) -> tuple[Any, str | None]:
    """``(client, None)`` to read the oplog through, or ``(None, why not)``.

    ``stream`` is a change stream or the initial-snapshot wrapper (its stream
    once open).
    """
    client = stream.client
    if client is None:
        return None, None  # not open yet: ask again later, nothing to say
    try:
        kind = client.topology_description.topology_type_name
    except Exception:  # pragma: no cover - a client without a topology description
        return None, "the client does not describe its topology"
    if kind in ("Sharded", "LoadBalanced"):
        return None, (
            f"the deployment is {'a sharded cluster' if kind == 'Sharded' else 'behind a load balancer'}"
            ": the oplog of the shards is not readable through mongos"
        )
    return client, None


class HeadroomProbe(PeriodicRead):
    """When to read the oldest oplog entry, and the headroom it gives (see the module docstring)."""

    what = "oplog headroom"

    def __init__(
        self,
        warn_below: timedelta = HEADROOM_WARNING,
        every: float = PROBE_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(every, clock)
        self._warn_below = warn_below
        self.oldest: Timestamp | None = None
        """``ts`` of the oldest oplog entry at the last read (``None``: unknown)."""
        self.fill: OplogFill | None = None
        """How full the oplog was at the last read (``None``: unknown)."""
        self._said_not_full = False
        self._warned = False

    @property
    def full(self) -> bool | None:
        """Is the oplog full (``None``: cannot tell)? Not full: no headroom to report."""
        return None if self.fill is None else self.fill.full

    def read(self, entry: Mapping[str, Any] | None) -> None:
        """The oldest oplog entry as read (``None``: the oplog was empty or hidden)."""
        self.read_now()
        ts = None if entry is None else entry.get("ts")
        if isinstance(ts, Timestamp):
            self.oldest = ts
        else:
            self.give_up("local.oplog.rs returned no entry with a 'ts' (not a replica-set member?)")

    def read_fill(self, reply: Mapping[str, Any]) -> None:
        """The reply to :data:`OPLOG_STATS`: how full the oplog is."""
        fill = oplog_fill(reply)
        if fill is None:
            self.read_now()
            self.give_up("the oplog's storage stats ($collStats on local.oplog.rs) say nothing "
                         "of its size, so how full it is cannot be told")
            return
        self.fill = fill
        if fill.full:
            self._said_not_full = False
        elif not self._said_not_full:
            self._said_not_full = True
            log.info("oplog headroom not reported: %s", fill.describe())

    def failed(self, exc: BaseException, *, stats: bool = False) -> None:
        """A read failed (``stats``: the size read): unauthorized, not allowed or not
        supported gives up (the headroom is unknown, never 0); anything else retries later."""
        self.read_now()
        if isinstance(exc, OperationFailure) and exc.code in _GIVE_UP_CODES:
            what = "$collStats on local.oplog.rs" if stats else "local.oplog.rs"
            unknown = ", so how full the oplog is cannot be told" if stats else ""
            self.give_up(
                f"reading {what} failed ({describe_error(exc)}){unknown}; grant the user "
                "'find' and 'collStats' on the 'local' database (e.g. the clusterMonitor role) "
                "to see it"
            )
        else:
            log.debug("reading the oplog failed (%s); trying again later", exc)

    def headroom(self, position: Position | None) -> timedelta | None:
        """``token time - oldest entry`` (never negative) of a full oplog, warning once below
        the threshold; ``None`` while the oplog is not full or how full cannot be told."""
        if position is None or position.token_time is None or self.oldest is None:
            return None
        if self.fill is None or not self.fill.full:
            return None
        seconds = max(0, position.token_time.time - self.oldest.time)
        headroom = timedelta(seconds=seconds)
        if headroom < self._warn_below:
            if not self._warned:
                self._warned = True
                log.warning(
                    "oplog headroom is %s (below %s): the stored position is that close to "
                    "the oldest oplog entry; once the oplog rolls past it the history is lost "
                    "(286). Speed up the consumer or enlarge the oplog (replSetResizeOplog)",
                    headroom, self._warn_below,
                )
        elif self._warned:
            self._warned = False
            log.info("oplog headroom back to %s", headroom)
        return headroom
