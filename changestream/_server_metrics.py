"""The deployment's own change-stream counters beside the client's, and the time to history loss.

Two things the stats report that no single read gives (no I/O here; the stats
timer, ``aio/_stats_timer.py``, does the reads):

- :class:`ServerMetricsProbe`: ``serverStatus().metrics.changeStreams`` of the server
  the stream reads from, every :data:`~changestream._headroom.PROBE_EVERY` seconds:
  ``largeEventsSplit`` and ``largeEventsFailed`` (7.0+), and on 9.0 the cursor
  throughput sums ``cursor.docsReturned.sum`` / ``cursor.docsExamined.sum``, which give
  the oplog entries examined per event returned. Through mongos, ``serverStatus`` is
  mongos's own (its counters, not the shards'). Refused (unauthorized) or absent: said
  once (INFO), the fields stay ``None``.
- :class:`HistoryLossEstimate`: from the oplog headroom and the lag's trend over the
  last reports, the time until the stored position falls off the oplog (the lag
  reaches the oplog's window), with one WARNING when it drops below a threshold.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from pymongo.errors import OperationFailure

from ._headroom import PROBE_EVERY
from ._probe import PeriodicRead
from .errors import describe_error

__all__ = [
    "HISTORY_LOSS_WARNING",
    "SERVER_STATUS",
    "HistoryLossEstimate",
    "ServerMetrics",
    "ServerMetricsProbe",
    "server_metrics",
]

log = logging.getLogger("changestream.consume")

SERVER_STATUS: Mapping[str, Any] = {"serverStatus": 1}
"""The command (on ``admin``) whose ``metrics.changeStreams`` is read."""
HISTORY_LOSS_WARNING = timedelta(hours=1)
"""Below this estimated time to history loss a WARNING is logged (once per crossing)."""
TREND_REPORTS = 6
"""Reports the lag's trend is taken over (a minute at the default ``stats_interval``)."""
MIN_GROWTH = 1e-3
"""A lag growing slower than this (seconds per second: 3.6 s an hour) is no trend."""
_GIVE_UP_CODES = (13, 59, 115, 8000)
"""13 Unauthorized; 59 CommandNotFound, 115 CommandNotSupported; 8000 Atlas' "not allowed"."""


@dataclasses.dataclass(frozen=True)
class ServerMetrics:
    """What one read of ``metrics.changeStreams`` said (``None``: the server has no such counter)."""

    large_events_split: int | None = None
    large_events_failed: int | None = None
    docs_returned: int | None = None
    docs_examined: int | None = None


def _number(value: Any) -> int | None:
    if isinstance(value, Mapping):  # 9.0's cursor throughput: {sum: ...}
        value = value.get("sum")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def server_metrics(reply: Mapping[str, Any]) -> ServerMetrics | None:
    """``metrics.changeStreams`` of a ``serverStatus`` reply (``None``: not in it)."""
    metrics = reply.get("metrics")
    streams = metrics.get("changeStreams") if isinstance(metrics, Mapping) else None
    if not isinstance(streams, Mapping):
        return None
    cursor = streams.get("cursor")
    cursor = cursor if isinstance(cursor, Mapping) else {}
    return ServerMetrics(
        large_events_split=_number(streams.get("largeEventsSplit")),
        large_events_failed=_number(streams.get("largeEventsFailed")),
        docs_returned=_number(cursor.get("docsReturned")),
        docs_examined=_number(cursor.get("docsExamined")),
    )


class ServerMetricsProbe(PeriodicRead):
    """When to read ``serverStatus``, and what its change-stream counters say."""

    what = "the server's change-stream metrics"

    def __init__(self, every: float = PROBE_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(every, clock)
        self.latest: ServerMetrics | None = None
        """The last read (``None``: none yet, or the server cannot be asked)."""
        self._before: ServerMetrics | None = None

    def read(self, reply: Mapping[str, Any]) -> None:
        """A ``serverStatus`` reply."""
        self.read_now()
        metrics = server_metrics(reply)
        if metrics is None:
            self.give_up("serverStatus has no metrics.changeStreams (MongoDB before 7.0, or "
                         "a server that does not keep them)")
            return
        self._before, self.latest = self.latest, metrics

    def failed(self, exc: BaseException) -> None:
        """``serverStatus`` failed: refused or unknown gives up; anything else tries later."""
        self.read_now()
        if isinstance(exc, OperationFailure) and exc.code in _GIVE_UP_CODES:
            self.give_up(f"serverStatus failed ({describe_error(exc)}); grant the user the "
                         "'serverStatus' action (e.g. the clusterMonitor role) to see them")
        else:
            log.debug("serverStatus failed (%s); trying again later", exc)

    @property
    def examined_per_returned(self) -> float | None:
        """Oplog entries examined per event returned, since the previous read (the first
        read: since the server started); ``None`` where the server does not count them
        (before 9.0) or returned nothing meanwhile."""
        latest = self.latest
        if latest is None or latest.docs_returned is None or latest.docs_examined is None:
            return None
        before = self._before
        returned, examined = latest.docs_returned, latest.docs_examined
        if (before is not None and before.docs_returned is not None
                and before.docs_examined is not None and latest.docs_returned >= before.docs_returned):
            returned -= before.docs_returned
            examined -= before.docs_examined
        return examined / returned if returned > 0 else None


class HistoryLossEstimate:
    """The time until the stored position falls off the oplog, from the headroom and the lag's
    trend: a lag growing at ``g`` seconds per second uses up the headroom in ``headroom / g``.
    ``None``: no headroom known (the oplog not full, or not readable), or the lag not growing."""

    def __init__(self, warn_below: timedelta = HISTORY_LOSS_WARNING,
                 reports: int = TREND_REPORTS) -> None:
        self._warn_below = warn_below
        self._lags: collections.deque[tuple[float, float]] = collections.deque(maxlen=reports)
        self._warned = False

    def growth(self) -> float | None:
        """The lag's slope (s/s, least squares) over the last reports; ``None``: too few."""
        points = list(self._lags)
        if len(points) < 3:
            return None
        mean_t = sum(t for t, _ in points) / len(points)
        mean_l = sum(lag for _, lag in points) / len(points)
        spread = sum((t - mean_t) ** 2 for t, _ in points)
        if spread <= 0:
            return None
        return sum((t - mean_t) * (lag - mean_l) for t, lag in points) / spread

    @property
    def growing(self) -> bool:
        """The lag grows (by :data:`MIN_GROWTH` or more): an estimate needs the headroom."""
        growth = self.growth()
        return growth is not None and growth >= MIN_GROWTH

    def update(self, now: float, lag: timedelta | None,
               headroom: timedelta | None) -> timedelta | None:
        """One report: its time (monotonic s), lag and headroom; the estimate, warning once
        when it drops below the threshold."""
        if lag is not None:
            self._lags.append((now, lag.total_seconds()))
        growth = self.growth()
        estimate: timedelta | None = None
        if headroom is not None and growth is not None and growth >= MIN_GROWTH:
            estimate = timedelta(seconds=min(headroom.total_seconds() / growth, 10 * 365 * 86400))
        if estimate is not None and estimate < self._warn_below:
            if not self._warned:
                self._warned = True
                log.warning(
                    "history loss in about %s: the lag grows %.2f s per second and the stored "
                    "position is %s from the oldest oplog entry; once the oplog rolls past it "
                    "the changes since are lost (286). Speed up the consumer (workers=...) or "
                    "enlarge the oplog (replSetResizeOplog)",
                    _rounded(estimate), growth, _rounded(headroom) if headroom else headroom,
                )
        elif self._warned:
            self._warned = False
            log.info("history loss no longer near (estimate %s)",
                     "none: the lag is not growing" if estimate is None else _rounded(estimate))
        return estimate


def _rounded(delta: timedelta) -> timedelta:
    return timedelta(seconds=round(delta.total_seconds()))
