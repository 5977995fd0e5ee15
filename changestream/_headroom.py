"""Oplog headroom: how far a stream's token is from the oldest oplog entry, as time (no I/O).

When the oplog rolls past a stored token, history is lost (code 286). The
headroom, ``token cluster time - oldest oplog entry's ts``, says how close that
is. Only a replica-set member can tell: the first entry of ``local.oplog.rs``
(read with ``$natural`` order, needs ``find`` on ``local``). Through mongos
(sharded clusters, most load balancers) the ``local`` database is not
readable, and without the privilege the read fails: then the metric stays
absent and one log line says why. :class:`HeadroomProbe` decides when to read
(every :data:`PROBE_EVERY` seconds), what a result or an error means, and when
to warn; the stats timer (``aio/_stats_timer.py``) does the read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from bson.timestamp import Timestamp
from pymongo.errors import OperationFailure

from ._position import Position
from ._stream_view import StreamView
from .errors import describe_error

__all__ = ["HEADROOM_WARNING", "PROBE_EVERY", "HeadroomProbe", "oplog_client"]

log = logging.getLogger("changestream.consume")

PROBE_EVERY = 60.0
"""Seconds between reads of the oldest oplog entry (it moves slowly; the token's time is live)."""
HEADROOM_WARNING = timedelta(hours=1)
"""Below this headroom a WARNING is logged (once per crossing)."""
OPLOG_QUERY: Mapping[str, Any] = {"projection": {"ts": 1, "_id": 0}, "sort": [("$natural", 1)]}
"""``find_one`` keyword arguments for the oldest oplog entry."""


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


class HeadroomProbe:
    """When to read the oldest oplog entry, and the headroom it gives (see the module docstring)."""

    def __init__(
        self,
        warn_below: timedelta = HEADROOM_WARNING,
        every: float = PROBE_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._warn_below = warn_below
        self._every = every
        self._clock = clock
        self._last: float | None = None
        self.oldest: Timestamp | None = None
        """``ts`` of the oldest oplog entry at the last read (``None``: unknown)."""
        self.unavailable: str | None = None
        """Why the headroom cannot be read here (logged once); no more reads then."""
        self._warned = False

    def due(self) -> bool:
        """Time to read again (never once the deployment said it cannot be read)."""
        if self.unavailable is not None:
            return False
        return self._last is None or self._clock() - self._last >= self._every

    def give_up(self, why: str) -> None:
        """The headroom cannot be known here: say why, once, and stop reading."""
        if self.unavailable is None:
            self.unavailable = why
            log.info("oplog headroom not reported: %s", why)

    def read(self, entry: Mapping[str, Any] | None) -> None:
        """The oldest oplog entry as read (``None``: the oplog was empty or hidden)."""
        self._last = self._clock()
        ts = None if entry is None else entry.get("ts")
        if isinstance(ts, Timestamp):
            self.oldest = ts
        else:
            self.give_up("local.oplog.rs returned no entry with a 'ts' (not a replica-set member?)")

    def failed(self, exc: BaseException) -> None:
        """The read failed: unauthorized or not allowed gives up; anything else retries later."""
        self._last = self._clock()
        if isinstance(exc, OperationFailure) and exc.code in (13, 20, 8000):
            # 13 Unauthorized; 20 IllegalOperation (mongos); 8000 Atlas' own "not allowed".
            self.give_up(
                f"reading local.oplog.rs failed ({describe_error(exc)}); grant the user 'find' on the 'local' database (e.g. the clusterMonitor role) "
                "to see it"
            )
        else:
            log.debug("reading the oldest oplog entry failed (%s); trying again later", exc)

    def headroom(self, position: Position | None) -> timedelta | None:
        """``token time - oldest entry`` (never negative), warning once below the threshold."""
        if position is None or position.token_time is None or self.oldest is None:
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
